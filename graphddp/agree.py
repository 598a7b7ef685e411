"""Cross-rank agreement on schedules, checked before the first all-reduce runs.

Ranks that trace different graphs (different model code, input shapes or options on one
rank) would plan different buckets and then all-reduce buffers of different sizes: a hang or
garbage. When a backward graph is first compiled, every rank all-gathers its schedule
fingerprint (one tiny collective per graph). On any difference all ranks raise the same
:class:`ScheduleMismatchError`, naming the first bucket that differs.

Also here: the wrap-time check that every rank has the same parameters (names, shapes,
dtypes), run before the initial broadcast so a mismatch is an error, not a hang.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphddp.schedule import Schedule


class ScheduleMismatchError(RuntimeError):
    pass


def _is_fake(group: Any) -> bool:
    return dist.get_backend(group) == "fake"


def _gather(obj: Any, group: Any) -> list[Any]:
    """All-gather a small picklable object with two tensor all-gathers.

    Not ``dist.all_gather_object``: that needs NumPy, which torch does not require. Runs
    outside any fake-tensor mode: AOTAutograd may compile the backward under one.
    """
    with unset_fake_temporarily():
        return _gather_real(obj, group)


def _gather_real(obj: Any, group: Any) -> list[Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    data = pickle.dumps(obj)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [pickle.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(everyone, sizes)]


def _bucket_summary(schedule: Schedule) -> list[tuple[tuple[str, ...], int, str]]:
    return [(b.param_names, b.nbytes, b.dtype) for b in schedule.buckets]


def check_schedule_agreement(schedule: Schedule, group: Any) -> None:
    """Raise on every rank if any rank planned a different schedule for this graph."""
    if dist.get_world_size(group) == 1 or _is_fake(group):
        return
    prints = _gather(schedule.fingerprint(), group)
    if len(set(prints)) == 1:
        return
    summaries = _gather(_bucket_summary(schedule), group)
    other = next(r for r, p in enumerate(prints) if p != prints[0])
    a, b = summaries[0], summaries[other]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def describe(buckets: list, rank: int) -> str:
        if k >= len(buckets):
            return f"rank {rank} has no bucket {k} ({len(buckets)} buckets)"
        names, nbytes, dtype = buckets[k]
        return f"rank {rank} has {list(names)} ({nbytes} bytes, {dtype})"

    raise ScheduleMismatchError(
        f"graphddp: ranks disagree on the gradient schedule of backward graph {schedule.graph_index} "
        f"(fingerprints {dict(enumerate(prints))}). First difference at bucket {k}: "
        f"{describe(a, 0)}; {describe(b, other)}. Every rank must run the same model code with "
        "the same input shapes and graphddp options."
    )


def check_parameter_agreement(module: nn.Module, group: Any) -> None:
    """Raise on every rank if parameter names, shapes or dtypes differ between ranks."""
    if dist.get_world_size(group) == 1 or _is_fake(group):
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests = _gather(digest, group)
    if len(set(digests)) == 1:
        return
    everyone = _gather(mine, group)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    a, b = everyone[0], everyone[other]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    first = a[k] if k < len(a) else "nothing"
    second = b[k] if k < len(b) else "nothing"
    raise ValueError(
        f"graphddp.compile: ranks hold different parameters; parameter #{k} is {first} on rank 0 "
        f"but {second} on rank {other}. Every rank must build the same model."
    )
