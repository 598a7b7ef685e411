"""What ``sharding="full"``'s bucketing needs to know of one graph, read before the rewrite.

Every gather of a part and every reduce of a gradient (a part's reduce-scatter, or the all-reduce
of a parameter every rank holds whole), in the order the rewrite takes them, as the nodes it
rewrites (:func:`part_gathers`, :func:`reduces`) and as plain values (:func:`part_facts`). The
buckets are planned from the values alone (:mod:`graphddp.plan.parts`), so which collectives share
a bucket is decided before the graph is touched, and the same whatever lowers it.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx as fx

from graphddp.graph.capture import byte_size
from graphddp.values.collectives import ALL_GATHER_OP, ALL_REDUCE_OUT_OP, REDUCE_SCATTER_OP
from graphddp.values.comm import CAST, is_wait
from graphddp.values.part_schedule import ALL_REDUCE, GATHER, REDUCE_SCATTER, PartCollective
from graphddp.values.placement import Placement, Whole
from graphddp.values.schedule import dtype_name

_CASTS = (CAST, torch.ops.aten._to_copy.default)

Pair = tuple[fx.Node, fx.Node]  # (a collective's issue, the node its result is final at)
UPDATE_PARAM = "update_param_"  # + k: the input of the k-th parameter an attached optimizer updates in the graph (optim.attached.layout)


def part_facts(
    graph: fx.Graph, placement: Placement | None = None, replicated: Whole | None = None,
) -> tuple[list[PartCollective], list[PartCollective]]:
    """The facts of ``graph``'s gathers and reduces (``placement``: the parts', whose replicate
    group a hybrid reduce-scatter's part goes on to; ``replicated``: the placement of the
    parameters held whole, whose gradients are all-reduced), each list in the rewrite's order.
    Read from a graph whose collectives are each waited once (as the rewrite makes it first)."""
    outputs = output_positions(graph)
    gathers = [_fact(GATHER, pair, (part_input(pair[0]).name,)) for pair in part_gathers(graph)]  # type: ignore[union-attr]
    kinds = {REDUCE_SCATTER_OP: REDUCE_SCATTER, ALL_REDUCE_OUT_OP: ALL_REDUCE}
    found = [_fact(kinds[pair[0].target], pair, outputs_reached(pair[1], outputs)) for pair in reduces(graph, placement, replicated)]
    return gathers, found


def _fact(kind: str, pair: Pair, params: tuple[str, ...]) -> PartCollective:
    issue, end = pair
    val = issue.meta["val"]
    return PartCollective(
        kind=kind, sends=issue.args[0].name, params=params, whole_bytes=byte_size(_whole(issue)),  # type: ignore[union-attr]
        dtype=dtype_name(val.dtype), device=str(val.device), group=str(issue.args[-1]), replicated=end is not wait_of(issue),
    )


def input_name(index: int) -> str:
    """AOTAutograd's name for the graph input at ``index`` (0-based) of the Dynamo graph; a
    backward's outputs are the gradients of those inputs in the same order."""
    return f"primals_{index + 1}"


def output_positions(graph: fx.Graph) -> dict[fx.Node, list[int]]:
    """Each node the graph returns, and the output positions it is returned at."""
    outs = graph.output_node().args[0]
    positions: dict[fx.Node, list[int]] = {}
    for i, out in enumerate(outs if isinstance(outs, (list, tuple)) else [outs]):
        if isinstance(out, fx.Node):
            positions.setdefault(out, []).append(i)
    return positions


def outputs_reached(end: fx.Node, positions: Mapping[fx.Node, list[int]]) -> tuple[str, ...]:
    """The inputs whose gradients the graph's outputs reached from ``end`` are (through casts,
    and the sum of a tied weight's gradients), in the order a walk from ``end`` meets them."""
    found: list[str] = []
    seen = {end}
    todo = [end]
    while todo:
        node = todo.pop(0)
        for user in node.users:
            if user.op == "output":
                found += [input_name(i) for i in positions.get(node, []) if input_name(i) not in found]
            elif user not in seen:
                seen.add(user)
                todo.append(user)
    return tuple(found)


