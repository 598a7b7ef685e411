"""Clipping by global norm with the optimizer inside the backward (``max_grad_norm=``), and the
guards against loops that clip ``p.grad`` or scale the loss themselves, single-process.

* The rewritten graph of an MLP on 4 fake ranks: each bucket's gradient norms between its wait
  and the next, one coefficient after the last wait, every update after it, in bucket order.
* Numerics against ``clip_grad_norm_`` + the same ``torch.optim`` (the fake group's all-reduce
  sums one rank, so the reference divides its gradients by the world size): a step that clips
  and one that does not, a parameter the optimizer does not hold (its returned gradient is
  clipped too), world size 1; the fallback (torch's clip and step after the backward) for a
  graph break and for micro-steps.
* Mutations only U6/U7 of ``verify_updates`` catch.
* Refusals: without ``optimizer=``, values that are no norm.

Across 2 gloo ranks against DDP: ``tests/ranks/test_clip_ranks.py``; loops that clip ``p.grad``
or scale the loss themselves: ``test_loop_guards.py``.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphddp
from graphddp.graph.verify import VerificationError
from graphddp.models import MLP, GraphBreakMLP
from graphddp.optim.clip import CLIP_COEFFICIENT, CLIP_NORM
from graphddp.optim.verify import verify_updates
from graphddp.testing import update_runs
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_wait

aten = torch.ops.aten
WORLD = 4
TOL = {"atol": 1e-6, "rtol": 1e-5}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _pair(fake_world, max_norm: float = 0.05, world: int = WORLD, held: str = "all", **options: Any):
    """A compiled MLP with AdamW attached and ``max_grad_norm``, and an eager reference copy
    with its own AdamW. ``held="all_but_last_bias"`` leaves one parameter out of the optimizers."""
    fake_world(world)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    ref = copy.deepcopy(model)

    def params(m: nn.Module) -> list[nn.Parameter]:
        named = list(m.named_parameters())
        return [p for n, p in named if held == "all" or n != named[-1][0]]

    opt, ref_opt = _adamw(params(model)), _adamw(params(ref))
    options = {"backend": "aot_eager", "bucket_cap_mb": 0.005, **options}
    gd = graphddp.compile(model, optimizer=opt, max_grad_norm=max_norm, **options)
    return gd, opt, ref, ref_opt


def _reference_step(
    ref: nn.Module, ref_opt: torch.optim.Optimizer, loss: torch.Tensor | None, max_norm: float, world: int, norm_type: float = 2.0,
) -> float:
    """``loss``'s backward (None: the gradients are there), clip_grad_norm_, step; the norm."""
    if loss is not None:
        (loss / world).backward()  # the fake all-reduce: one rank's gradient over the world size
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type))  # not attached: torch's, unguarded
    ref_opt.step()
    return norm


def _assert_same(gd: Any, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer, what: str) -> None:
    for (n, p), q in zip(gd.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m: f"{what}: {n}: {m}")
    for p, q in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, ref_opt.state[q][key], **TOL, msg=lambda m: f"{what}: state {key}: {m}")


# -- the rewritten graph -----------------------------------------------------------------------------


def test_clipped_graph_norms_each_bucket_after_its_wait_and_updates_after_the_last(fake_world) -> None:
    gd, _, _, _ = _pair(fake_world)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    schedule, nodes = record.schedule, list(record.graph.graph.nodes)
    assert schedule.max_grad_norm == 0.05 and schedule.num_buckets >= 2
    assert [schedule.update_after(b.index) for b in schedule.buckets] == [schedule.num_buckets - 1] * schedule.num_buckets
    waits = [nodes.index(n) for n in nodes if is_wait(n)]
    (coef,) = [nodes.index(n) for n in nodes if n.meta.get(ROLE_KEY) == CLIP_COEFFICIENT]
    for b in schedule.buckets:  # each bucket's norms overlap the later buckets' transfer
        norms = [i for i, n in enumerate(nodes) if n.meta.get(ROLE_KEY) == CLIP_NORM and n.meta[BUCKET_KEY] == b.index]
        assert norms and min(norms) > waits[b.index] and (b.index + 1 == len(waits) or max(norms) < waits[b.index + 1])
    writes = [(n.meta[BUCKET_KEY], i) for i, n in enumerate(nodes) if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "update"]
    assert min(i for _, i in writes) > coef > max(waits)
    assert [b for b, _ in writes] == sorted(b for b, _ in writes), "updates run in bucket order"
    assert "clipped to a global L2 norm of 0.05" in schedule.to_table()
    again = type(schedule).from_json(schedule.to_json())
    assert again == schedule and again.fingerprint() == schedule.fingerprint()
    unclipped = type(schedule).from_dict({k: v for k, v in schedule.to_dict().items() if k != "max_grad_norm"})
    assert unclipped.fingerprint() != schedule.fingerprint()


