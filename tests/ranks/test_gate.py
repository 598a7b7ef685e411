"""The agreement read at the first bucket's issue (graphddp.runtime.gate), on 2 gloo ranks.

A gated graph issues its agreement when its backward starts and reads it inside its first
bucket's all-reduce: the host computes that bucket's gradients instead of waiting for a round
trip (issue 37's per-step tax, issue 36's host gap). When the answer says the ranks' steps
differ, its buckets are held (nothing on the wire, the local gradients returned undivided), and
the step goes on as one that agreed before its backward: the union average (ranks whose
layouts differ), or the held buckets all-reduced after the question of which parameters no rank
used. Each against DDP, gradient for gradient.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphddp
from graphddp.testing import paired_grads, spawn


class _Heads(nn.Module):
    """A trunk and two heads in one graph; a loss may leave head b out (its parameters unused)."""

    def __init__(self, flip: bool = False) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)
        self.flip = flip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x).relu()
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        return first(h), second(h)


def _read_at_first_issue(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _Heads()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    from graphddp.runtime import agree, gate

    events: list[str] = []
    issue, result = gate.Armed.allreduce, agree.PendingProbe.result
    try:
        gate.Armed.allreduce = lambda self, *a: events.append(f"issue {self.issued}") or issue(self, *a)
        agree.PendingProbe.result = lambda self: (self._answer is None and events.append("read")) or result(self)
        for step in range(2):
            events.clear()
            for m in (ref, ours):
                sum(o.sum() for o in m(x)).backward()
            for name, p, q in paired_grads(ours.module, ref.module, step):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
            for m in (ref, ours):
                m.zero_grad()
            (schedule,) = ours.schedules
            assert schedule.gated and schedule.num_buckets >= 3, schedule.to_table()
            # Waited for once, inside the first bucket's issue; every bucket then goes on the wire.
            assert events == ["issue 0", "read"] + [f"issue {i}" for i in range(1, schedule.num_buckets)], events
    finally:
        gate.Armed.allreduce, agree.PendingProbe.result = issue, result
    assert ours._state.backend.states[0].held == 0


def test_the_agreement_is_read_inside_the_first_buckets_issue():
    spawn(_read_at_first_issue, 2)


def _held(rank: int, world: int, case: str) -> None:
    torch.manual_seed(0)
    model = _Heads(flip=case == "layouts_differ" and rank == 1)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=case == "a_head_unused")
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
        y = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + step + 1))
        leave_out = case == "a_head_unused" and rank == 1 and step == 1
        for m in (ref, ours):
            a, b = m(x)
            (F.mse_loss(a, y) + (0 if leave_out else F.mse_loss(b, y))).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
        for m in (ref, ours):
            m.zero_grad()
    held = sum(s.held for s in ours._state.backend.states)
    union = ours._state.backend.union.steps
    if case == "layouts_differ":  # every step: held, then the union average
        assert (held, union) == (3, 3), (held, union)
    else:  # one step: held, then the buckets all-reduced after the OR of the unused ones
        assert (held, union) == (1, 0), (held, union)


def test_a_step_whose_layouts_differ_is_held_and_averaged_over_the_union():
    spawn(_held, 2, "layouts_differ")


def test_a_step_with_a_head_unused_on_one_rank_is_held_then_reduced_like_ddp():
    spawn(_held, 2, "a_head_unused")
