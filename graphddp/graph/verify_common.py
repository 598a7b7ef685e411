"""What every checker of a rewritten graph shares: its error, its way of failing, its lookups.

Every verifier fails the same way, a :class:`VerificationError` showing the offending node with its
neighbours; this module sits below them all so that each can raise it without importing the others.
"""
from __future__ import annotations

from typing import Iterable, NoReturn

import torch.fx as fx

from graphddp.values.comm import is_ours, is_wait


class VerificationError(RuntimeError):
    """A rewritten graph whose communication does not match its Schedule: never run it."""


def _context(gm: fx.GraphModule, node: fx.Node, radius: int = 3) -> str:
    nodes = list(gm.graph.nodes)
    i = nodes.index(node)
    lines = []
    for j in range(max(0, i - radius), min(len(nodes), i + radius + 1)):
        n = nodes[j]
        mark = ">>" if n is node else "  "
        lines.append(f"{mark} {j:4d}: {n.format_node()}")
    return "\n".join(lines)


def _fail(gm: fx.GraphModule, node: fx.Node, message: str) -> NoReturn:
    raise VerificationError(f"graphddp verify: {message}\n{_context(gm, node)}")


def _names(nodes: Iterable[fx.Node]) -> list[str]:
    return [n.name for n in nodes]


class _Graph:
    """Read-only lookups over one graph, computed once per check of it (every mode's verifier)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        # Not graph.output_node(): that asserts the output is last, and a misplaced node after
        # it is exactly what should be reported by name.
        outputs = [n for n in self.nodes if n.op == "output"]
        if len(outputs) != 1:
            raise VerificationError(f"graphddp verify: the graph has {len(outputs)} output nodes")
        self.output = outputs[0]
        returned = self.output.args[0]
        self.outs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.last_placeholder = placeholders[-1] if placeholders else None
        self._bucket_nodes: dict[int, list[fx.Node]] = {}
        self._after_waits: dict[int, set[fx.Node]] = {}

    def before(self, a: fx.Node, b: fx.Node) -> bool:
        return self.order[a] < self.order[b]

    def bucket_nodes(self, index: int) -> list[fx.Node]:
        """graphddp's nodes of bucket ``index``, in graph order."""
        if index not in self._bucket_nodes:
            self._bucket_nodes[index] = [n for n in self.nodes if is_ours(n, index)]
        return self._bucket_nodes[index]

    def after_waits(self, index: int) -> set[fx.Node]:
        """The nodes of bucket ``index`` that depend on one of its waits (computed once)."""
        if index not in self._after_waits:
            nodes = self.bucket_nodes(index)
            mine, region = set(nodes), set()
            for node in nodes:  # graph order: a node's bucket inputs come before it
                if is_wait(node) or any(a in region for a in node.all_input_nodes if a in mine):
                    region.add(node)
            self._after_waits[index] = region
        return self._after_waits[index]

    def returned(self, index: int) -> fx.Node:
        """The node returned as output ``index`` (the output node itself when it is not a node)."""
        out = self.outs[index] if 0 <= index < len(self.outs) else None
        return out if isinstance(out, fx.Node) else self.output
