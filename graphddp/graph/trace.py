"""Trace a small Python function on a graph's fake values and splice its nodes into the graph.

The pattern of Inductor's ``fx_passes/bucketing.py``: a rewrite is ordinary tensor code, ``make_fx``
turns it into nodes on the graph's own fake tensors, and the nodes are copied in where the rewrite
belongs. Every new node gets its ``meta["val"]`` from the tracer, and a function we did not write
(a communication hook) takes the same path as ours. Every node carries a role (``meta[ROLE_KEY]``,
set with ``with role(...)``) that the verifiers and tests read. Tracing is separate from splicing so
a caller can trace (and check) everything before it edits anything.
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
    """A copy of ``t`` in memory of its own, for traced code that then writes it in place. Not
    ``clone``: inductor's ``remove_noop_ops`` assumes a functional graph and drops a clone whose
    layout equals its source's, so the write would land in the source."""
    aten = torch.ops.aten
    return aten.copy_.default(aten.empty.memory_format(list(t.shape), dtype=t.dtype, device=t.device), t)


def set_outputs(graph: fx.Graph, outs: Sequence[Any]) -> None:
    """Make ``outs`` the graph's outputs, keeping the output node's bookkeeping true: every pass
    that adds, drops (``None``) or replaces an output goes through here.

    Inductor's comprehensive padding (GPU inputs only) follows every ``user_visible_output_idxs``
    index to a node, so a dropped output listed there would crash it. An index stays visible while
    its output is a node; an added output is visible (its strides are the traced ones); recorded
    ``original_output_strides`` are recorded again.
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


def add_inputs(graph: fx.Graph, names: Sequence[str], metas: Sequence[Mapping[str, Any]]) -> list[fx.Node]:
    """New placeholders after the existing ones, in order, each with its meta (a fake ``val`` among it)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    nodes = []
    for name, meta in zip(names, metas, strict=True):
        with graph.inserting_after(last):
            last = graph.placeholder(name)
        last.meta.update(meta)
        nodes.append(last)
    return nodes


def role_of(node: fx.Node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(ROLE_KEY) if isinstance(custom, dict) else None


def trace(
    fn: Callable[..., Any], vals: Sequence[torch.Tensor], what: str, decompositions: Mapping[Any, Callable[..., Any]] | None = None
) -> fx.GraphModule:
    """``fn`` traced on ``vals`` (fake tensors of one graph, in their fake mode) into aten ops.
    Raises on an eager collective, a node no :func:`role` block covers, or a tensor constant (a
    ``get_attr`` that would dangle once spliced); ``what`` names ``fn`` in errors."""
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
    """The node right after the last of ``nodes`` (none: the output node)."""
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
    """Copy ``traced``'s nodes into ``graph`` right before ``before``, reading ``inputs``, each
    tagged with ``bucket`` and its role; ``late = (nodes, point)``: those go before the later
    ``point``. Returns the traced outputs as nodes of ``graph``, in the same structure."""
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
