"""Apply a Schedule to a backward graph: flatten, average, all-reduce, wait, unflatten.

The Schedule is the contract between the planner and this pass: every decision about where
communication goes is made by the planner and written into the Schedule; this pass only
carries it out, and refuses (before editing anything) a Schedule that does not fit the graph.

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
  what a compressed bucket is cast back to.
* ``Bucket.comm_dtype``: with a compression hook, the dtype on the wire.

Not read (derived from the above, or for people and the cost model): ``Bucket.overlap``,
``Schedule.graph_index``, the bucket caps, ``Schedule.unreduced``, ``Schedule.nodes``,
``GradSlot.position``, ``GradSlot.nbytes``; ``GradSlot.param_name`` only names things in errors.

Precondition: ``gm`` is the AOTAutograd backward graph the schedule was planned from (node
names in the schedule exist, output ``slot.output_index`` is that slot's gradient, every
node has ``meta["val"]``).

Postcondition, per bucket, in graph order::

    <issue_after node>
    flat_i  = view(g_i, [-1])            # clone first if g_i is not contiguous
    bucket  = cat([flat_0, ..., flat_k]) # skipped for a one-gradient bucket
    bucket  = _to_copy(bucket, comm_dtype) # only with a compression hook (fp16/bf16)
    scaled  = div(bucket, world_size)    # DDP pre-divides; same rounding as DDP
    reduced = all_reduce_(scaled, "sum", group)
    ... the rest of the backward (the overlap window) ...
    done    = wait_tensor(reduced)       # just before wait_before (today: the output)
    done    = _to_copy(done, dtype)      # only with a compression hook
    grad_i  = view(slice(done, 0, off_i, off_i + n_i), shape_i)
    <wait_before node>
    output(..., grad_i, ...)

The returned gradients are views into the reduced flat buffer (DDP's gradient_as_bucket_view),
so no copy back is made. A no-op when the schedule has no buckets.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map_only

from graphddp.comm import CAST, ALL_REDUCE, BUCKET_KEY, ROLE_KEY, WAIT
from graphddp.schedule import Bucket, Schedule

aten = torch.ops.aten

OUTPUT = "output"  # the wait_before that means "the graph's output node"


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one bucket's communication goes in this graph, resolved from its names."""

    bucket: Bucket
    issue: fx.Node  # the all-reduce chain goes right after this node
    wait: fx.Node  # the wait and unflatten views go right before this node


def _call(
    graph: fx.Graph,
    target: Callable[..., Any],
    args: tuple,
    role: str,
    bucket: int,
    kwargs: dict[str, Any] | None = None,
) -> fx.Node:
    """Create a node and give it ``meta["val"]`` by running the op on the fake inputs."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vals = tree_map_only(fx.Node, lambda n: n.meta["val"], args)
    fake_mode = detect_fake_mode(tuple(v for v in torch.utils._pytree.tree_leaves(vals)))
    if fake_mode is None:
        raise RuntimeError(f"graphddp: no fake mode found for the inputs of {node.name}")
    with fake_mode:
        node.meta["val"] = target(*vals, **kwargs)
    node.meta[BUCKET_KEY] = bucket
    node.meta[ROLE_KEY] = role
    return node


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
        found = (tuple(val.shape), str(val.dtype).replace("torch.", ""), str(val.device)) if isinstance(val, torch.Tensor) else None
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


def insert_allreduce(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    """Insert one bucketed async all-reduce per schedule bucket (see module docstring)."""
    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    placements = _place(gm, schedule, outs)
    cursor: dict[fx.Node, fx.Node] = {}  # issue point -> last node inserted after it
    pending: list[tuple[_Placement, fx.Node]] = []  # (placement, all_reduce node), in issue order
    for p in placements:
        with graph.inserting_after(cursor.get(p.issue, p.issue)):
            last = _issue(graph, p.bucket, outs, schedule)
        cursor[p.issue] = last
        pending.append((p, last))
    for p, reduced in pending:
        with graph.inserting_before(p.wait):
            _unflatten(graph, p.bucket, reduced, outs)
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return gm


def _unflatten(graph: fx.Graph, bucket: Bucket, reduced: fx.Node, outs: list[Any]) -> None:
    """Emit wait/decompress/slice/view at the current insertion point; repoint the outputs."""
    done = _call(graph, WAIT, (reduced,), "wait", bucket.index)
    if bucket.comm_dtype is not None:  # decompress back to the gradients' dtype
        dtype = getattr(torch, bucket.dtype)
        done = _call(graph, CAST, (done, dtype), "decompress", bucket.index)
    for slot, off in zip(bucket.slots, bucket.offsets()):
        piece = _call(graph, aten.slice.Tensor, (done, 0, off, off + slot.numel), "unflatten", bucket.index)
        outs[slot.output_index] = _call(graph, aten.view.default, (piece, list(slot.shape)), "unflatten", bucket.index)


def _issue(graph: fx.Graph, bucket: Bucket, outs: Sequence[Any], schedule: Schedule) -> fx.Node:
    """Emit flatten/cat/div/all_reduce_ for one bucket at the current insertion point.

    Nodes are chained with ``inserting_after`` so they appear in program order; returns the
    all-reduce node.
    """
    prev: fx.Node | None = None

    def emit(target: Callable[..., Any], args: tuple, role: str, **kwargs: Any) -> fx.Node:
        nonlocal prev
        if prev is None:
            node = _call(graph, target, args, role, bucket.index, kwargs)
        else:
            with graph.inserting_after(prev):
                node = _call(graph, target, args, role, bucket.index, kwargs)
        prev = node
        return node

    flats = []
    for slot in bucket.slots:
        grad = outs[slot.output_index]
        if not grad.meta["val"].is_contiguous():
            grad = emit(aten.clone.default, (grad,), "flatten", memory_format=torch.contiguous_format)
        flats.append(emit(aten.view.default, (grad, [slot.numel]), "flatten"))
    flat = flats[0] if len(flats) == 1 else emit(aten.cat.default, (flats,), "flatten")
    if bucket.comm_dtype is not None:  # compression hook: cast first, then divide, like DDP's
        flat = emit(CAST, (flat, getattr(torch, bucket.comm_dtype)), "compress")
    scaled = emit(aten.div.Tensor, (flat, schedule.world_size), "scale")
    return emit(ALL_REDUCE, (scaled, "sum", schedule.group_name), "all_reduce")
