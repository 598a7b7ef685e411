"""Collectives as kinds: what every layer needs to know of the collective that merges a bucket.

A bucket names its collective by key (``Bucket.collective``), and every layer asks the kind instead of
assuming an all-reduce: the cost model its :meth:`~CollectiveKind.seconds` (the kind's own ring steps
and share of the bytes on the wire), the rewrite its :class:`Lowering` for the process group's backend
(issued through the bucket's :class:`~graphddp.values.placement.Placement` in every mode), the
verifier its :attr:`~CollectiveKind.ops`, and the readers of generated code :func:`issue_pattern`.

A kind has one lowering on every backend but where a backend's own op sends more than the kind's
bytes. gloo's ``reduce_scatter`` sends an all-reduce's bytes (``tools/gloo_wire_bytes.py``), so on gloo
a reduce-scatter is an ``all_to_all_single`` (rank ``j`` receives every rank's part ``j``: a
reduce-scatter's bytes) and a local sum of the ``world`` parts received, in rank order.

gloo's functional all-gather is the other, for a worse reason: two of them in flight corrupt the heap
(``python -m tools.gloo_gather_race``), and a sharded backward keeps two in flight (the next bucket's
is issued before the previous one's wait). So on gloo an all-gather is an ``all_to_all_single`` of
this rank's part repeated ``world`` times: the same bytes on the wire, the same rank-major result,
one more part-sized buffer per bucket in flight. Where two kinds share an op on a backend (gloo: both
are all-to-alls), a node's kind is its role (``graphddp.graph.trace.role``), not its op.

A new kind is a new :class:`CollectiveKind` in :data:`KINDS`: no layer above changes.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import torch

from graphddp.values.comm import ALL_REDUCE as ALL_REDUCE_OP, WAIT
from graphddp.values.prediction import CostModel

# The kinds' functional ops (the in-place all-reduce and the wait: graphddp.values.comm)
ALL_REDUCE_OUT_OP = torch.ops._c10d_functional.all_reduce.default  # out of place, as AOTAutograd traces it (sharding="full")
REDUCE_SCATTER_OP = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_GATHER_OP = torch.ops._c10d_functional.all_gather_into_tensor.default
ALL_TO_ALL_OP = torch.ops._c10d_functional.all_to_all_single.default
WAIT_PATTERN = re.compile(rf"_c10d_functional\.{WAIT._opname}\.default\((\w+)")  # a wait in generated code; group 1: its buffer


def _as_is(done: torch.Tensor, world: int) -> torch.Tensor:
    return done


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One way to run a kind: the functional op issued, and what follows its wait."""

    op: torch._ops.OpOverload
    issue: Callable[[torch.Tensor, str, int], torch.Tensor]  # traced: (flat buffer, group name, world size) -> result to wait on
    finish: Callable[[torch.Tensor, int], torch.Tensor] = _as_is  # traced: (waited result, world size) -> the kind's result


@dataclasses.dataclass(frozen=True)
class CollectiveKind:
    """One kind of bucket collective (module docstring)."""

    key: str  # what Bucket.collective holds
    lowering: Lowering  # on every backend not in by_backend
    ring_steps: Callable[[int], int]  # latency-bound steps of the ring algorithm on p ranks
    wire_share: Callable[[int], float]  # bytes on the link per byte of the bucket, on p ranks
    by_backend: Mapping[str, Lowering] = dataclasses.field(default_factory=dict)

    def lower(self, backend: str | None) -> Lowering:
        """The lowering for a process group of this backend (``dist.get_backend``'s name)."""
        return self.by_backend.get(backend or "", self.lowering)

    @property
    def op(self) -> torch._ops.OpOverload:
        """The op of the default lowering."""
        return self.lowering.op

    @property
    def ops(self) -> frozenset[torch._ops.OpOverload]:
        """Every op a bucket of this kind may be issued with, on some backend."""
        return frozenset([self.lowering.op, *(low.op for low in self.by_backend.values())])

    def seconds(self, cost: CostModel, nbytes: int, world_size: int, stride: int = 1) -> float:
        """Link time of one bucket of ``nbytes`` (what each rank contributes) on ``world_size`` ranks,
        ``stride`` ranks apart (:meth:`CostModel.link`: which link of a topology the ring runs on)."""
        if world_size <= 1:
            return 0.0
        return cost.link(world_size, stride).ring_seconds(self.ring_steps(world_size), self.wire_share(world_size) * nbytes)