@pytest.mark.parametrize("world, held, norm_type", [
    (WORLD, "all", 2.0), (WORLD, "all_but_last_bias", 2.0), (1, "all", 2.0),
    (WORLD, "all_but_last_bias", 1.0), (WORLD, "all_but_last_bias", float("inf")), (WORLD, "all", 3.0),
])
def test_clipped_steps_equal_clip_grad_norm_then_step(fake_world, world: int, held: str, norm_type: float) -> None:
    """Three steps: two that clip (the norm is above 0.05) and one with a loss scaled down so
    that it does not; a parameter outside the optimizer gets its gradient clipped like torch's.
    ``grad_norm_type`` is ``clip_grad_norm_``'s ``norm_type``."""
    gd, opt, ref, ref_opt = _pair(fake_world, world=world, held=held, grad_norm_type=norm_type)
    assert all(s.grad_norm_type == norm_type for s in gd.schedules)
    outside = [(p, q) for p, q in zip(gd.module.parameters(), ref.parameters()) if not any(p is r for r in opt.param_groups[0]["params"])]
    norms = []
    for step, scale in enumerate((1.0, 1.0, 1e-6)):
        x = torch.randn(8, 16)
        for p, q in outside:
            p.grad = q.grad = None
        (gd(x).sum() * scale).backward()
        norms.append(_reference_step(ref, ref_opt, ref(x).sum() * scale, 0.05, world, norm_type))
        ref_opt.zero_grad()
        _assert_same(gd, opt, ref, ref_opt, f"step {step}")
        for p, q in outside:
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    assert norms[0] > 0.05 and norms[1] > 0.05 and norms[2] < 0.05, norms
    assert update_runs(gd) == [(3, 0)]
    assert len(outside) == (held != "all")


def test_graph_break_and_micro_steps_clip_and_step_after_the_backward(fake_world) -> None:
    """Two graphs in a step (the norm spans them), and a step of two micro-steps accumulated
    with ``require_backward_grad_sync=False``: torch's clip_grad_norm_ and step at the end of
    the backward, equal to the eager reference; a warning names the reason, once. World size 1:
    the fake group would not average the accumulated gradients."""
    fake_world(1)
    torch.manual_seed(0)
    model = GraphBreakMLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    gd = graphddp.compile(model, optimizer=opt, max_grad_norm=0.05, backend="aot_eager", bucket_cap_mb=0.005)
    with pytest.warns(UserWarning, match="max_grad_norm: the global norm spans 2 compiled graphs") as warned:
        for step in range(3):
            micro = 2 if step == 1 else 1
            for k in range(micro):
                gd.require_backward_grad_sync = k == micro - 1
                x = torch.randn(8, 16)
                gd(x).sum().backward()
                ref(x).sum().backward()
            assert _reference_step(ref, ref_opt, None, 0.05, 1) > 0.05
            ref_opt.zero_grad()
            _assert_same(gd, opt, ref, ref_opt, f"step {step}")
    assert sum("spans 2 compiled graphs" in str(w.message) for w in warned) == 2, "once per graph"
    assert all(r == (0, 3) for r in update_runs(gd))
    assert all("clip spans graphs" in r.fallbacks for r in gd.records), [r.fallbacks for r in gd.records]
    assert all(p.grad is None for p in gd.parameters())


def test_inductor_code_norms_each_bucket_between_the_waits_and_updates_after_the_last(fake_world) -> None:
    """In inductor's generated code (its reordering passes could undo the FX order): a kernel
    after each wait and before the next (the bucket's norms, overlapping the later buckets'
    transfer), and every update kernel after the last wait."""
    gd, _, _, _ = _pair(fake_world, backend="inductor")
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    code = record.generated_code
    lines = code[code.index("def call("):].splitlines()
    waits = [i for i, line in enumerate(lines) if "wait_tensor" in line]
    assert len(waits) == record.schedule.num_buckets >= 2
    for start, end in zip(waits, waits[1:]):
        assert any("cpp_fused" in line for line in lines[start + 1:end]), "\n".join(lines[start:end])
    updates = [i for i, line in enumerate(lines) if "update_exp_avg_" in line and "(" in line and "assert" not in line]
    assert updates and min(updates) > waits[-1], (updates, waits)
    assert all(p.grad is None for p in gd.parameters())


# -- the verifier: U6 and U7 with clipping --------------------------------------------------------------


