"""``sharding="full"``'s buckets as a plan: the facts of one graph's collectives, and the buckets
planned from them.

Full sharding's collectives are in a graph before graphddp sees it (every parameter read is a
gather of the ranks' parts; AOTAutograd derives each reduce-scatter), so its facts are those
collectives, read from the graph before the rewrite (:func:`graphddp.graph.part_facts.part_facts`):
what each one carries, of what, and over which group. Which of them share a bucket is decided
from these facts alone (:func:`graphddp.plan.part_buckets.plan_part_buckets`), as the other
modes' :class:`~graphddp.values.schedule.Schedule` is, and the rewrite lowers that decision
(:mod:`graphddp.graph.part_collectives`). The plan is then checked against what the rewritten
graph does, read back by :mod:`graphddp.graph.describe_parts`.

Plain values only, like :mod:`graphddp.values.part_schedule`: it imports nothing from graphddp.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

GATHER, REDUCE_SCATTER = "gather", "reduce_scatter"


@dataclasses.dataclass(frozen=True)
class PartCollective:
    """One gather of a part, or one reduce-scatter of a gradient, as the graph has it before the
    rewrite (the order of a graph's collectives of one kind is the order the rewrite takes them)."""

    kind: str  # GATHER | REDUCE_SCATTER
    sends: str  # the node it sends: a gather's part (a graph input), a reduce-scatter's gradient
    params: tuple[str, ...]  # graph inputs it is of: a gather's part; the inputs a reduce-scatter's gradient becomes
    whole_bytes: int  # the full tensor: gathered, or the gradient sent
    dtype: str  # what travels
    device: str
    group: str  # the process group's name
    replicated: bool  # its part goes on to an all-reduce over a replicate group (hybrid sharding)

    def key(self) -> tuple[str, str, str, bool]:
        """What the collectives of one bucket share: one collective carries them all."""
        return self.group, self.dtype, self.device, self.replicated


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    """One bucket: which of a graph's collectives of its kind it carries, in order."""

    kind: str
    index: int  # among the graph's buckets of this kind
    members: tuple[int, ...]  # positions in the graph's collectives of this kind
    params: tuple[str, ...]  # graph inputs, each once, in the members' order
    whole_bytes: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """One graph's buckets: its gathers' and its reduce-scatters', under ``cap_bytes``."""

    cap_bytes: int
    gathers: tuple[PlannedBucket, ...]
    reduce_scatters: tuple[PlannedBucket, ...]

    def of(self, kind: str) -> tuple[PlannedBucket, ...]:
        return self.gathers if kind == GATHER else self.reduce_scatters

    def named(self, names: Mapping[str, str]) -> "PartPlan":
        """The plan with each graph input named by ``names`` where it has a name there (its
        parameter's, as :class:`~graphddp.values.part_schedule.PartGraph` names them)."""
        def rename(b: PlannedBucket) -> PlannedBucket:
            return dataclasses.replace(b, params=tuple(dict.fromkeys(names.get(p, p) for p in b.params)))

        return dataclasses.replace(self, gathers=tuple(map(rename, self.gathers)), reduce_scatters=tuple(map(rename, self.reduce_scatters)))