ALL_REDUCE = CollectiveKind(
    key="all_reduce",
    # in place, on a fresh flat bucket: no extra buffer
    lowering=Lowering(ALL_REDUCE_OP, lambda flat, group, world: ALL_REDUCE_OP(flat, "sum", group)),
    ring_steps=lambda p: 2 * (p - 1),  # reduce-scatter, then all-gather
    wire_share=lambda p: 2 * (p - 1) / p,
)


# A sharded bucket (graphddp.values.shards): each rank receives the sum of its part only...
def _all_to_all(flat: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Rank ``j`` receives part ``j`` of every rank's buffer, rank-major: ``world`` rows."""
    split = [flat.numel() // world] * world
    return ALL_TO_ALL_OP(flat, split, split, group)


def _sum_rows(received: torch.Tensor, world: int) -> torch.Tensor:
    return torch.ops.aten.sum.dim_IntList(torch.ops.aten.view.default(received, [world, -1]), [0])


REDUCE_SCATTER = CollectiveKind(
    key="reduce_scatter",
    lowering=Lowering(REDUCE_SCATTER_OP, lambda flat, group, world: REDUCE_SCATTER_OP(flat, "sum", world, group)),
    ring_steps=lambda p: p - 1,
    wire_share=lambda p: (p - 1) / p,
    by_backend={"gloo": Lowering(ALL_TO_ALL_OP, _all_to_all, _sum_rows)},  # module docstring
)


# ... and after updating it, gives every rank every part back. ``nbytes`` is the whole bucket.
def _gather_by_all_to_all(part: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Every rank's part, rank-major, as ``all_gather_into_tensor`` lays it out: rank ``j``
    receives part ``j`` of every rank's buffer, and every part of this rank's buffer is its part."""
    split = [part.numel()] * world
    return ALL_TO_ALL_OP(torch.ops.aten.repeat.default(part, [world]), split, split, group)


ALL_GATHER = CollectiveKind(
    key="all_gather",
    lowering=Lowering(ALL_GATHER_OP, lambda part, group, world: ALL_GATHER_OP(part, world, group)),
    ring_steps=lambda p: p - 1,
    wire_share=lambda p: (p - 1) / p,
    by_backend={"gloo": Lowering(ALL_TO_ALL_OP, _gather_by_all_to_all)},  # module docstring
)

KINDS: dict[str, CollectiveKind] = {k.key: k for k in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)}
SHARDED = REDUCE_SCATTER.key  # Bucket.collective of a sharded bucket (a replicated one's: ALL_REDUCE.key)


def kind(key: str) -> CollectiveKind:
    """The kind a bucket names; an unknown key is a plan graphddp cannot run."""
    try:
        return KINDS[key]
    except KeyError:
        raise ValueError(f"graphddp: unknown bucket collective {key!r}; known: {sorted(KINDS)}") from None


def all_ops() -> frozenset[torch._ops.OpOverload]:
    """Every op any kind is issued with."""
    return frozenset(op for k in KINDS.values() for op in k.ops)


def backend_of(group_name: str) -> str | None:
    """The backend of the process group a graph was planned for (None where unknown)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return str(torch.distributed.get_backend(_resolve_process_group(group_name)))
    except (RuntimeError, ValueError, KeyError):
        return None


def issue_pattern() -> re.Pattern[str]:
    """A regex for the issue of any kind's op in generated code; group 1: its buffer."""
    names = "|".join(sorted(re.escape(op._opname) for op in all_ops()))
    return re.compile(rf"_c10d_functional\.(?:{names})\.default\((\w+)")
