"""Apply a Schedule to a backward graph: flatten, average, all-reduce, wait, unflatten.

The planner decides where communication goes; this pass only carries the Schedule out. A bucket is
one small function with its communication hook called inside, traced on the graph's fake gradients
and spliced in two parts: its last stage's waits and what follows right before ``wait_before``, the
rest right after ``issue_after`` (``_late_part``). Every bucket is placed and traced before the first
edit, so neither a schedule nor a hook that does not fit leaves a half-rewritten graph.
``Schedule.gated``: each all-reduce runs undivided on the gate of the group (``graphddp.runtime.gate``),
which divides or holds it local.

Precondition: ``gm`` is the AOTAutograd backward the schedule was planned from (its node names exist,
output ``slot.output_index`` is that slot's gradient of the slot's shape and dtype, every node has a
fake ``meta["val"]``). Postcondition, per bucket in graph order, every node tagged with its bucket
(``meta[BUCKET_KEY]``), its role (``meta[ROLE_KEY]``, left column) and a fake ``meta["val"]``::

    <issue_after node>
    flatten     flat    = cat([view(g_0, [n_0]), ...]) # no cat for a one-gradient bucket
    compress    sent    = hook.compress(flat)          # fp16/bf16: convert_element_type
    scale       scaled  = div(sent, world_size)        # DDP pre-divides, after the cast as DDP does
    all_reduce  reduced = all_reduce_(scaled, "sum", group)
    ... the rest of the backward (the overlap window) ...
    wait        done    = wait_tensor(reduced)
    decompress  done    = hook.decompress(done)
    unflatten   grad_i  = view(slice(done, 0, off_i, off_i + n_i), shape_i)
    <wait_before node>

The returned gradients are views into the reduced buffer (DDP's gradient_as_bucket_view). A
zero-filled slot (no gradient in the graph) is read from a ``zeros`` node and replaces no output.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.bucket_function import HookContext, _builtin_fn, _user_fn
from graphddp.graph.capture import descendants
from graphddp.graph.anchors import Anchors, IssuePoints, place_buckets
from graphddp.graph.trace import add_inputs, set_outputs, trace
from graphddp.hooks import builtin as hooks
from graphddp.hooks.traced import StateSpec, TracedHook
from graphddp.values.collectives import SHARDED
from graphddp.values.comm import BUCKET_KEY, CARRIED, ROLE_KEY, group_of, is_collective, is_wait
from graphddp.values.schedule import Bucket, GradSlot, Schedule

aten = torch.ops.aten

HOOK_STATE = "hook_state"  # ROLE_KEY of the placeholders a user hook's state tensors get
HOOK_STATE_SPEC = "graphddp_hook_state"  # their meta: the StateSpec
ZERO_FILL = "zero_fill"  # ROLE_KEY of the zeros a zero-filled slot's place carries


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One bucket's function, traced on the graph's fake values but not yet in the graph."""

    points: Anchors
    gm: fx.GraphModule  # (*gradients, *state tensors) -> one view per slot
    late: frozenset[fx.Node]  # nodes that go at the wait point; the rest at the issue point
    states: tuple[StateSpec, ...]  # the hook's state tensors, inputs after the gradients


def _hook_advice(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    if "DataDependent" in type(e).__name__ or "data-dependent" in text:
        return "it reads a tensor's value in Python (.item(), `if tensor:`, a tensor as a size); compute with tensor ops instead"
    if "Future" in text or "Work" in text:
        return "it uses an eager collective or a Future; use torch.distributed._functional_collectives on bucket.group and return the tensor"
    return "see graphddp.hooks.traced for what a traced hook may do"


def _trace_user_bucket(
    p: Anchors, outs: Sequence[Any], zeros: Mapping[str, torch.Tensor], schedule: Schedule, hook: TracedHook, ctx: HookContext
) -> _Traced:
    bucket = p.bucket
    what = f"comm hook {hook.name!r} on bucket {bucket.index}"
    grads = [_value(slot, outs, zeros) for slot in bucket.slots]
    fake_mode = detect_fake_mode(tuple(grads))
    try:
        dry = _user_fn(bucket, hook, schedule, ctx, dry=True)
        with fake_mode:
            dry(*grads)
            specs = list(dry.learned)  # type: ignore[attr-defined]
            states = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in specs]
        # Decomposed as inductor wants the backward graph (it refuses e.g. a bare _to_copy).
        from torch._inductor.decomposition import select_decomp_table

        gm = trace(_user_fn(bucket, hook, schedule, ctx), [*grads, *states], what, select_decomp_table())
    except Exception as e:  # noqa: BLE001 - anything the tracer raises, named with the hook
        if str(e).startswith("graphddp"):  # ours already names it
            raise
        raise RuntimeError(f"graphddp: {what} cannot be traced ({_hook_advice(e)}): {type(e).__name__}: {e}") from e
    _check_user_ops(gm, schedule, what)
    return _Traced(p, gm, _late_part(gm, what), tuple(specs))


