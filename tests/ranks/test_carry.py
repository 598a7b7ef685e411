"""The step after ``no_sync`` carries the accumulated gradients into the compiled buckets.

DDP's bucket after ``no_sync`` holds the accumulated gradient plus the new one, and averages the
sum once, overlapped with the backward. graphddp's carrying variant does the same: the
synchronising backward takes each parameter's accumulated ``.grad`` as an input and adds it
before flattening. Before it, graphddp averaged the accumulated gradients eagerly behind the
synchronising forward, then the new ones in the buckets: twice DDP's bytes, an extra agreement,
and the optimizer inside fell back to torch's step for that step (issue 37, no per-step tax).

Checked against DDP on 2 gloo ranks, every synchronising step: where the step carries (no
eager average, the optimizer updating in the graph), and where it cannot and falls back to
the eager average on every rank (a parameter tied across a graph break, an accumulated gradient
no graph of the step takes, a graph whose backward the step does not run, ranks of which only
one accumulated); and a backward that starts at the graph's own node (a model returning its
loss from the graph), which carries.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphddp
from graphddp import models
from graphddp.testing import paired_grads, spawn

MICRO = 3  # micro-steps per step, the last one synchronising


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


class TwoHeads(nn.Module):
    """A trunk, a graph break, two heads in one graph; a micro-step's loss may leave head b out
    (its parameters unused in that backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x).relu()
        torch._dynamo.graph_break()
        return self.a(h), self.b(h)


class TwoHeadGraphs(TwoHeads):
    """The same, with head b in a graph of its own: left out, its graph's backward never runs."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x).relu()
        torch._dynamo.graph_break()
        a = self.a(h)
        torch._dynamo.graph_break()
        return a, self.b(h)


class LossInside(nn.Module):
    """Returns its loss from the compiled graph, as a Hugging Face model's ``.loss``: the
    backward starts at the graph's own node (no node of the loop's after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int, leave_out_b: bool) -> torch.Tensor:
    out = model(x)
    if isinstance(out, torch.Tensor) and out.dim() == 0:  # LossInside
        return out
    if isinstance(out, tuple):
        a, b = out
        return F.mse_loss(a, y) + (0 if leave_out_b and micro == MICRO - 1 else F.mse_loss(b, y))
    return F.mse_loss(out, y)


@contextlib.contextmanager
def _eager_averages() -> Iterator[list[int]]:
    """Count the eager averages of accumulated gradients (graphddp.runtime.sync.average_async,
    as the replica calls it) while inside; the rank pool's processes outlive the test."""
    import graphddp.frontend.replica as replica

    original, calls = replica.average_async, []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    replica.average_async = counted
    try:
        yield calls
    finally:
        replica.average_async = original


def _train(rank: int, world: int, make, expect_carry: bool, leave_out_b: bool = False, optimizer: bool = False,
           only_rank0_accumulates: bool = False) -> None:
    with _eager_averages() as averages:
        _train_counted(rank, make, expect_carry, leave_out_b, optimizer, only_rank0_accumulates, averages)


def _train_counted(rank: int, make, expect_carry: bool, leave_out_b: bool, optimizer: bool, only_rank0_accumulates: bool,
                   averages: list[int]) -> None:
    torch.manual_seed(0)
    model = make()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=leave_out_b)
    theirs = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    ours = graphddp.compile(theirs, backend="aot_eager", bucket_cap_mb=0.001, **({"optimizer": opt} if optimizer else {}))
    for step in range(3):
        for micro in range(MICRO):
            if only_rank0_accumulates and rank == 1 and micro < MICRO - 1:
                continue
            x, y = _batch(rank, step, micro)
            for m in (ref, ours):
                m.require_backward_grad_sync = micro == MICRO - 1
                _loss(m, x, y, micro, leave_out_b).backward()
        if not optimizer:
            for name, p, q in paired_grads(ours.module, ref.module, step):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
        opt_ref.step()
        opt.step()
        for o in (opt_ref, opt):
            o.zero_grad(set_to_none=True)
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step} param {name}: {m}")
    # A carrying variant, or a gated graph (its gate adds the accumulated gradients: runtime.gate).
    carried = [r.carrying is not None or r.schedule.gated for r in ours.records if r.schedule.buckets]
    if expect_carry:
        assert all(carried), "every graph with buckets can carry"
        assert not averages, f"{len(averages)} eager averages: the steps after no_sync did not carry"
        if optimizer:
            assert all(not r.fallbacks for r in ours.records), [r.fallbacks for r in ours.records]
    else:
        assert len(averages) == 3, f"expected the eager average in each of the 3 steps, got {len(averages)}"


def test_accumulated_gradients_are_averaged_in_the_buckets():
    spawn(_train, 2, models.MLP, True)


def test_the_optimizer_inside_updates_in_the_graph_after_accumulation():
    spawn(_train, 2, models.MLP, True, False, True)


def test_a_rank_that_did_not_accumulate_pairs_with_one_that_carries():
    """Rank 1 runs only the synchronising micro-step: its sync variant and rank 0's carrying
    one put the same buckets on the wire, and the average is DDP's."""
    spawn(_train, 2, models.MLP, True, False, False, True)


@pytest.mark.parametrize("optimizer", [False, True], ids=["gradients", "optimizer_inside"])
def test_a_backward_that_starts_at_the_graph_carries(optimizer):
    """``model(x).loss.backward()``: torch's _will_engine_execute_node leaves the backward's
    root out, and that root is the graph's own node; the step carries all the same."""
    spawn(_train, 2, LossInside, True, False, optimizer)


@pytest.mark.parametrize("case", ["tied_across_a_break", "a_head_left_out_of_the_loss", "a_graph_left_out_of_the_loss"])
def test_steps_that_cannot_carry_average_eagerly_on_every_rank(case):
    """A parameter tied across a graph break (its sum comes from two graphs), parameters unused
    in the synchronising micro-step, a graph whose backward that micro-step never runs: the
    accumulated gradients are averaged eagerly on every rank, as DDP's result."""
    if case == "tied_across_a_break":
        spawn(_train_gpt, 2, _break_gpt)
    else:
        spawn(_train, 2, TwoHeads if case == "a_head_left_out_of_the_loss" else TwoHeadGraphs, False, True)


def _break_gpt() -> nn.Module:
    return models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8)


def _train_gpt(rank: int, world: int, make) -> None:
    """BreakGPT: its tied embedding is read on both sides of a graph break."""
    with _eager_averages() as averages:
        _train_gpt_counted(rank, make, averages)


def _train_gpt_counted(rank: int, make, averages: list[int]) -> None:
    torch.manual_seed(0)
    model = make()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=0.001)
    for step in range(2):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            idx = torch.randint(0, 64, (4, 8), generator=g)
            for m in (ref, ours):
                m.require_backward_grad_sync = micro == MICRO - 1
                F.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
            p.grad = q.grad = None
    assert len(averages) == 2, f"expected the eager average in each step, got {len(averages)}"
