"""Apply a Schedule to a backward graph: flatten, average, all-reduce, wait, unflatten.

The Schedule is the contract between the planner and this pass: every decision about where
communication goes is made by the planner and written into the Schedule; this pass only
carries it out, and refuses (before editing anything) a Schedule that does not fit the graph.

A bucket is two small Python functions, traced (``passes/trace.py``, the pattern of
Inductor's ``bucketing.py``) on the graph's fake gradients and spliced in: ``issue`` right
after the issue point, ``wait`` right before the wait point. The communication hook
(``graphddp.hooks``) is called inside them, so a hook is traced exactly like the rest of the
bucket and the pass knows nothing of what it does. Every bucket is traced before the first
edit, so neither a schedule nor a hook that does not fit leaves a half-rewritten graph.

Fields read, and what each one decides:

* ``Schedule.world_size``: the divisor of each bucket (DDP pre-divides).
* ``Schedule.group_name``: the process group every all-reduce runs on.
* ``Bucket.index``: tags every node made for the bucket (``meta[BUCKET_KEY]``); must equal
  the bucket's position in ``Schedule.buckets``.
* ``Bucket.issue_after``: the all-reduce is issued right after this node (after the last
  placeholder when it names a placeholder). It may not come before any slot's producer.
* ``Bucket.wait_before``: the wait, the decompress cast and the unflatten views go right
  before this node; ``"output"`` is the graph's output node. It must come after the issue
  point.
* ``Bucket.slots`` in order, with ``Bucket.offsets()``: the layout of the flat buffer. Per
  slot, ``output_index`` says which output is flattened and replaced, ``numel`` and
  ``shape`` size the flatten and unflatten views. ``producer``, ``shape`` and ``dtype`` are
  checked against the graph (the output must be that node, of that shape and dtype).
* ``Bucket.dtype`` / ``Bucket.device``: checked against every slot's gradient; ``dtype`` is
  what the hook's decompress must return.
* ``Bucket.comm_dtype``: the dtype on the wire (None: ``dtype``). It picks the built-in hook
  (``hooks.for_bucket``), and the hook's compress must return it.

Not read (derived from the above, or for people and the cost model): ``Bucket.overlap``,
``Schedule.graph_index``, the bucket caps, ``Schedule.unreduced``, ``Schedule.nodes``,
``GradSlot.position``, ``GradSlot.nbytes``; ``GradSlot.param_name`` only names things in errors.

Precondition: ``gm`` is the AOTAutograd backward graph the schedule was planned from (node
names in the schedule exist, output ``slot.output_index`` is that slot's gradient, every
node has ``meta["val"]`` fake tensors, all from one fake mode).

Postcondition, per bucket, in graph order; every node is tagged with the bucket
(``meta[BUCKET_KEY]``), the role of the part of the function that made it (``meta[ROLE_KEY]``,
left column) and a fake ``meta["val"]``::

    <issue_after node>
    # issue(*grads), traced:
    flatten     flat_i  = view(g_i, [n_i])         # clone first if g_i is not contiguous
    flatten     flat    = cat([flat_0, ..., flat_k]) # skipped for a one-gradient bucket
    compress    sent    = hook.compress(flat)      # fp16/bf16: convert_element_type(flat, comm_dtype)
    scale       scaled  = div(sent, world_size)    # DDP pre-divides, after the cast as DDP does
    all_reduce  reduced = all_reduce_(scaled, "sum", group)
    ... the rest of the backward (the overlap window) ...
    # wait(reduced), traced, just before wait_before (by default the output):
    wait        done    = wait_tensor(reduced)
    decompress  done    = hook.decompress(done)    # fp16/bf16: convert_element_type(done, dtype)
    unflatten   grad_i  = view(slice(done, 0, off_i, off_i + n_i), shape_i)
    <wait_before node>
    output(..., grad_i, ...)

The default hook adds no node in ``compress`` and ``decompress``. The returned gradients are
views into the reduced flat buffer (DDP's gradient_as_bucket_view), so no copy back is made.
A no-op when the schedule has no buckets.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphddp import hooks
from graphddp.comm import ALL_REDUCE, WAIT
from graphddp.passes.trace import role, splice, trace
from graphddp.schedule import Bucket, Schedule, dtype_name

aten = torch.ops.aten

OUTPUT = "output"  # the wait_before that means "the graph's output node"


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one bucket's communication goes in this graph, resolved from its names."""

    bucket: Bucket
    issue: fx.Node  # the all-reduce chain goes right after this node
    wait: fx.Node  # the wait and unflatten views go right before this node


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One bucket's two halves, traced on the graph's fake values but not yet in the graph."""

    placement: _Placement
    issue: fx.GraphModule  # gradients -> all-reduce
    wait: fx.GraphModule  # all-reduce -> gradients, views into the reduced buffer


def _node_named(nodes: dict[str, fx.Node], bucket: Bucket, field: str, name: str) -> fx.Node:
    if name not in nodes:
        raise RuntimeError(f"graphddp: bucket {bucket.index}: {field} names node {name!r}, which is not in the graph")
    return nodes[name]


def _issue_point(nodes: dict[str, fx.Node], placeholders: list[fx.Node], bucket: Bucket) -> fx.Node:
    """The node the bucket's all-reduce chain follows; placeholders stay first."""
    node = _node_named(nodes, bucket, "issue_after", bucket.issue_after)
    return placeholders[-1] if node.op == "placeholder" else node


