"""The bytes a compiled graph holds as it runs, read off its FX graph: what its forward saves for the
backward, and the most bytes alive at once inside it.

A value is alive from the node that makes it to its last reader (FX's generated code drops each
value after its last use, and AOTAutograd's backward drops its saved inputs as it goes); views share
their base's storage and keep it alive. Parameters and the user's inputs are the caller's and are
not counted; a graph's outputs live to its end. ``gradient`` outputs of a backward can be counted
as kept to the end (a replicated step returns them all) or as freed where they are made (an
update inside the backward consumes each soon after); a gradient made by a view of another
counts once.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from graphddp.graph.capture import is_view, output_nodes


def aliases_input(node: fx.Node) -> bool:
    """A node whose value is its first input's storage: a view, or an in-place op (``copy_``)."""
    if is_view(node):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def value_bytes(node: fx.Node) -> int:
    """Bytes of the tensors a node makes (0 for symbolic sizes: an estimate never guards)."""
    total = 0
    for t in tree_leaves(node.meta.get("val")):
        if isinstance(t, torch.Tensor):
            try:
                total += int(t.numel()) * t.element_size()
            except (TypeError, RuntimeError, NotImplementedError):
                return 0
    return total


@dataclasses.dataclass(frozen=True)
class Liveness:
    """One graph's bytes: ``saved`` placeholders that are neither inputs of the caller nor
    tangents (a backward's activations), ``outputs`` (its gradients, for a backward), and its
    peaks with the outputs kept to the end or freed where they are made."""

    saved: int
    outputs: int
    peak_outputs_kept: int
    peak_outputs_freed: int
    peak_inputs_held: int  # outputs kept, and the counted inputs held to the end too (a caller that keeps its argument list)


def liveness(gm: fx.GraphModule, counted_inputs: Iterable[str], same: Mapping[str, str] | None = None) -> Liveness:
    """Walk ``gm`` in order. ``counted_inputs``: placeholder names whose bytes are the graph's to
    hold (a backward's saved activations and tangents), freed after their last reader; ``same``:
    a placeholder that is a view of another's storage -> that one's name."""
    counted = set(counted_inputs)
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" and (same or {}).get(n.name) in by_name:
            base[n] = by_name[same[n.name]]  # type: ignore[index]
        else:
            base[n] = base[n.all_input_nodes[0]] if aliases_input(n) and n.all_input_nodes else n
    last = {n: order[n] for n in nodes}  # the last reader that is not the output
    for n in nodes:
        if n.op != "output":
            for used in n.all_input_nodes:
                last[base[used]] = max(last[base[used]], order[n])
    outs = {base[o] for o in output_nodes(gm) if isinstance(o, fx.Node)}
    holds = [n for n in nodes if base[n] is n and (n.op == "call_function" or (n.op == "placeholder" and n.name in counted))]
    size = {n: value_bytes(n) for n in holds}
    saved = sum(size[n] for n in holds if n.op == "placeholder")
    frees: dict[int, list[fx.Node]] = {}
    for n in holds:
        frees.setdefault(last[n], []).append(n)
    live_kept = live_freed = live_held = peak_kept = peak_freed = peak_held = saved
    for n in nodes:
        if n.op == "call_function" and n in size:
            live_kept += size[n]
            live_freed += size[n]
            live_held += size[n]
        peak_kept, peak_freed, peak_held = max(peak_kept, live_kept), max(peak_freed, live_freed), max(peak_held, live_held)
        for dead in frees.get(order[n], ()):
            live_freed -= size[dead]
            if dead not in outs:
                live_kept -= size[dead]
                live_held -= size[dead] if dead.op == "call_function" else 0
    outputs = sum(size[n] for n in outs if n in size and n.op == "call_function")
    return Liveness(saved, outputs, peak_kept, peak_freed, peak_held)


def saved_storages(forward: fx.GraphModule) -> dict[str, str]:
    """Of a forward's outputs (the backward's placeholders have their names), those that view
    another storage -> its name: a forward input's (a parameter's, not the step's to count) or an
    earlier output's, so that a storage saved twice counts once."""
    same: dict[str, str] = {}
    first: dict[fx.Node, str] = {}
    for out in output_nodes(forward):
        if not isinstance(out, fx.Node):
            continue
        node = out
        while aliases_input(node) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        if node.op == "placeholder" and node is not out:
            same[out.name] = node.name
        elif node in first:
            same[out.name] = first[node]
        else:
            first[node] = out.name
    return same
