"""Eager state synchronisation outside the graph: broadcast parameters and buffers.

Coalesced per (dtype, device) into one flat tensor so a model with hundreds of small buffers
costs one collective per dtype, not one per tensor. The source is the group's first rank.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's values."""
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            groups.setdefault((t.dtype, t.device), []).append(t)
    for (_dtype, _device), ts in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
