"""Complete ``sharding="full"``'s plan of a graph with where the rewrite put each bucket, read
from the rewritten graph, and check that the graph does what was planned.

Not a planner: it reads the ``ROLE_KEY`` and ``BUCKET_KEY`` tags the rewrite puts on every node it
adds, as the verifier does, so where the schedule says a bucket is issued and waited is where the
graph does it. Parameter names come from the graph's inputs (:func:`~graphddp.graph.part_facts.input_name`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch.fx as fx

from graphddp.graph.capture import byte_size, graph_nodes, reach
from graphddp.graph.part_facts import output_positions, outputs_reached
from graphddp.graph.reshard import kept_gathered_bytes
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_collective, is_wait
from graphddp.values.part_schedule import ALL_REDUCE, GATHER, PART_KINDS, REDUCE_SCATTER, REDUCES, WAIT_OF, PartBucket, PartGraph
from graphddp.values.placement import REPLICATE, REPLICATE_WAIT
from graphddp.values.schedule import dtype_name

_ROLES = {*PART_KINDS, *WAIT_OF.values(), REPLICATE, REPLICATE_WAIT}


def describe_part_collectives(
    gm: fx.GraphModule, plan: PartGraph, world_size: int, names: Mapping[str, str],
) -> tuple[PartGraph, list[str]]:
    """``plan``, the buckets lowered into ``gm``, with its parameters named by ``names`` (an
    input's name to its parameter's) and each bucket placed as ``gm`` has it, in graph order; and
    where ``gm``'s buckets differ from the plan (empty where they agree). A bucket's parameters are
    compared as a set: the reading meets them walking the graph, in an order casts can change."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    tagged: dict[tuple[str, int], list[fx.Node]] = {}  # (role, bucket) -> its nodes, in graph order
    for n in nodes:
        if n.meta.get(ROLE_KEY) in _ROLES and n.meta.get(BUCKET_KEY) is not None:
            tagged.setdefault((n.meta[ROLE_KEY], n.meta[BUCKET_KEY]), []).append(n)
    positions = output_positions(gm.graph)
    planned = {(b.kind, b.index) for b in plan.buckets}
    extra = [(role, index) for role, index in tagged if role in PART_KINDS and (role, index) not in planned]
    wrong = [f"{plan.kind}: {role} {index} is in the graph, not in the plan" for role, index in extra]
    buckets = []
    for b in plan.buckets:
        named = dataclasses.replace(b, params=tuple(dict.fromkeys(names.get(p, p) for p in b.params)))
        if (b.kind, b.index) not in tagged:
            wrong.append(f"{plan.kind}: {b.kind} {b.index} planned, not in the graph")
            buckets.append(named)
            continue
        placed, params = _placed(named, nodes, order, tagged, world_size, names, positions)
        want, have = (sorted(named.params), named.whole_bytes, named.dtype), (sorted(set(params)), placed.whole_bytes, placed.dtype)
        if want != have:
            wrong.append(f"{plan.kind}: {b.kind} {b.index} planned as {want}, the graph's is {have}")
        buckets.append(placed)
    buckets.sort(key=lambda b: b.issue_at)
    kept = kept_gathered_bytes(gm) if plan.kind == "forward" else 0
    facts = tuple(
        dataclasses.replace(fact, is_compute=False) if is_collective(n) or is_wait(n) else fact for n, fact in zip(nodes, graph_nodes(gm))
    )
    return dataclasses.replace(plan, nodes=len(nodes), buckets=tuple(buckets), kept_bytes=kept, facts=facts), wrong


def _received(tagged: Mapping[tuple[str, int], list[fx.Node]], role: str, index: int) -> list[fx.Node]:
    """The nodes that wait for and cut what a bucket received, its own wait first: with hybrid
    sharding a reduce-scatter's part all-reduced over the replicate group and waited too."""
    found = list(tagged[(WAIT_OF[role], index)])
    if role == REDUCE_SCATTER:
        found += tagged.get((REPLICATE, index), []) + tagged.get((REPLICATE_WAIT, index), [])
    return found


def _placed(
    bucket: PartBucket, nodes: list[fx.Node], order: dict[fx.Node, int], tagged: Mapping[tuple[str, int], list[fx.Node]],
    world: int, names: Mapping[str, str], positions: Mapping[fx.Node, list[int]],
) -> tuple[PartBucket, tuple[str, ...]]:
    """``bucket`` where the graph has it: its issue nodes and the nodes that wait for and cut what
    it received; with the bytes and dtype of the graph's collective, and the parameters it carries."""
    role, issue, received = bucket.kind, tagged[(bucket.kind, bucket.index)], _received(tagged, bucket.kind, bucket.index)
    wait = next(n for n in received if is_wait(n))
    collective = next(n for n in issue if is_collective(n))
    sent = collective.args[0] if role in REDUCES else collective  # the whole: gradients sent, or gathered
    val = sent.meta["val"]
    whole = byte_size(val)
    part = whole if role == ALL_REDUCE else whole // world  # an all-reduce's bucket is whole on every rank
    params = _gathered_inputs(issue, names) if role == GATHER else _gradient_outputs(wait, names, positions)
    inside = set(received)
    return dataclasses.replace(
        bucket, dtype=dtype_name(val.dtype), whole_bytes=whole, part_bytes=part, issue_at=order[collective], wait_at=order[wait],
        issued_after=_before(nodes, order[issue[0]]), waited_before=_first_reader(wait, inside.__contains__, order),
    ), params


def _gathered_inputs(issue: list[fx.Node], names: Mapping[str, str]) -> tuple[str, ...]:
    """The graph inputs a gather bucket sends, in the order its nodes read them."""
    return tuple(dict.fromkeys(names.get(a.name, a.name) for node in issue for a in node.all_input_nodes if a.op == "placeholder"))


def _gradient_outputs(wait: fx.Node, names: Mapping[str, str], positions: Mapping[fx.Node, list[int]]) -> tuple[str, ...]:
    """The parts whose gradients a reduce-scatter bucket's results become (the graph's outputs
    they reach through casts and the sum of a tied weight's parts), by the compiler's names."""
    return tuple(dict.fromkeys(names.get(n, n) for n in outputs_reached(wait, positions)))


def _before(nodes: list[fx.Node], at: int) -> str:
    """The last node before ``at`` that no bucket added (what the collective is issued behind)."""
    for node in reversed(nodes[:at]):
        if node.op == "placeholder":
            break
        if node.meta.get(ROLE_KEY) not in _ROLES:
            return node.name
    return "start"


def _first_reader(wait: fx.Node, inside: Callable[[fx.Node], bool], order: dict[fx.Node, int]) -> str:
    """The first node, in graph order, that reads the wait's result past the bucket's own nodes."""
    region = reach([wait], lambda n: [u for u in n.users if inside(u)])
    readers = [u for n in region for u in n.users if not inside(u)]
    return min(readers, key=order.__getitem__).name if readers else "end"
