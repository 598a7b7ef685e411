"""Apply a Schedule to a backward graph: flatten, average, all-reduce, wait, unflatten.

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
    done    = wait_tensor(reduced)       # just before the first reader: the output
    done    = _to_copy(done, dtype)      # only with a compression hook
    grad_i  = view(slice(done, 0, off_i, off_i + n_i), shape_i)
    output(..., grad_i, ...)

The returned gradients are views into the reduced flat buffer (DDP's gradient_as_bucket_view),
so no copy back is made. A no-op when the schedule has no buckets.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map_only

from graphddp.comm import ALL_REDUCE, BUCKET_KEY, ROLE_KEY, WAIT
from graphddp.schedule import Schedule

aten = torch.ops.aten


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


def _anchor(gm: fx.GraphModule, name: str) -> fx.Node:
    nodes = {n.name: n for n in gm.graph.nodes}
    if name not in nodes:
        raise RuntimeError(f"graphddp: schedule names node {name!r}, which is not in the graph")
    node = nodes[name]
    if node.op == "placeholder":  # keep placeholders first: issue after the last one
        node = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    return node


def insert_allreduce(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    """Insert one bucketed async all-reduce per schedule bucket (see module docstring)."""
    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    cursor: dict[fx.Node, fx.Node] = {}  # anchor -> last node inserted after it
    pending: list[tuple[Any, fx.Node]] = []  # (bucket, all_reduce node), in issue order
    for bucket in schedule.buckets:
        anchor = _anchor(gm, bucket.issue_after)
        with graph.inserting_after(cursor.get(anchor, anchor)):
            last = _issue(graph, bucket, outs, schedule)
        cursor[anchor] = last
        pending.append((bucket, last))
    for bucket, reduced in pending:
        with graph.inserting_before(output):
            done = _call(graph, WAIT, (reduced,), "wait", bucket.index)
            if bucket.comm_dtype is not None:  # decompress back to the gradients' dtype
                dtype = getattr(torch, bucket.dtype)
                done = _call(graph, aten._to_copy.default, (done,), "decompress", bucket.index, {"dtype": dtype})
            for slot, off in zip(bucket.slots, bucket.offsets()):
                piece = _call(graph, aten.slice.Tensor, (done, 0, off, off + slot.numel), "unflatten", bucket.index)
                outs[slot.output_index] = _call(graph, aten.view.default, (piece, list(slot.shape)), "unflatten", bucket.index)
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return gm


def _issue(graph: fx.Graph, bucket: Any, outs: Sequence[Any], schedule: Schedule) -> fx.Node:
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
        flat = emit(aten._to_copy.default, (flat,), "compress", dtype=getattr(torch, bucket.comm_dtype))
    scaled = emit(aten.div.Tensor, (flat, schedule.world_size), "scale")
    return emit(ALL_REDUCE, (scaled, "sum", schedule.group_name), "all_reduce")
