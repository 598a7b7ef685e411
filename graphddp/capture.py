"""From a compiled backward graph to plain facts: which output is which parameter's gradient.

AOTAutograd's backward graph returns one output per input of the Dynamo graph, in the same
order (``None`` where the input gets no gradient). Dynamo lifts parameters to graph inputs and
hands the real ``nn.Parameter`` objects to the backend as example inputs, so output ``i`` is
the gradient of whatever parameter example input ``i`` *is* (by identity). Everything the
planner needs is extracted here into :class:`GraphFacts`, a frozen value with no references
to the graph, so planning is a pure function that tests can feed by hand.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Mapping, Sequence

import torch
import torch.fx as fx

# Nodes that move no data: excluded from "compute in the overlap window".
_NON_COMPUTE_TARGETS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """One gradient output of a backward graph that belongs to a parameter."""

    output_index: int
    param_name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nbytes: int
    producer: str  # name of the node that finalises this gradient
    position: int  # topological index of ``producer``: the production order


@dataclasses.dataclass(frozen=True)
class NodeFact:
    """One backward-graph node: its order, whether it computes, its cost inputs and edges."""

    name: str
    position: int
    is_compute: bool
    flops: int = 0
    nbytes: int = 0
    inputs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the planner may know about one backward graph: ordered nodes and gradient slots."""

    nodes: tuple[NodeFact, ...]
    slots: tuple[GradSlot, ...]
    num_outputs: int


def is_compute(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return False
    return node.target not in _NON_COMPUTE_TARGETS


def output_nodes(gm: fx.GraphModule) -> list[object]:
    out = gm.graph.output_node().args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def parameter_of_inputs(
    example_inputs: Sequence[object], names_by_id: Mapping[int, str]
) -> dict[int, str]:
    """Input index -> parameter name, for the example inputs that are our parameters."""
    return {
        i: names_by_id[id(t)]
        for i, t in enumerate(example_inputs)
        if isinstance(t, torch.Tensor) and id(t) in names_by_id
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _node_fact(node: fx.Node, position: int) -> NodeFact:
    from graphddp.cost import node_flops_and_bytes

    flops, nbytes = node_flops_and_bytes(node)
    inputs = tuple(n.name for n in node.all_input_nodes)
    return NodeFact(node.name, position, is_compute(node), flops, nbytes, inputs)


def extract_facts(gm: fx.GraphModule, param_inputs: Mapping[int, str]) -> GraphFacts:
    """Read production order and gradient slots out of a backward graph (no mutation)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = tuple(_node_fact(n, order[n]) for n in gm.graph.nodes)
    outs = output_nodes(gm)
    slots = []
    for index in sorted(param_inputs):
        if index >= len(outs):
            raise RuntimeError(
                f"graphddp: backward graph has {len(outs)} outputs but parameter "
                f"{param_inputs[index]!r} is forward input {index}; cannot map gradients"
            )
        grad = outs[index]
        if not isinstance(grad, fx.Node):
            continue  # no gradient flows to this parameter in this graph
        val = grad.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise RuntimeError(f"graphddp: gradient node {grad.name} has no tensor meta['val']")
        shape = tuple(int(s) for s in val.shape)
        numel = int(val.numel())
        slots.append(
            GradSlot(
                output_index=index,
                param_name=param_inputs[index],
                shape=shape,
                dtype=_dtype_name(val.dtype),
                device=str(val.device),
                numel=numel,
                nbytes=numel * val.element_size(),
                producer=grad.name,
                position=order[grad],
            )
        )
    slots.sort(key=lambda s: (s.position, s.output_index))
    return GraphFacts(nodes=nodes, slots=tuple(slots), num_outputs=len(outs))


def names_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """id(tensor) -> first name; tied parameters keep their first (canonical) name."""
    out: dict[int, str] = {}
    for name, t in named:
        out.setdefault(id(t), name)
    return out
