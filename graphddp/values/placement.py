"""Where a bucket's tensors live, and the collectives that follow from it.

A bucket is replicated (every rank holds it whole and all-reduces it) or sharded: each rank of a
*shard group* holds one part of it, so its gradient is reduce-scattered over that group and, after
the update, its parts all-gathered over it. With hybrid sharding (a 2-D ``DeviceMesh``, FSDP2's HSDP
convention: dim 0 replicates, dim 1 shards) the shard groups are replicas of one another: after the
reduce-scatter each rank's part is all-reduced over its *replicate group* (the ranks holding the same
part in the other shard groups), so the link between groups carries 1/S of the bytes with S ranks
per shard group.

:class:`Placement` is that fact as a value, planned once and read by every sharded mode. Its
collectives are traced into the graphs, so ``sharding="optimizer"`` and ``sharding="full"`` issue the
same collectives, in the same order, from one definition. A replicated bucket's is :class:`Whole`.

Group names differ between ranks of different shard groups (each group registers its own), so a
schedule's fingerprint keeps the sizes only (:meth:`Placement.shape`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from graphddp.values.collectives import ALL_GATHER, ALL_REDUCE, ALL_REDUCE_OUT_OP, REDUCE_SCATTER, Lowering, backend_of, kind
from graphddp.values.comm import WAIT
from graphddp.values.prediction import CostModel

REPLICATE = "replicate"  # ROLE_KEY of the all-reduce of a part over the replicate group
REPLICATE_WAIT = "replicate_wait"


@dataclasses.dataclass(frozen=True)
class Level:
    """One group of a placement: the name functional collectives find it by, and its size."""

    name: str
    size: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """A sharded bucket's parts over ``shard``, averaged over ``replicate`` too (module docstring)."""

    shard: Level
    replicate: Level | None = None
    reduce_kind: ClassVar[str] = REDUCE_SCATTER.key  # the collective of issue_reduce, by its kind's key

    @property
    def world(self) -> int:
        """Every rank the average is over: what a gradient is divided by before it is sent."""
        return self.shard.size * (self.replicate.size if self.replicate is not None else 1)

    @property
    def hybrid(self) -> bool:
        return self.replicate is not None and self.replicate.size > 1

    def shape(self) -> tuple[int, int]:
        """``(replicate, shard)`` sizes: what every rank of one job agrees on."""
        return (self.replicate.size if self.replicate is not None else 1, self.shard.size)

    def describe(self) -> str:
        if not self.hybrid:
            return f"sharded over {self.shard.size} ranks"
        return f"sharded over {self.shard.size} ranks, replicated over {self.replicate.size}"  # type: ignore[union-attr]

    # -- traced: the collectives of a bucket ---------------------------------------------------

    def _lowered(self, key: str) -> Lowering:
        return kind(key).lower(backend_of(self.shard.name))

    def issue_reduce(self, scaled: torch.Tensor) -> torch.Tensor:
        """The reduce of a flat buffer already divided by :attr:`world`, over the shard group: the
        reduce-scatter of a rank-major buffer (``[shard size, part]``), or :class:`Whole`'s all-reduce;
        returns what :meth:`finish_reduce` waits on."""
        return self._lowered(self.reduce_kind).issue(scaled, self.shard.name, self.shard.size)

    def finish_reduce(self, pending: torch.Tensor, tag: Any = None) -> torch.Tensor:
        """This rank's part of the average: the reduce waited and finished, then with a
        replicate group the part all-reduced over it and waited. ``tag``: a context manager
        factory (``graphddp.graph.trace.role``) to mark the replicate all-reduce's nodes."""
        done = self._lowered(self.reduce_kind).finish(WAIT(pending), self.shard.size)
        return self.average_replicas(done, tag)

    def average_replicas(self, done: torch.Tensor, tag: Any = None) -> torch.Tensor:
        """A reduce-scatter's finished part, all-reduced over the replicate group and waited (hybrid),
        or as it is: the tail of :meth:`finish_reduce`, on its own for a graph that issued the
        reduce-scatter itself (``sharding="full"``'s backward of a gather)."""
        if not self.hybrid:
            return done
        assert self.replicate is not None
        if tag is None:
            return WAIT(ALL_REDUCE_OUT_OP(done, "sum", self.replicate.name))
        with tag(REPLICATE):
            issued = ALL_REDUCE_OUT_OP(done, "sum", self.replicate.name)
        with tag(REPLICATE_WAIT):
            return WAIT(issued)

    def issue_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every shard rank's ``part``, rank-major, over the shard group; :meth:`finish_gather` waits on it."""
        return self._lowered(ALL_GATHER.key).issue(part, self.shard.name, self.shard.size)

    def finish_gather(self, pending: torch.Tensor) -> torch.Tensor:
        return self._lowered(ALL_GATHER.key).finish(WAIT(pending), self.shard.size)

    # -- cost ------------------------------------------------------------------------------------

    def reduce_seconds(self, cost: CostModel, nbytes: int) -> float:
        """Link time of one bucket's reduce (``nbytes`` whole): the reduce-scatter over the shard group,
        then, hybrid, the all-reduce of a part (1/S of the bytes) over the replicate group, whose ranks
        lie ``S`` apart (on a :class:`~graphddp.values.prediction.Topology`, another link)."""
        seconds = kind(self.reduce_kind).seconds(cost, nbytes, self.shard.size)
        if self.hybrid:
            assert self.replicate is not None
            seconds += ALL_REDUCE.seconds(cost, nbytes // self.shard.size, self.replicate.size, stride=self.shard.size)
        return seconds

    def gather_seconds(self, cost: CostModel, nbytes: int) -> float:
        """Link time of one bucket's all-gather over the shard group (``nbytes`` whole)."""
        return ALL_GATHER.seconds(cost, nbytes, self.shard.size)

    def link_seconds(self, cost: CostModel, wire_nbytes: int, gathered_nbytes: int | None) -> tuple[float, float]:
        """One bucket's link time: its reduce of ``wire_nbytes``, its all-gather of ``gathered_nbytes`` in the backward (None: 0.0)."""
        return self.reduce_seconds(cost, wire_nbytes), 0.0 if gathered_nbytes is None else self.gather_seconds(cost, gathered_nbytes)

    # -- records ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Placement | None":
        if data is None:
            return None
        replicate = data.get("replicate")
        return cls(Level(**data["shard"]), Level(**replicate) if replicate else None)


@dataclasses.dataclass(frozen=True)
class Whole(Placement):
    """A replicated bucket: whole on every rank of its one group (``shard``), so its reduce is the
    bucket's collective (an all-reduce kind), through the same lowerings as a sharded bucket's."""

    reduce_kind: str = ALL_REDUCE.key  # type: ignore[misc]


def flat(name: str, size: int) -> Placement:
    """The placement of sharding over one group, every rank of it (no replicate dim)."""
    return Placement(Level(name, size))