def whole_bytes(graph: fx.Graph) -> int:
    """What the graph's collectives carry whole, in bytes: its gathered parameters, or its parts'
    gradients reduce-scattered, whichever is more (a forward only gathers; a backward
    reduce-scatters, and gathers again when the forward reshards). What a planned cap is sized by."""
    def total(pairs: list[Pair]) -> int:
        return sum(byte_size(_whole(issue)) for issue, _ in pairs)

    return max(total(part_gathers(graph)), total(reduces(graph)))


def _whole(issue: fx.Node) -> Any:
    """The full tensor of a collective: a gather's result, or the gradient a reduce-scatter sends."""
    return (issue if issue.target is ALL_GATHER_OP else issue.args[0]).meta["val"]  # type: ignore[union-attr]


def wait_of(issue: fx.Node) -> fx.Node | None:
    return next((u for u in issue.users if is_wait(u)), None)


def part_input(gather: fx.Node) -> fx.Node | None:
    """The graph input a gather sends, directly or cast to another dtype first (a
    mixed-precision policy's ``param_dtype``); None where it gathers anything else."""
    sent = gather.args[0]
    if isinstance(sent, fx.Node) and sent.target in _CASTS and len(sent.args) >= 1 and isinstance(sent.args[0], fx.Node):
        sent = sent.args[0]
    return sent if isinstance(sent, fx.Node) and sent.op == "placeholder" else None


def part_gathers(graph: fx.Graph) -> list[Pair]:
    """(gather, wait) of every graph input gathered, in the order their waits come (each wait
    right before its parameter's first read, where AOTAutograd put it)."""
    pairs = [(n, wait_of(n)) for n in graph.nodes if n.target is ALL_GATHER_OP and part_input(n) is not None]
    return [(g, w) for g, w in pairs if w is not None]


def reduces(graph: fx.Graph, placement: Placement | None = None, replicated: Whole | None = None) -> list[Pair]:
    """In issue order: (reduce-scatter, the node its part is final at): its wait, or with a
    hybrid ``placement`` the wait of the all-reduce of that part over the replicate group; and with
    ``replicated``, (all-reduce, its wait) of each gradient of a parameter held whole (a sum over
    that placement's group of what no reduce-scatter received)."""
    pairs = []
    for n in graph.nodes:
        if n.target is REDUCE_SCATTER_OP and n.args[1] == "sum" and (w := wait_of(n)) is not None:
            pairs.append((n, _replicated(w, placement) or w))
        elif replicated is not None and _whole_reduce(n, replicated) and (w := wait_of(n)) is not None:
            pairs.append((n, w))
    return pairs


def _whole_reduce(node: fx.Node, replicated: Whole) -> bool:
    sent = node.args[0] if node.target is ALL_REDUCE_OUT_OP else None
    received = isinstance(sent, fx.Node) and is_wait(sent) and getattr(sent.args[0], "target", None) is REDUCE_SCATTER_OP
    return sent is not None and node.args[1] == "sum" and node.args[2] == replicated.shard.name and not received


def _replicated(wait: fx.Node, placement: Placement | None) -> fx.Node | None:
    """The wait of the all-reduce over ``placement``'s replicate group that is the only reader
    of a reduce-scatter's ``wait``; None where there is none."""
    if placement is None or not placement.hybrid or len(wait.users) != 1:
        return None
    (reduce,) = wait.users
    if reduce.target is not ALL_REDUCE_OUT_OP or reduce.args[0] is not wait or reduce.args[2] != placement.replicate.name:  # type: ignore[union-attr]
        return None
    return wait_of(reduce) if len(reduce.users) == 1 else None