def _check_user_ops(gm: fx.GraphModule, schedule: Schedule, what: str) -> None:
    """Refuse what traces but would be wrong in the graph: random numbers, collectives on
    another group (``trace`` refuses eager collectives and constants)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise RuntimeError(f"graphddp: {what} draws random numbers ({target}) inside the graph; ranks would disagree. Draw them outside, into state")
        if is_collective(node):
            group = group_of(node)
            if group != schedule.group_name:
                raise RuntimeError(f"graphddp: {what} runs {target} on group {group!r}; use bucket.group ({schedule.group_name!r})")


def _late_part(gm: fx.GraphModule, what: str) -> frozenset[fx.Node]:
    """The nodes that go at the wait point: the waits of the last stage (the collectives no other
    collective depends on) and what follows them."""
    nodes = list(gm.graph.nodes)
    collectives = [n for n in nodes if is_collective(n)]
    after = {c: descendants(list(c.users)) for c in collectives}
    last = [c for c in collectives if not any(other in after[c] for other in collectives if other is not c)]
    late = frozenset(descendants([u for c in last for u in c.users if is_wait(u)]))
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:  # moving the late part after the early one must not reorder a write
        target = node.target
        if node in late or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        written = node.args[0] if node.args else None
        for reader in getattr(written, "users", ()):
            if reader in late and order[reader] < order[node]:
                raise RuntimeError(
                    f"graphddp: {what}: {node.name} writes {written.name} after {reader.name}, which needs the last "
                    "collective's result, reads it; write state after the last wait"
                )
    return late


def _trace_bucket(
    p: Anchors, outs: Sequence[Any], zeros: Mapping[str, torch.Tensor], schedule: Schedule, hook: hooks.CommHook,
    carried: Sequence[torch.Tensor] = (),
) -> _Traced:
    what = f"bucket {p.bucket.index} (hook {hook.name!r})"
    grads = [_value(slot, outs, zeros) for slot in p.bucket.slots]
    gm = trace(_builtin_fn(p.bucket, hook, schedule), [*grads, *carried], what)
    return _Traced(p, gm, _late_part(gm, what), ())


def _slot_values(graph: fx.Graph, slots: Sequence[GradSlot], make: Any) -> list[torch.Tensor]:
    """Fake values shaped as ``slots``' parameters, contiguous (what autograd's accumulation leaves
    in ``.grad``), made by ``make`` in the graph's fake mode."""
    fake_mode = detect_fake_mode(tuple(n.meta.get("val") for n in graph.find_nodes(op="placeholder")))
    with fake_mode:
        return [make(s.shape, dtype=getattr(torch, s.dtype), device=torch.device(s.device)) for s in slots]


def _add_inputs(graph: fx.Graph, new: Sequence[tuple[int, str, torch.Tensor, Mapping[str, Any]]]) -> dict[int, list[fx.Node]]:
    """Placeholders after the existing ones, one per (bucket index, name, fake value, meta)."""
    nodes = add_inputs(graph, [name for _, name, _, _ in new], [{"val": val, BUCKET_KEY: index, **meta} for index, _, val, meta in new])
    by_bucket: dict[int, list[fx.Node]] = {}
    for (index, *_), node in zip(new, nodes):
        by_bucket.setdefault(index, []).append(node)
    return by_bucket


def _add_carried_inputs(graph: fx.Graph, buckets: Sequence[Bucket]) -> dict[int, list[fx.Node]]:
    return _add_inputs(graph, [
        (b.index, f"carried_{b.index}_{k}", val, {ROLE_KEY: CARRIED, CARRIED: slot.param_name})
        for b in buckets for k, (slot, val) in enumerate(zip(b.slots, _slot_values(graph, b.slots, torch.empty), strict=True))
    ])