def _coef(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == CLIP_COEFFICIENT)


def _unclip_bucket0(gm: fx.GraphModule) -> fx.Node:
    """Bucket 0's update reads one of its own gradient norms where it read the coefficient."""
    norm = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == CLIP_NORM and n.meta[BUCKET_KEY] == 0 and n.meta["val"].dim() == 0)
    for user in list(_coef(gm).users):
        if user.meta.get(ROLE_KEY) == "update" and user.meta[BUCKET_KEY] == 0:
            user.replace_input_with(_coef(gm), norm)
    return norm


def _mutate_unclipped_update(gm: fx.GraphModule) -> str:
    _unclip_bucket0(gm)
    return "does not read the clip coefficient"


def _mutate_update_before_last_wait(gm: fx.GraphModule) -> str:
    _unclip_bucket0(gm)
    last_wait = [n for n in gm.graph.nodes if is_wait(n)][-1]
    for node in [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "update" and n.meta[BUCKET_KEY] == 0]:
        last_wait.prepend(node)
    return "before the last bucket's wait"


def _mutate_norm_misses_a_gradient(gm: fx.GraphModule) -> str:
    view = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "unflatten" and n.target is aten.view.default)
    with gm.graph.inserting_after(view):
        other = gm.graph.call_function(aten.clone.default, (view,))
    other.meta["val"] = view.meta["val"]
    view.replace_all_uses_with(other, delete_user_cb=lambda user: user.meta.get(ROLE_KEY) == CLIP_NORM)
    return "the clip norm does not read the reduced gradient"


def _mutate_returned_unclipped(gm: fx.GraphModule) -> str:
    output = gm.graph.output_node()
    outs = list(output.args[0])
    i = next(i for i, o in enumerate(outs) if isinstance(o, fx.Node) and o.meta.get(ROLE_KEY) == "clip")
    outs[i] = outs[i].args[0]  # the reduced gradient itself, not times the coefficient
    output.args = (tuple(outs),)
    return "returned unclipped"


MUTATIONS = {
    "U7 update reads no coefficient": _mutate_unclipped_update,
    "U6 update before the last wait": _mutate_update_before_last_wait,
    "U7 norm misses a reduced gradient": _mutate_norm_misses_a_gradient,
    "U7 returned gradient unclipped": _mutate_returned_unclipped,
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verify_updates_rejects_broken_clipping(fake_world, name: str) -> None:
    gd, _, _, _ = _pair(fake_world, held="all_but_last_bias")
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    verify_updates(record.graph, record.schedule)  # pristine
    gm = copy.deepcopy(record.graph)
    expected = MUTATIONS[name](gm)
    gm.graph.lint()
    with pytest.raises(VerificationError, match=expected):
        verify_updates(gm, record.schedule)


# -- refusals ----------------------------------------------------------------------------------------


def test_max_grad_norm_without_the_optimizer_is_refused(fake_world) -> None:
    fake_world(WORLD)
    model = MLP(width=8, depth=2)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 clips .* and there is none: .*clip_grad_norm_\(model.parameters\(\), max_norm\)"):
        graphddp.compile(model, max_grad_norm=1.0)
    opt = torch.optim.AdamW(model.parameters())
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="max_grad_norm must be None or a positive, finite number"):
            graphddp.compile(model, optimizer=opt, max_grad_norm=bad)


def test_grad_norm_type_takes_what_clip_grad_norm_takes_for_p_above_zero(fake_world) -> None:
    fake_world(WORLD)
    model = MLP(width=8, depth=2)
    opt = torch.optim.AdamW(model.parameters())
    for bad in (0, -1.0, float("nan"), True, "l2", None, [2]):
        with pytest.raises(ValueError, match=r"grad_norm_type must be a number p > 0"):
            graphddp.compile(model, optimizer=opt, max_grad_norm=1.0, grad_norm_type=bad)
    with pytest.raises(ValueError, match=r"grad_norm_type=1 is the norm max_grad_norm clips by, and max_grad_norm is not given"):
        graphddp.compile(model, optimizer=opt, grad_norm_type=1)
    with pytest.raises(ValueError, match=r"grad_norm_type=1 is the norm max_grad_norm clips by"):
        graphddp.backend(model, optimizer=opt, grad_norm_type=1)
    for given, taken in ((1, 1.0), ("inf", float("inf")), (float("inf"), float("inf")), (0.5, 0.5)):
        config = graphddp.DDPConfig(max_grad_norm=1, grad_norm_type=given)
        assert (config.max_grad_norm, config.grad_norm_type) == (1.0, taken)
    assert graphddp.DDPConfig().grad_norm_type == 2.0
