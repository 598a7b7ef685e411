"""``sharding="full"``'s buckets, planned from the facts of one graph's collectives, and their cap.

A function of values (:class:`~graphddp.values.part_schedule.PartCollective`) and the cap, as the
other modes' planner is: the rewrite (:mod:`graphddp.graph.part_collectives`) lowers the buckets it
returns and decides nothing of their membership itself. The rule is DDP's greedy one, with
consecutive collectives sharing a bucket while they share what one collective must
(:meth:`PartCollective.key`), and a bucket closing once its bytes (of the full tensors: gathered, or
the gradients sent) reach the cap.

Why a planned cap and not a fixed one. Full sharding issues every bucket's collectives every step: an
all-gather before the forward reads it, another before the backward does (with
``reshard_after_forward``), and a reduce-scatter of its gradients. Each collective costs a fixed time
(its issue and wait on the host, ``collective_overhead_us``, and its ring latency) whatever its size,
so many small buckets pay that time many times; few large buckets leave more bytes exposed, because
the first bucket's all-gather runs before any compute can overlap it and the last bucket's
reduce-scatter after all of it. A fixed cap that suits CPU ranks on a slow link cuts a model on a GPU
into so many buckets that their collectives' host time leaves the GPU idle (docs/gpu.md).

The model. With ``S`` bytes gathered by one graph, ``n`` buckets of ``S / n`` bytes, ``F`` the fixed
time of one bucket's collectives (``k`` of them: 3 with resharding, 2 without) and ``b`` the link
time per byte of one all-gather plus one reduce (the exposed pair; with hybrid sharding the reduce is
a reduce-scatter and an all-reduce of its part), the step pays about ``n * F + (S / n) * b``, least
at ``n = sqrt(S * b / F)``: a cap of ``sqrt(S * F / b)`` bytes (docs/full-sharding.md compares it
with a sweep). Where the link costs nothing (one rank) or too little for the fixed time to matter,
the cap is :data:`MAX_CAP_BYTES`.

Why a ceiling. Each rank holds the gathered buckets in flight (the one being read and the
:data:`PREFETCH` issued ahead of it): the cap is what full sharding adds to a rank's memory beyond
its parts, so it stays bounded whatever the link. 25 MB is DDP's bucket, and about FSDP2's unit on
the models users shard with it (one GPT-2 block of dim 768 is 28 MB in fp32). The floor
(:data:`MIN_CAP_BYTES`) keeps a mis-measured link from giving an absurd cap: smaller caps make the
step clearly slower.
"""
from __future__ import annotations

import math
from typing import Sequence

from graphddp.config import MB
from graphddp.plan.greedy import bucket_by_size
from graphddp.values.part_schedule import PartBucket, PartCap, PartCollective, PartGraph
from graphddp.values.placement import Placement, flat
from graphddp.values.prediction import CostModel

# Gather buckets in flight ahead of the one being read. Two: with one the forward is link-bound
# throughout, and three is slower (docs/full-sharding.md, "Two gather buckets ahead"). Each one
# more holds one more bucket's gathered bytes.
PREFETCH = 2
SCATTER_LAG = 1  # reduce-scatter buckets in flight behind the backward's compute
MAX_CAP_BYTES = 25 * MB
MIN_CAP_BYTES = MB // 4


def planned_cap_bytes(cost: CostModel, gathered_bytes: int, world_size: int, regathers: bool, placement: Placement | None = None) -> int:
    """The cap of one graph's gather and reduce-scatter buckets (module docstring): ``gathered_bytes``,
    what the graph gathers whole; ``regathers``, whether the backward gathers again
    (``reshard_after_forward``); ``placement``, the parts' groups (hybrid: one more collective per
    bucket), default sharding over ``world_size`` ranks. The same on every rank given the same
    ``cost`` (the calibration's numbers are every rank's slowest) and graph."""
    place = placement if placement is not None else flat("", world_size)  # the cost reads its sizes only
    gather, reduce = (lambda n: place.gather_seconds(cost, n)), (lambda n: place.reduce_seconds(cost, n))
    per_byte = (gather(MB) - gather(0) + reduce(MB) - reduce(0)) / MB
    if per_byte <= 0 or gathered_bytes <= 0:
        return MAX_CAP_BYTES
    gathers = 2 if regathers else 1
    collectives = gathers + 1 + int(place.hybrid)
    fixed = collectives * cost.collective_overhead_us * 1e-6 + gather(0) * gathers + reduce(0)
    cap = math.sqrt(gathered_bytes * fixed / per_byte)
    return int(min(MAX_CAP_BYTES, max(MIN_CAP_BYTES, cap)))


def plan_part_buckets(kind: str, gathers: Sequence[PartCollective], reduces: Sequence[PartCollective], cap: PartCap) -> PartGraph:
    """The buckets of one ``kind`` of graph (forward, backward): its ``gathers`` and its ``reduces``
    (reduce-scatters and all-reduces, each list in the rewrite's order) bucketed under ``cap``."""
    return PartGraph(kind=kind, buckets=bucket_collectives(gathers, cap.nbytes) + bucket_collectives(reduces, cap.nbytes), cap=cap)


def bucket_collectives(collectives: Sequence[PartCollective], cap_bytes: int) -> tuple[PartBucket, ...]:
    """Consecutive ``collectives`` of one key, each bucket closing once its bytes reach ``cap_bytes``;
    the buckets in the order their last members come. Each kind is bucketed apart: a backward's
    reduce-scatters and its whole parameters' all-reduces interleave where sizes alternate around
    ``replicate_below_mb``, and neither kind's buckets are then cut into runs of one."""
    key, nbytes = (lambda ic: ic[1].key()), (lambda ic: ic[1].whole_bytes)
    kinds = dict.fromkeys(c.kind for c in collectives)
    groups = [
        group for k in kinds
        for group in bucket_by_size([(i, c) for i, c in enumerate(collectives) if c.kind == k], key, nbytes, lambda _: cap_bytes, consecutive=True)
    ]
    groups.sort(key=lambda group: group[-1][0])
    return tuple(_bucket(index, [c for _, c in group], tuple(i for i, _ in group)) for index, group in enumerate(groups))


def _bucket(index: int, members: list[PartCollective], positions: tuple[int, ...]) -> PartBucket:
    params: list[str] = []
    for c in members:
        params += [p for p in c.params if p not in params]
    return PartBucket(
        kind=members[0].kind, index=index, members=positions, params=tuple(params),
        whole_bytes=sum(c.whole_bytes for c in members), dtype=members[0].dtype,
    )
