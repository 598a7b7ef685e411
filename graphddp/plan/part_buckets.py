"""``sharding="full"``'s buckets, planned from the facts of one graph's collectives.

A function of values (:class:`~graphddp.values.part_schedule.PartCollective`, read by
:mod:`graphddp.graph.part_facts`) and the cap, as the other modes' planner is: the rewrite
(:mod:`graphddp.graph.part_collectives`) lowers the buckets it returns and decides nothing of
their membership itself. The rule is DDP's: consecutive collectives of one kind share a bucket
while they share what one collective must (:meth:`PartCollective.key`: group, dtype, device,
and whether the part goes on to a replicate all-reduce), and a bucket closes once its bytes (of
the full tensors: gathered, or the gradients sent) reach the cap, so one collective larger than
the cap is a bucket alone, and a bucket holds at most one collective past the cap.
"""
from __future__ import annotations

from typing import Sequence

from graphddp.values.part_schedule import PartBucket, PartCap, PartCollective, PartGraph


def plan_part_buckets(kind: str, gathers: Sequence[PartCollective], scatters: Sequence[PartCollective], cap: PartCap) -> PartGraph:
    """The buckets of one ``kind`` of graph (forward, backward): its ``gathers`` and its
    ``scatters`` (each in the rewrite's order) bucketed under ``cap``."""
    return PartGraph(kind=kind, buckets=bucket_collectives(gathers, cap.nbytes) + bucket_collectives(scatters, cap.nbytes), cap=cap)


def bucket_collectives(collectives: Sequence[PartCollective], cap_bytes: int) -> tuple[PartBucket, ...]:
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


def _bucket(index: int, members: list[PartCollective], positions: tuple[int, ...]) -> PartBucket:
    params: list[str] = []
    for c in members:
        params += [p for p in c.params if p not in params]
    return PartBucket(
        kind=members[0].kind, index=index, members=positions, params=tuple(params),
        whole_bytes=sum(c.whole_bytes for c in members), dtype=members[0].dtype,
    )
