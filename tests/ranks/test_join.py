"""``model.join()``: uneven inputs, against DDP's ``join()`` on 2 and 3 gloo ranks.

One rank has 2 batches fewer than the others (after ``test_ddp_uneven_inputs`` in PyTorch's
``distributed_test.py``). Every rank must leave the context without hanging, and the final
model must be DDP's on every rank: the joined rank shadows the collectives of the steps it
missed with zeros, through a traced hook's buckets and state too, as DDP's join hook runs
the hook on zero buckets. Also: ``divide_by_initial_world_size=False``, the optimizer inside
the backward, ``throw_on_early_termination``, and ``Join([model, ZeroRedundancyOptimizer])``.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_hooks_ranks import _serial_powersgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.hooks import PowerSGD
from graphddp.testing import spawn


def _batches(rank: int, world: int, steps: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches, 2 fewer on the last rank."""
    g = torch.Generator().manual_seed(rank)
    n = steps - 2 if rank == world - 1 else steps
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _train(model: Any, opt: Any, batches: Any, divide: bool = True, stepping: bool = True) -> None:
    with model.join(divide_by_initial_world_size=divide):
        for x, y in batches:
            F.mse_loss(model(x), y).backward()
            if stepping:
                opt.step()
                opt.zero_grad(set_to_none=True)


def _same_model(ours: Any, ref: Any, atol: float = 1e-5) -> None:
    refs = dict(ref.module.named_parameters())
    for name, p in ours.module.named_parameters():
        torch.testing.assert_close(p, refs[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def _uneven(rank: int, world: int, feature: str) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.01)
    options: dict[str, Any] = {"backend": "aot_eager", "bucket_cap_mb": 0.01}
    mine = copy.deepcopy(model)
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)) if feature == "adamw_inside" else (lambda ps: torch.optim.SGD(ps, lr=0.05))
    opt_ref, opt_ours = make(ref.parameters()), make(mine.parameters())
    if feature == "powersgd":
        settings = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
        ref.register_comm_hook(ddp_powersgd.PowerSGDState(None, **settings), _serial_powersgd)
        options["comm_hook"] = PowerSGD(**settings)
    if feature == "adamw_inside":
        options["optimizer"] = opt_ours
    ours = graphddp.compile(mine, **options)
    divide = feature != "divide_by_active_ranks"
    _train(ref, opt_ref, _batches(rank, world), divide)
    _train(ours, opt_ours, _batches(rank, world), divide)
    _same_model(ours, ref)
    # Training goes on after the context, in lockstep, as after DDP's join.
    x, y = _batches(rank + 10, world + 1)[0]
    for m, opt in ((ref, opt_ref), (ours, opt_ours)):
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _same_model(ours, ref)


@pytest.mark.parametrize("feature", ["sgd", "adamw_inside", "powersgd"])
def test_join_with_a_rank_two_batches_short_ends_as_ddp_on_2_ranks(feature: str) -> None:
    spawn(_uneven, 2, feature)


@pytest.mark.parametrize("feature", ["sgd", "adamw_inside", "divide_by_active_ranks"])
def test_join_on_3_ranks_ends_as_ddp(feature: str) -> None:
    spawn(_uneven, 3, feature, timeout=300)


def _throws(rank: int, world: int) -> None:
    ours = graphddp.compile(models.MLP(), backend="aot_eager")
    with pytest.raises(RuntimeError, match="exhausted|Detected at least one rank"):
        with ours.join(throw_on_early_termination=True):
            for x, y in _batches(rank, world):
                F.mse_loss(ours(x), y).backward()


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    spawn(_throws, 2)


def _with_zero(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager")
    for m in (ref, ours):
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        with Join([m, opt]):
            for x, y in _batches(rank, world):
                F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    _same_model(ours, ref)


def test_join_composes_with_zero_redundancy_optimizer() -> None:
    spawn(_with_zero, 2)
