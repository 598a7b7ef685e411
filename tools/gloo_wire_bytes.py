"""Bytes two gloo ranks put on the loopback for one collective of a 26 MB float32 tensor.

Why: a sharded step (``sharding="optimizer"``) is meant to send what an all-reduce sends, a
reduce-scatter then an all-gather. This measures whether gloo's collectives do, and what
graphddp's reduce-scatter on gloo (``graphddp.values.collectives``' lowering) sends: it reads the
loopback's transmit counter (``/sys/class/net/lo/statistics/tx_bytes``) around three calls of
each collective, so run it on an otherwise quiet machine (the counter is the whole machine's).
Run from a clone: ``.venv/bin/python -m tools.gloo_wire_bytes``; docs/sharding.md quotes it.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from graphddp.testing import spawn

MB = 2**20


def _lo_tx() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def _collectives(n: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    x = torch.randn(n)
    name = dist.group.WORLD.group_name
    functional = torch.ops._c10d_functional
    return [
        ("all_reduce", lambda: dist.all_reduce(x.clone())),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(n // world), x.clone())),
        ("reduce_scatter_tensor (functional)",
         lambda: functional.wait_tensor(functional.reduce_scatter_tensor(x.clone(), "sum", world, name))),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(n), torch.randn(n // world))),
        ("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(n), x.clone())),
        ("graphddp's reduce_scatter on gloo", lambda: _graphddp_reduce_scatter(x.clone(), name, world)),
    ]


def _graphddp_reduce_scatter(flat: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """What a sharded bucket's graph runs on gloo: the kind's gloo lowering, eagerly."""
    from graphddp.values.collectives import REDUCE_SCATTER

    lowered = REDUCE_SCATTER.lower("gloo")
    return lowered.finish(torch.ops._c10d_functional.wait_tensor(lowered.issue(flat, group, world)), world)


def _measure(rank: int, world: int, _: Any) -> None:
    torch.set_num_threads(1)
    n = 26 * MB // 4
    for label, call in _collectives(n, world):
        call()
        dist.barrier()
        before, start = _lo_tx(), time.perf_counter()
        for _ in range(3):
            call()
        dist.barrier()
        seconds = (time.perf_counter() - start) / 3
        if rank == 0:
            print(f"{label:<36} {(_lo_tx() - before) / 3 / MB:8.1f} MB on the loopback per call (both ranks), {seconds * 1e3:6.1f} ms")


if __name__ == "__main__":
    spawn(_measure, 2, None)
