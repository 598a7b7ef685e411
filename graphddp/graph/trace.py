"""Trace a small Python function on a graph's fake values and splice its nodes into the graph.

The pattern of Inductor's ``fx_passes/bucketing.py`` (``_trace``, ``_insert_fn_trace_before_node``):
a rewrite is written as ordinary tensor code, ``make_fx`` turns it into nodes on the fake
tensors already in the graph (so nothing real is allocated or run), and the nodes are copied in
where the rewrite belongs. Writing the rewrite as a function keeps it readable, gives every new
node a ``meta["val"]`` from the tracer rather than by hand, and lets a function we did not write
(a communication hook) be traced through the same path as our own code.

Every node graphddp adds carries a role (``meta[ROLE_KEY]``) that the verifier and tests read.
The function says which part made a node with ``with role("compress"): ...``; the tracer records
it as an FX annotation, and :func:`splice` moves it to ``ROLE_KEY``. Tracing is separate from
splicing so a caller can trace (and check) everything before it edits anything.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map_only

from graphddp.values.comm import BUCKET_KEY, ROLE_KEY

# What a spliced node keeps of the traced node's meta: its fake value and the tensor metadata
# derived from it. Not seq_nr and the like, which name autograd nodes of the *traced* function
# and would be wrong in the backward graph.
_KEPT_META = ("val", "tensor_meta")


@contextlib.contextmanager
def role(name: str) -> Iterator[None]:
    """Tag every op traced inside this block with role ``name``."""
    with fx_traceback.annotate({ROLE_KEY: name}):
        yield


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in memory of its own, for traced code that then writes it in place.

    Not ``clone``: the graphs graphddp rewrites are not functional, but inductor's
    ``remove_noop_ops`` assumes they are and drops a clone whose layout equals its source's, so
    an in-place write to the clone would land in the source (a parameter, a gradient that is
    also another node's input). An empty tensor and a ``copy_`` into it are never dropped."""
    aten = torch.ops.aten
    return aten.copy_.default(aten.empty.memory_format(list(t.shape), dtype=t.dtype, device=t.device), t)


def set_outputs(graph: fx.Graph, outs: Sequence[Any]) -> None:
    """Make ``outs`` the graph's outputs, and keep the output node's bookkeeping true.

    Every pass that adds, drops (``None``) or replaces an output writes it through here.
    Inductor reads the output node's meta in passes that run only for some inputs:
    ``user_visible_output_idxs`` (set by ``compile_fx_backward`` before graphddp's rewrite)
    and ``original_output_strides`` (recorded from it) decide which outputs keep their
    strides, and comprehensive padding (GPU inputs only) follows every index listed there to
    a node. An index whose output graphddp dropped (a gradient updated inside the graph)
    crashed it: ``'NoneType' object has no attribute 'target'``. So: an index stays visible
    while its output is a node; an output added past the old ones (values the runtime reads,
    such as a bucket's all-gather) is visible, so its strides are the traced ones; recorded
    strides are recorded again from the new outputs' values.
    """
    output = graph.output_node()
    old = len(output.args[0]) if isinstance(output.args[0], (tuple, list)) else 1
    output.args = (tuple(outs),)
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:
        keep = set(visible)
        output.meta["user_visible_output_idxs"] = [
            i for i, o in enumerate(outs) if isinstance(o, fx.Node) and (i in keep or i >= old)
        ]
    if "original_output_strides" in output.meta:
        output.meta["original_output_strides"] = [
            val.stride() if isinstance(o, fx.Node) and isinstance(val := o.meta.get("val"), torch.Tensor) else None
            for o in outs
        ]


def role_of(node: fx.Node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(ROLE_KEY) if isinstance(custom, dict) else None


def trace(
    fn: Callable[..., Any], vals: Sequence[torch.Tensor], what: str, decompositions: Mapping[Any, Callable[..., Any]] | None = None
) -> fx.GraphModule:
    """``fn`` traced on ``vals`` (fake tensors of one graph) into a graph of aten ops.

    Traced inside the values' own fake mode, so shapes (symbolic ones included) and devices
    are the graph's. ``what`` names the function in errors. Raises if ``fn`` made a node no
    :func:`role` block covers, or a tensor constant (a ``get_attr`` that would dangle once
    spliced into another graph). ``decompositions`` (e.g. inductor's table) decompose ops
    the graph's compiler expects decomposed, when ``fn`` is written with composite ops.
    """
    fake_mode = detect_fake_mode(tuple(vals))
    if fake_mode is None:
        raise RuntimeError(f"graphddp: {what}: its inputs carry no fake values to trace it on")
    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(fn, decomposition_table=decompositions)(*vals)
    for node in traced.graph.nodes:  # before the constants: an eager collective makes one (its group)
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "c10d":
            raise RuntimeError(
                f"graphddp: {what} calls {node.target}, an eager collective; use torch.distributed._functional_collectives"
            )
    for node in traced.graph.nodes:
        if node.op == "get_attr":
            raise RuntimeError(f"graphddp: {what} made a tensor constant ({node.target}); make it from its inputs instead")
        if node.op == "call_function" and role_of(node) is None:
            raise RuntimeError(f"graphddp: {what} made {node.name} = {node.target} outside a role() block")
    return traced


def after_all(graph: fx.Graph, nodes: Collection[fx.Node]) -> fx.Node:
    """The node right after the last of ``nodes`` in graph order (the output node when there
    are none): where to splice what must follow all of them."""
    if not nodes:
        return graph.output_node()
    wanted = set(nodes)
    last = None
    for node in graph.nodes:
        if node in wanted:
            last = node
    return graph.output_node() if last is None else last.next


def splice(
    graph: fx.Graph, traced: fx.GraphModule, inputs: Sequence[fx.Node], before: fx.Node, bucket: int,
    late: tuple[Collection[fx.Node], fx.Node] | None = None,
) -> Any:
    """Copy ``traced``'s nodes into ``graph`` right before ``before``, reading ``inputs``.

    With ``late = (nodes, point)``, those of ``traced``'s nodes go right before ``point``
    instead (a bucket's waits and what follows them; ``point`` must come after ``before``).
    Each copy is tagged with ``bucket`` and its role. Returns the traced function's outputs,
    as nodes of ``graph`` in the same structure (a node, or a list of them).
    """
    late_nodes, late_point = late if late is not None else ((), before)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs, strict=True))
    outputs: Any = None
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = tree_map_only(fx.Node, env.__getitem__, node.args[0])
            continue
        with graph.inserting_before(late_point if node in late_nodes else before):
            copy = graph.node_copy(node, env.__getitem__)
        copy.meta = {key: node.meta[key] for key in _KEPT_META if key in node.meta}
        copy.meta[BUCKET_KEY] = bucket
        copy.meta[ROLE_KEY] = role_of(node)
        env[node] = copy
    return outputs