def carried_inputs(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """The carrying variant's inputs: per bucket index, each slot's gradient accumulated under
    ``no_sync``, in slot order."""
    by_bucket: dict[int, list[fx.Node]] = {}
    for node in graph.find_nodes(op="placeholder"):
        if node.meta.get(ROLE_KEY) == CARRIED:
            by_bucket.setdefault(node.meta[BUCKET_KEY], []).append(node)
    return by_bucket


def _zero_values(graph: fx.Graph, schedule: Schedule) -> dict[str, torch.Tensor]:
    slots = [s for b in schedule.buckets for s in b.slots if s.zero_filled]
    return dict(zip([s.param_name for s in slots], _slot_values(graph, slots, torch.zeros))) if slots else {}


def _add_zeros(graph: fx.Graph, schedule: Schedule, values: Mapping[str, torch.Tensor]) -> dict[str, fx.Node]:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    out: dict[str, fx.Node] = {}
    for bucket in schedule.buckets:
        for slot in bucket.slots:
            if not slot.zero_filled:
                continue
            val = values[slot.param_name]
            with graph.inserting_after(last):
                node = graph.call_function(aten.zeros.default, (list(slot.shape),), {"dtype": val.dtype, "device": val.device})
            node.meta.update({"val": val, BUCKET_KEY: bucket.index, ROLE_KEY: ZERO_FILL})
            out[slot.param_name] = last = node
    return out


def _value(slot: GradSlot, outs: Sequence[Any], zeros: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return zeros[slot.param_name] if slot.zero_filled else outs[slot.output_index].meta["val"]


def _add_state_inputs(graph: fx.Graph, traced: Sequence[_Traced]) -> dict[int, list[fx.Node]]:
    return _add_inputs(graph, [
        (t.points.bucket.index, f"hook_state_{t.points.bucket.index}_{spec.name}", ph.meta["val"],
         {ROLE_KEY: HOOK_STATE, HOOK_STATE_SPEC: spec})
        for t in traced for spec, ph in zip(t.states, t.gm.graph.find_nodes(op="placeholder")[len(t.points.bucket.slots):])
    ])


def insert_collectives(
    gm: fx.GraphModule, schedule: Schedule, *, hook: hooks.CommHook | TracedHook | None = None,
    context: HookContext | None = None, carry: bool = False,
) -> fx.GraphModule:
    """Insert every schedule bucket's communication. ``hook`` defaults per bucket to the built-in
    one its ``comm_dtype`` names; a ``TracedHook`` replaces the all-reduce with the user's function
    and its state tensors become placeholders (role ``hook_state``)."""
    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    # A sharded bucket (reduce-scatter, its update, an all-gather) is the optimizer's pass's.
    anchors = [p for p in place_buckets(gm, schedule, outs) if p.bucket.collective != SHARDED]
    zero_values = _zero_values(graph, schedule)
    if carry and (isinstance(hook, TracedHook) or zero_values):
        raise ValueError(
            "graphddp: a carrying backward (accumulated gradients in its buckets) takes built-in hooks and no "
            "zero-filled slot; the compiler asks for one only then"
        )
    if isinstance(hook, TracedHook):
        ctx = context or HookContext(group=None)
        traced = [_trace_user_bucket(p, outs, zero_values, schedule, hook, ctx) for p in anchors]
    else:
        traced = [
            _trace_bucket(p, outs, zero_values, schedule, hook or hooks.for_bucket(p.bucket), _slot_values(graph, p.bucket.slots, torch.empty) if carry else ())
            for p in anchors
        ]
    # Edits start here, once every bucket has been placed and traced.
    states = _add_carried_inputs(graph, schedule.buckets) if carry else _add_state_inputs(graph, traced)
    zeros = _add_zeros(graph, schedule, zero_values)
    points = IssuePoints(graph, set(zeros.values()))  # issued at the start: after the zeros they may read
    results = []
    for t in traced:
        p = t.points
        grads = [zeros[slot.param_name] if slot.zero_filled else outs[slot.output_index] for slot in p.bucket.slots]
        results.append((p, points.splice(t.gm, grads + states.get(p.bucket.index, []), p.issue, t.late, p.wait, p.bucket.index)))
    for p, views in results:
        for slot, view in zip(p.bucket.slots, views, strict=True):
            if not slot.zero_filled:  # DDP leaves an unused parameter's gradient as it was
                outs[slot.output_index] = view
    set_outputs(graph, outs)
    graph.lint()
    gm.recompile()
    return gm
