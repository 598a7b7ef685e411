"""``sharding="full"``'s buckets, planned from the facts of one graph's collectives.

A function of values (:class:`~graphddp.values.part_plan.PartCollective`, read by
:mod:`graphddp.graph.part_facts`) and the cap, as the other modes' planner is: the rewrite
(:mod:`graphddp.graph.part_collectives`) lowers the buckets it returns and decides nothing of
their membership itself. The rule is DDP's: consecutive collectives of one kind share a bucket
while they share what one collective must (:meth:`PartCollective.key`: group, dtype, device,
and whether the part goes on to a replicate all-reduce), and a bucket closes once its bytes (of
the full tensors: gathered, or the gradients sent) reach the cap, so one collective larger than
the cap is a bucket alone, and a bucket holds at most one collective past the cap.

:func:`plan_disagreement` then compares the plan with what the rewritten graph does, as
:mod:`graphddp.graph.describe_parts` reads it back: a schedule that says what the graph does,
and a plan it must agree with.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from graphddp.values.part_plan import GATHER, REDUCE_SCATTER, PartCollective, PartPlan, PlannedBucket
from graphddp.values.part_schedule import PartGraph


def plan_part_buckets(gathers: Sequence[PartCollective], scatters: Sequence[PartCollective], cap_bytes: int) -> PartPlan:
    """One graph's buckets: its ``gathers`` and its ``scatters`` (each in the rewrite's order)
    bucketed under ``cap_bytes``."""
    return PartPlan(cap_bytes=cap_bytes, gathers=bucket_collectives(gathers, cap_bytes), reduce_scatters=bucket_collectives(scatters, cap_bytes))


def bucket_collectives(collectives: Sequence[PartCollective], cap_bytes: int) -> tuple[PlannedBucket, ...]:
    """Consecutive ``collectives`` of one key, each bucket closing once its bytes reach ``cap_bytes``."""
    groups: list[list[int]] = []
    size = 0
    for i, c in enumerate(collectives):
        if not groups or size >= cap_bytes or collectives[groups[-1][0]].key() != c.key():
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += c.whole_bytes
    return tuple(_bucket(index, [collectives[i] for i in members], tuple(members)) for index, members in enumerate(groups))


def _bucket(index: int, members: list[PartCollective], positions: tuple[int, ...]) -> PlannedBucket:
    params: list[str] = []
    for c in members:
        params += [p for p in c.params if p not in params]
    return PlannedBucket(
        kind=members[0].kind, index=index, members=positions, params=tuple(params),
        whole_bytes=sum(c.whole_bytes for c in members), dtype=members[0].dtype,
    )


def plan_disagreement(plan: PartPlan, described: PartGraph, names: Mapping[str, str] | None = None) -> list[str]:
    """Where ``described`` (a rewritten graph's collectives, read back) differs from ``plan``,
    the buckets its rewrite lowered; empty where they agree. ``names`` maps a graph input's name
    to its parameter's, as the reading does (:meth:`PartPlan.named`). A bucket's parameters are
    compared as a set: the reading meets them walking the graph, in an order casts can change."""
    plan = plan.named(names or {})
    found: list[str] = []
    for kind in (GATHER, REDUCE_SCATTER):
        planned, read = plan.of(kind), described.of(kind)
        if len(planned) != len(read):
            found.append(f"{described.kind}: {len(planned)} {kind} bucket(s) planned, {len(read)} in the graph")
            continue
        for p, r in zip(planned, sorted(read, key=lambda b: b.index)):
            want = (sorted(p.params), p.whole_bytes, p.dtype)
            have = (sorted(set(r.params)), r.whole_bytes, r.dtype)
            if want != have:
                found.append(f"{described.kind}: {kind} {p.index} planned as {want}, the graph's is {have}")
    return found
