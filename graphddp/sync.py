"""Eager state synchronisation outside the graph: broadcast parameters and buffers.

Also the async average of locally accumulated gradients after ``no_sync``.
Coalesced per (dtype, device) into one flat tensor so a model with hundreds of small buffers
costs one collective per dtype, not one per tensor. The source is the group's first rank.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def _coalesce(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """Group distinct non-empty tensors by (dtype, device), keeping their order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _scatter_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


class PendingAverage:
    """An in-flight average of some tensors; ``wait()`` writes the result back in place."""

    def __init__(self, jobs: list[tuple[Any, torch.Tensor, list[torch.Tensor]]]) -> None:
        self._jobs = jobs

    @torch.no_grad()
    def wait(self) -> None:
        for work, flat, tensors in self._jobs:
            work.wait()
            _scatter_back(flat, tensors)
        self._jobs = []


@torch.no_grad()
def average_async(tensors: Sequence[torch.Tensor], group: Any) -> PendingAverage:
    """Start averaging ``tensors`` over ``group`` (pre-divided, like DDP); returns a handle."""
    world = dist.get_world_size(group)
    jobs = []
    for ts in _coalesce(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in ts]).div_(world)
        jobs.append((dist.all_reduce(flat, group=group, async_op=True), flat, ts))
    return PendingAverage(jobs)


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's values."""
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for ts in _coalesce(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        _scatter_back(flat, ts)
