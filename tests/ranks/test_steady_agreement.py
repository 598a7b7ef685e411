"""The agreement carried in a one-bucket graph's all-reduce once its position is steady
(graphddp.runtime.steady), on 2 and 3 gloo ranks, against DDP gradient for gradient.

The sequence walks every way out of and back into the steady state: steady steps (one
collective a step: the header rides in the bucket), one rank switching to another head
(another layout: the header is raised, every rank asks the classic probe, the step is
averaged over the union), the steady state found again, every rank switching at once after a
``no_sync`` micro-step (the header is raised by all, the classic probe finds them alike, and
the held bucket goes on with the accumulated gradients carried into it), and eager gradients
on one rank (a path with no bucket to carry the header sends a raised one, then the probe).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphddp
from graphddp.testing import paired_grads, spawn


class _TwoHeads(nn.Module):
    """A trunk and two heads; which head runs is a Python argument (a graph per head)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(self.trunk(x).relu())


# Per step: the head of each rank (a rank beyond the list takes the last entry), and whether a
# no_sync micro-step on the same heads comes first.
STEPS = [
    (("a",), False), (("a",), False), (("a",), False),  # steady from the second step on
    (("a", "b"), False),  # rank 1 deviates: the union average
    (("a",), False), (("a",), False),  # the classic probe again, then steady again
    (("b",), True), (("b",), False),  # every rank switches at once, carrying; then steady on b
]
# Steps whose agreement rode in the bucket (the counter), on every rank: 1, 2, 5 and 7.
IN_BUCKET = 4


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _sequence(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = _TwoHeads()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=25)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step, (heads, accumulate) in enumerate(STEPS):
        head = heads[min(rank, len(heads) - 1)]
        for m in (ref, ours):
            if accumulate:
                x, y = _batch(rank, step, 0)
                with m.no_sync():
                    F.mse_loss(m(x, head), y).backward()
            x, y = _batch(rank, step, 1)
            F.mse_loss(m(x, head), y).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(s.num_buckets == 1 and s.gated for s in ours.schedules), [s.to_table() for s in ours.schedules]
    assert counters["graphddp"]["agreement_in_bucket"] == IN_BUCKET, dict(counters["graphddp"])


@pytest.mark.parametrize("world", [2, 3])
def test_steady_steps_carry_the_agreement_and_every_way_out_matches_ddp(world):
    spawn(_sequence, world)


class _Eager(nn.Module):
    """A compiled linear, and one Dynamo never compiles: a step may use either or both."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled, self.side = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        if mode == "eager_only":
            return _eager_side(self.side, x)
        out = self.compiled(x)
        return out + _eager_side(self.side, x) if mode == "both" else out


@torch.compiler.disable
def _eager_side(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _eager_after_steady(rank: int, world: int, mode: str) -> None:
    torch.manual_seed(0)
    model = _Eager()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=25)
    for step in range(6):
        here = mode if step == 3 and rank == 1 else "compiled"  # one rank's eager gradient after steady steps
        x, y = _batch(rank, step, 0)
        for m in (ref, ours):
            F.mse_loss(m(x, here), y).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["both", "eager_only"])
def test_an_eager_gradient_on_one_rank_after_steady_steps_matches_ddp(mode):
    """``both``: the rank's graph raises the header's eager flag; ``eager_only``: the rank ran
    no graph, and its end-of-step agreement sends a raised header, then the probe."""
    spawn(_eager_after_steady, 2, mode)
