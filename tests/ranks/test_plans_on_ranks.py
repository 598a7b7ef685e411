"""The planner against DDP: the buckets graphddp plans equal the buckets DDP's reducer makes on real ranks."""
from __future__ import annotations

import copy

import torch

from graphddp.config import DDP_DEFAULT_CAPS
from graphddp.testing import spawn


def names(schedule):
    """The bucket layout as nested tuples of parameter names: the shape of a schedule."""
    return [b.param_names for b in schedule.buckets]


WIDTHS = (96, 256, 128, 224, 160, 256, 192, 96, 240, 128, 256, 200, 112)  # 12 weights, 40-256 KiB


def _chain() -> torch.nn.Module:
    """Bias-free linears of mixed sizes: eager autograd and the compiled backward both finish
    the weights' gradients last layer first, so DDP's ready order is graphddp's production order."""
    layers = [torch.nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.Tanh())))


def _ddp_buckets(model: torch.nn.Module, caps: dict) -> set[tuple[str, ...]]:
    """DDP's buckets after its reducer rebuilt them in gradient-ready order (iteration 2)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, **caps)
    for _ in range(3):
        ddp(torch.randn(4, WIDTHS[0])).sum().backward()
    data = ddp._get_ddp_logging_data()
    assert data["has_rebuilt_buckets"] == 1, data
    names_by_index = [n for n, _ in model.named_parameters()]
    return {tuple(names_by_index[int(i)] for i in bucket.split())
            for bucket in data["rebuilt_per_bucket_param_indices"].split(",")}


def _compare_with_ddp(rank: int, world_size: int) -> None:
    import graphddp

    for caps in ({}, {"bucket_cap_mb": 0.3}, {"bucket_cap_mb_list": [0.1, 0.5, 0.2]}):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _chain()
        ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", **(caps or DDP_DEFAULT_CAPS))
        ours(torch.randn(4, WIDTHS[0])).sum().backward()
        (schedule,) = ours.schedules
        assert set(names(schedule)) == _ddp_buckets(model, caps), (caps, schedule.to_table())
        if not caps:  # DDP's default: the 1 MB first bucket really is smaller than the rest
            assert schedule.num_buckets == 2 and schedule.first_bucket_cap_mb == 1.0


def test_buckets_equal_ddps_reducer_buckets_with_and_without_bucket_cap_mb():
    spawn(_compare_with_ddp, 2)
