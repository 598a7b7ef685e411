"""The timing loop the probes share (``tools/*_probe.py``): each labelled run started together on
every rank (a barrier) and timed until every rank is done (another); rank 0 prints the median."""
from __future__ import annotations

import time
from typing import Callable

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
