"""Eager synchronisation outside the graph: the broadcast of parameters and buffers, and the
average of gradients accumulated under ``no_sync``. Both coalesce per (dtype, device) into one
flat tensor: one collective per dtype, not one per tensor.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.runtime.agree import check_in_band
from graphddp.values.schedule import dtype_name


def _coalesce(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    """Group distinct non-empty tensors by (dtype, device), keeping their order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def flat_views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``tensors`` with its slice of ``flat`` (laid out as ``torch.cat`` of their
    flattened values), viewed to its shape: no copy, the caller writes it back."""
    offset = 0
    for t in tensors:
        yield t, flat[offset:offset + t.numel()].view_as(t)
        offset += t.numel()


class PendingAverage:
    """An in-flight average of accumulated gradients; ``wait()`` writes the result back."""

    def __init__(self, jobs: list[tuple[Any, torch.Tensor, list[nn.Parameter]]]) -> None:
        self._jobs = jobs

    @torch.no_grad()
    def wait(self) -> None:
        for work, flat, params in self._jobs:
            work.wait()
            if not params:  # a joined rank's shadow: nothing to write
                continue
            counts = flat[-len(params):].tolist()
            for (p, piece), count in zip(flat_views(flat, params), counts):
                if p.grad is not None:
                    p.grad.copy_(piece)
                elif count > 0:  # no gradient here, but on some rank: take the average
                    p.grad = piece.clone()
        self._jobs = []


@torch.no_grad()
def average_async(named: Sequence[tuple[str, nn.Parameter]], group: Any, shadow: bool = False) -> PendingAverage:
    """Start averaging the ``.grad`` of ``named`` over ``group`` (pre-divided, like DDP), checked in
    band first. The layout is canonical, the same on every rank whatever each accumulated: a
    parameter without a gradient here sends zeros, and a count per parameter says whether any rank
    had one (then every rank gets the average, as in DDP). ``shadow``: a joined rank's zeros."""
    world = dist.get_world_size(group)
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        groups.setdefault((p.dtype, p.device), []).append((name, p))
    layout = tuple(
        (dtype_name(dtype), device.type, None, tuple((n, tuple(p.shape)) for n, p in members))
        for (dtype, device), members in groups.items()
    )
    check_in_band((world, layout), group, "the average of gradients accumulated under no_sync")
    jobs = []
    for members in groups.values():
        params = [p for _, p in members]
        grads = [
            p.grad.reshape(-1) if p.grad is not None and not shadow else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in params
        ]
        present = torch.tensor([p.grad is not None and not shadow for p in params], dtype=params[0].dtype, device=params[0].device)
        flat = torch.cat([torch.cat(grads).div_(world), present])
        work = dist.all_reduce(flat, group=group, async_op=True)
        jobs.append((work, flat, [] if shadow else params))
    return PendingAverage(jobs)


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Any, src_in_group: int = 0) -> None:
    """Overwrite ``tensors`` in place with the values of the group's rank ``src_in_group``
    (its first by default)."""
    src = dist.get_global_rank(group, src_in_group) if group is not dist.group.WORLD else src_in_group
    for ts in _coalesce(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src, group=group)
        for t, piece in flat_views(flat, ts):
            t.copy_(piece)
