"""A forward output that is a parameter, or a view of one, becomes a copy computed in the graph.

AOTAutograd takes such an output again from the parameter outside the compiled function, so its
gradient reaches ``grad`` past the compiled backward and its buckets, un-averaged (each rank's
weight would drift by its own term). A copy made in the graph keeps that gradient in the backward,
summed into the parameter's before its bucket goes on the wire. The output is then a fresh tensor,
not a view of the parameter. A pass on the Dynamo graph, before AOTAutograd traces it; a no-op where
no output that requires grad aliases a parameter.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from graphddp.graph.capture import storage_of


def copy_parameter_outputs(gm: fx.GraphModule, params: Iterable[int]) -> list[str]:
    """Replace each output of ``gm`` that shares a parameter input's memory (``params``:
    positions among the placeholders) and requires grad by its ``torch.clone``; returns the
    names of the nodes copied."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    memory = {storage_of(_value(placeholders[i])) for i in params if i < len(placeholders)} - {None}
    if not memory:
        return []
    output = gm.graph.output_node()
    copies: dict[fx.Node, fx.Node] = {}

    def copied(node: fx.Node) -> fx.Node:
        val = _value(node)
        if node.op == "output" or not isinstance(val, torch.Tensor) or not val.requires_grad or storage_of(val) not in memory:
            return node
        if node not in copies:
            with gm.graph.inserting_before(output):
                copy = gm.graph.call_function(torch.clone, (node,))
            copy.meta["example_value"] = val.clone()  # a fake value of its own memory
            copies[node] = copy
        return copies[node]

    output.args = fx.map_arg(output.args, copied)
    if copies:
        gm.recompile()
    return [n.name for n in copies]


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))