def _wait_point(nodes: dict[str, fx.Node], output: fx.Node, bucket: Bucket) -> fx.Node:
    return output if bucket.wait_before == OUTPUT else _node_named(nodes, bucket, "wait_before", bucket.wait_before)


def _check_slots(bucket: Bucket, outs: Sequence[Any], order: dict[fx.Node, int], issue: fx.Node) -> None:
    """The graph must hold what the schedule says each slot is, produced by the issue point."""
    for slot in bucket.slots:
        where = f"graphddp: bucket {bucket.index}, gradient of {slot.param_name!r} (output {slot.output_index})"
        grad = outs[slot.output_index] if 0 <= slot.output_index < len(outs) else None
        if not isinstance(grad, fx.Node):
            raise RuntimeError(f"{where}: the graph returns no gradient node there")
        if grad.name != slot.producer:
            raise RuntimeError(f"{where}: the schedule says it is produced by {slot.producer}, the graph returns {grad.name}")
        val = grad.meta.get("val")
        found = (tuple(val.shape), dtype_name(val.dtype), str(val.device)) if isinstance(val, torch.Tensor) else None
        if found != (slot.shape, bucket.dtype, bucket.device) or slot.dtype != bucket.dtype:
            raise RuntimeError(
                f"{where}: {grad.name} is {found}, the schedule says {(slot.shape, slot.dtype, bucket.device)} "
                f"in a {bucket.dtype} bucket"
            )
        if order[grad] > order[issue]:
            raise RuntimeError(f"{where}: issued after {issue.name}, before its producer {grad.name}")


def _place(gm: fx.GraphModule, schedule: Schedule, outs: Sequence[Any]) -> list[_Placement]:
    """Resolve every bucket's names to nodes and check the schedule fits the graph.

    Runs before any edit, so a schedule that does not fit leaves the graph untouched.
    """
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = graph.output_node()
    problem = schedule.structure_error()
    if problem:
        raise RuntimeError(f"graphddp: {problem}")
    placements = []
    for bucket in schedule.buckets:
        issue = _issue_point(nodes, placeholders, bucket)
        wait = _wait_point(nodes, output, bucket)
        if order[wait] <= order[issue]:
            raise RuntimeError(
                f"graphddp: bucket {bucket.index}: wait_before {wait.name} is not after the issue point "
                f"{issue.name} (issue_after={bucket.issue_after!r})"
            )
        _check_slots(bucket, outs, order, issue)
        placements.append(_Placement(bucket, issue, wait))
    return placements


# -- the bucket as two traced functions -----------------------------------------------------


