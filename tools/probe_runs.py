"""What the probes share (``tools/*_probe.py``): the timing loop, each labelled run started together
on every rank (a barrier) and timed until every rank is done (another), rank 0 printing the
median; and the stand-in for a graph's compute, a matmul loop of a given time."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def print_medians(runs: dict[str, Callable[[], None]], repeats: int, width: int = 32) -> None:
    """Time each of ``runs`` ``repeats`` times on every rank; rank 0 prints each median in ms."""
    for label, run in runs.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            print(f"{label:<{width}} {sorted(times)[len(times) // 2] * 1e3:7.1f} ms (median of {len(times)})", flush=True)


def busy_compute(ms: float, n: int) -> None:
    """Compute for ``ms`` milliseconds on this thread: ``n`` x ``n`` matmuls, back to back."""
    a, start = torch.randn(n, n), time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        a = (a @ a).tanh()
