"""Collectives as kinds: what every layer needs to know of the collective that merges a bucket.

A bucket names its collective by key (:attr:`graphddp.values.schedule.Bucket.collective`); every
layer that used to assume an all-reduce asks the kind instead:

* the cost model: :meth:`CollectiveKind.seconds`, the link time of one bucket from the same
  alpha-beta numbers (``CostModel``'s latency per ring step and bandwidth), with the kind's
  own number of ring steps and share of the bytes on the wire;
* the rewrite: :meth:`CollectiveKind.issue`, the traced call that merges a bucket's scaled flat
  buffer (its result is waited on with ``wait_tensor``, like every functional collective);
* the verifier: :attr:`CollectiveKind.op`, the one op a bucket of this kind may be issued
  with;
* the code readers (:mod:`graphddp.graph.codeinspect`, :mod:`graphddp.runtime.failures`):
  :attr:`CollectiveKind.code`, the op's spelling in generated code.

All-reduce is the first kind. A new kind (a reduce-scatter per bucket, an all-gather of
updated slices) is a new :class:`CollectiveKind` in :data:`KINDS`: no layer above changes.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from graphddp.values.comm import ALL_REDUCE as ALL_REDUCE_OP
from graphddp.values.schedule import CostModel


@dataclasses.dataclass(frozen=True)
class CollectiveKind:
    """One kind of bucket collective (module docstring)."""

    key: str  # what Bucket.collective holds
    op: torch._ops.OpOverload  # the functional op graphddp emits for it
    ring_steps: Callable[[int], int]  # latency-bound steps of the ring algorithm on p ranks
    wire_share: Callable[[int], float]  # bytes on the link per byte of the bucket, on p ranks
    issue: Callable[[torch.Tensor, str, int], torch.Tensor]  # traced: (flat buffer, group name, world size) -> result to wait on

    @property
    def code(self) -> str:
        """How the op reads in generated code: ``_c10d_functional.all_reduce_``."""
        return f"_c10d_functional.{self.op._opname}"

    def seconds(self, cost: CostModel, nbytes: int, world_size: int) -> float:
        """Link time of one bucket of ``nbytes`` (what each rank contributes) on ``world_size`` ranks."""
        if world_size <= 1:
            return 0.0
        return cost.ring_seconds(self.ring_steps(world_size), self.wire_share(world_size) * nbytes)


ALL_REDUCE = CollectiveKind(
    key="all_reduce",
    op=ALL_REDUCE_OP,  # in place, on a fresh flat bucket: no extra buffer
    ring_steps=lambda p: 2 * (p - 1),  # reduce-scatter, then all-gather
    wire_share=lambda p: 2 * (p - 1) / p,
    issue=lambda flat, group, world: ALL_REDUCE_OP(flat, "sum", group),
)

# A sharded bucket (graphddp.values.shards): each rank receives the sum of its part only...
REDUCE_SCATTER = CollectiveKind(
    key="reduce_scatter",
    op=torch.ops._c10d_functional.reduce_scatter_tensor.default,
    ring_steps=lambda p: p - 1,
    wire_share=lambda p: (p - 1) / p,
    issue=lambda flat, group, world: torch.ops._c10d_functional.reduce_scatter_tensor.default(flat, "sum", world, group),
)
# ... and after updating it, gives every rank every part back. ``nbytes`` is the whole bucket.
ALL_GATHER = CollectiveKind(
    key="all_gather",
    op=torch.ops._c10d_functional.all_gather_into_tensor.default,
    ring_steps=lambda p: p - 1,
    wire_share=lambda p: (p - 1) / p,
    issue=lambda part, group, world: torch.ops._c10d_functional.all_gather_into_tensor.default(part, world, group),
)

KINDS: dict[str, CollectiveKind] = {k.key: k for k in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)}


def kind(key: str) -> CollectiveKind:
    """The kind a bucket names; an unknown key is a plan graphddp cannot run."""
    try:
        return KINDS[key]
    except KeyError:
        raise ValueError(f"graphddp: unknown bucket collective {key!r}; known: {sorted(KINDS)}") from None


def issue_pattern() -> re.Pattern[str]:
    """A regex for the issue of any kind's op in generated code; group 1: its buffer."""
    names = "|".join(re.escape(k.op._opname) for k in KINDS.values())
    return re.compile(rf"_c10d_functional\.(?:{names})\.default\((\w+)")