def _flatten(grads: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """The bucket's gradients as one flat buffer, in slot order."""
    flats = []
    for grad, slot in zip(grads, bucket.slots, strict=True):
        if not grad.is_contiguous():  # a view can only flatten contiguous memory
            grad = aten.clone.default(grad, memory_format=torch.contiguous_format)
        flats.append(aten.view.default(grad, [slot.numel]))
    return flats[0] if len(flats) == 1 else aten.cat.default(flats)


def _issue_fn(bucket: Bucket, hook: hooks.CommHook, schedule: Schedule) -> Callable[..., torch.Tensor]:
    """gradients -> flatten -> hook.compress -> divide -> in-place all-reduce (in flight)."""
    wire = getattr(torch, bucket.comm_dtype or bucket.dtype)

    def issue(*grads: torch.Tensor) -> torch.Tensor:
        with role("flatten"):
            flat = _flatten(grads, bucket)
        with role("compress"):
            sent = hook.compress(flat, bucket)
        if sent.dtype != wire:  # the schedule's bytes on the wire (and the cost model) assume `wire`
            raise RuntimeError(
                f"graphddp: bucket {bucket.index}: hook {hook.name!r} sends {sent.dtype}, the schedule plans {wire}"
            )
        with role("scale"):
            scaled = aten.div.Tensor(sent, schedule.world_size)  # DDP pre-divides, after compressing
        with role("all_reduce"):
            return ALL_REDUCE(scaled, "sum", schedule.group_name)

    return issue


def _wait_fn(bucket: Bucket, hook: hooks.CommHook) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """all-reduce -> wait -> hook.decompress -> one view per slot into the reduced buffer."""
    dtype = getattr(torch, bucket.dtype)

    def wait(reduced: torch.Tensor) -> list[torch.Tensor]:
        with role("wait"):
            done = WAIT(reduced)
        with role("decompress"):
            done = hook.decompress(done, bucket)
        if done.dtype != dtype or tuple(done.shape) != (bucket.numel,):
            raise RuntimeError(
                f"graphddp: bucket {bucket.index}: hook {hook.name!r} decompresses to {done.dtype} "
                f"{list(done.shape)}, the bucket's gradients need {dtype} [{bucket.numel}]"
            )
        with role("unflatten"):  # views, not copies: DDP's gradient_as_bucket_view
            return [
                aten.view.default(aten.slice.Tensor(done, 0, off, off + slot.numel), list(slot.shape))
                for slot, off in zip(bucket.slots, bucket.offsets())
            ]

    return wait


def _trace_bucket(p: _Placement, outs: Sequence[Any], schedule: Schedule, hook: hooks.CommHook) -> _Traced:
    """Trace both halves of one bucket on the fake values of its gradients; edits nothing."""
    bucket = p.bucket
    what = f"bucket {bucket.index} (hook {hook.name!r})"
    grads = [outs[slot.output_index].meta["val"] for slot in bucket.slots]
    issue = trace(_issue_fn(bucket, hook, schedule), grads, f"the issue half of {what}")
    reduced = issue.graph.output_node().args[0].meta["val"]
    wait = trace(_wait_fn(bucket, hook), [reduced], f"the wait half of {what}")
    return _Traced(p, issue, wait)


def insert_allreduce(gm: fx.GraphModule, schedule: Schedule, *, hook: hooks.CommHook | None = None) -> fx.GraphModule:
    """Insert one bucketed async all-reduce per schedule bucket (see module docstring).

    ``hook`` is traced around every bucket's all-reduce; by default each bucket gets the
    built-in hook its ``comm_dtype`` names (``hooks.for_bucket``).
    """
    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    placements = _place(gm, schedule, outs)
    traced = [_trace_bucket(p, outs, schedule, hook or hooks.for_bucket(p.bucket)) for p in placements]
    # Edits start here, once every bucket has been placed and traced.
    cursor: dict[fx.Node, fx.Node] = {}  # issue point -> last node inserted after it
    reduced: list[fx.Node] = []  # each bucket's all-reduce, in schedule order
    for t in traced:
        p = t.placement
        grads = [outs[slot.output_index] for slot in p.bucket.slots]
        before = cursor.get(p.issue, p.issue).next
        reduced.append(splice(graph, t.issue, grads, before, p.bucket.index))
        cursor[p.issue] = before.prev  # the next bucket issued at this point follows this one
    for t, all_reduce in zip(traced, reduced):
        p = t.placement
        views = splice(graph, t.wait, [all_reduce], p.wait, p.bucket.index)
        for slot, view in zip(p.bucket.slots, views, strict=True):
            outs[slot.output_index] = view
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return gm
