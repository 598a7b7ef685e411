"""Where each bucket of a Schedule goes in a graph: its names resolved to nodes, checked first.

Both rewrites of a backward (replicated and sharded) check that the Schedule fits the graph before
they edit anything (:func:`place_buckets`, read-only), then splice each bucket in two parts through
one :class:`IssuePoints`: after the issue point, and before the wait (or update) point.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection, Sequence

import torch
import torch.fx as fx

from graphddp.graph.trace import splice
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, Schedule, dtype_name


@dataclasses.dataclass(frozen=True)
class Anchors:
    """Where one bucket's communication goes in this graph, resolved from its names."""

    bucket: Bucket
    issue: fx.Node  # its collective's issue goes right after this node
    wait: fx.Node  # its wait (or update) and what follows go right before this node


def _node_named(nodes: dict[str, fx.Node], bucket: Bucket, field: str, name: str) -> fx.Node:
    if name not in nodes:
        raise RuntimeError(f"graphddp: bucket {bucket.index}: {field} names node {name!r}, which is not in the graph")
    return nodes[name]


def _check_slots(bucket: Bucket, outs: Sequence[Any], order: dict[fx.Node, int], issue: fx.Node) -> None:
    """The graph must hold what the schedule says each slot is, produced by the issue point."""
    for slot in bucket.slots:
        if slot.zero_filled:  # no gradient in this graph: zeros take its place (_zeros)
            if slot.dtype != bucket.dtype:
                raise RuntimeError(f"graphddp: bucket {bucket.index}: zero-filled {slot.param_name!r} is {slot.dtype} in a {bucket.dtype} bucket")
            continue
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


def place_buckets(gm: fx.GraphModule, schedule: Schedule, outs: Sequence[Any], only: set[int] | None = None) -> list[Anchors]:
    """Resolve every bucket's names to nodes (``only`` those buckets) and check the schedule fits the
    graph: well formed, each issue point before its wait point, each output the slot's gradient."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = graph.output_node()
    problem = schedule.structure_error()
    if problem:
        raise RuntimeError(f"graphddp: {problem}")
    found = []
    for bucket in schedule.buckets:
        if only is not None and bucket.index not in only:
            continue
        issue = _node_named(nodes, bucket, "issue_after", bucket.issue_after)
        issue = placeholders[-1] if issue.op == "placeholder" else issue  # placeholders stay first
        wait = output if bucket.wait_before == WAIT_AT_OUTPUT else _node_named(nodes, bucket, "wait_before", bucket.wait_before)
        if order[wait] <= order[issue]:
            raise RuntimeError(
                f"graphddp: bucket {bucket.index}: wait_before {wait.name} is not after the issue point "
                f"{issue.name} (issue_after={bucket.issue_after!r})"
            )
        _check_slots(bucket, outs, order, issue)
        found.append(Anchors(bucket, issue, wait))
    return found


class IssuePoints:
    """Where each bucket's early part goes: right after its issue point (after the graph's
    inputs, and the nodes in ``first``, for a bucket issued with the inputs), after any bucket
    issued at the same point before it, so buckets sharing an issue point keep bucket order."""

    def __init__(self, graph: fx.Graph, first: Collection[fx.Node] = ()) -> None:
        self.graph = graph
        self.last_input = [n for n in graph.nodes if n.op == "placeholder" or n in first][-1]
        self.cursor: dict[fx.Node, fx.Node] = {}  # issue point -> the last node spliced after it

    def splice(
        self, traced: fx.GraphModule, inputs: Sequence[fx.Node], issue: fx.Node, late: Collection[fx.Node], wait: fx.Node, bucket: int,
    ) -> Any:
        """``traced`` spliced in two parts: its ``late`` nodes right before ``wait``, the rest right after ``issue``."""
        issue = self.last_input if issue.op == "placeholder" else issue
        early = self.cursor.get(issue, issue).next
        outputs = splice(self.graph, traced, inputs, early, bucket, late=(late, wait))
        self.cursor[issue] = early.prev
        return outputs
