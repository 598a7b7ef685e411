"""How a sharded bucket is cut: each parameter split into N equal parts, one per rank.

``sharding="optimizer"`` reduce-scatters a bucket instead of all-reducing it: each rank receives the
average of its part only, updates that part with its part of the optimizer state, and all-gathers the
updated parts. Where the parts lie is a pure function of a parameter's number of elements and the
world size, not of the bucket it sits in:

* parameter ``p`` with ``n`` elements is cut into ``world`` chunks of ``chunk(n, world) =
  ceil(n / world)`` elements; rank ``r`` owns elements ``[r * chunk, (r + 1) * chunk)`` of its flat
  view, clipped to ``n`` (:func:`part`). The last ranks may own fewer elements, or none;
* a bucket's flat buffer on the wire is rank-major: rank 0's chunks of every parameter of the bucket
  in slot order, then rank 1's, ... each chunk padded with zeros to ``chunk`` elements. A
  reduce-scatter of it hands rank ``r`` exactly its chunks, and an all-gather of the updated chunks
  gives every rank the whole bucket back in the same layout.

Why per parameter, as FSDP2 shards, and not one cut of the concatenated bucket (ZeRO's flat
partition): a rank's part of a parameter, and so its optimizer state, stays the same when Dynamo
recompiles a graph and the planner buckets differently, and a parameter's state is never split
between two buckets. The padding (fewer than ``world`` elements per parameter) travels on the wire as
zeros and never reaches the optimizer state or a checkpoint.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from graphddp.values.comm import gather_flat

# gather="backward": a bucket's wait, update and all-gather follow the issue of the reduce-scatter
# this many sharded buckets later (graphddp.optim.insert_shard), so that its all-gather shares the
# link with the rest of the backward. A lag of one leaves the fewest all-gathers to the end of the
# backward, the fastest on a link-bound step (docs/sharding.md, "Where the sharded step's time goes").
GATHER_LAG = 1


def chunk(numel: int, world: int) -> int:
    """Elements per rank of a parameter of ``numel`` elements, padding included."""
    return -(-numel // world)


def part(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The elements ``[lo, hi)`` of a parameter's flat view that ``rank`` owns (maybe empty)."""
    size = chunk(numel, world)
    lo = min(rank * size, numel)
    return lo, min(lo + size, numel)


def padded_part(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``t``'s flat view as the wire holds it: ``chunk(numel, world)``
    elements, zeros past the end of ``t`` (a new tensor, on ``t``'s device, of its dtype)."""
    c = chunk(t.numel(), world)
    lo, hi = part(t.numel(), world, rank)
    out = torch.zeros(c, dtype=t.dtype, device=t.device)
    out[: hi - lo] = t.detach().reshape(-1)[lo:hi]
    return out


def whole(parts: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], group: Any) -> list[torch.Tensor]:
    """The inverse of the cut, eager: every rank's ``parts`` of tensors of ``shapes`` (each with its
    padding or without, one dtype and device) gathered over ``group`` into the whole tensors, by one
    all-gather of the parts padded to their chunks, rank-major. ``group`` None: held whole on every
    rank, the parts are the tensors (padding dropped)."""
    if group is None:
        return [t.detach().reshape(-1)[: math.prod(shape)].view(tuple(shape)) for t, shape in zip(parts, shapes)]
    world = dist.get_world_size(group)
    sizes = [chunk(math.prod(shape), world) for shape in shapes]
    mine = torch.cat([F.pad(t.detach().reshape(-1), (0, c - t.numel())) for t, c in zip(parts, sizes)])
    out = mine.new_empty(world * mine.numel())
    gather_flat(out, mine, group)
    rows = out.view(world, mine.numel()).split(sizes, dim=1)
    return [r.reshape(-1)[: math.prod(shape)].view(tuple(shape)) for r, shape in zip(rows, shapes)]
