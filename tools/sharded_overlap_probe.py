"""Would a sharded bucket's update and all-gather pay inside the backward, on gloo? A probe.

Why: with ``sharding="optimizer"`` and ``gather="backward"`` every all-gather is issued at the end
of the backward, where nothing is left to hide it (docs/sharding.md). The alternative waits for
bucket ``k``'s reduce-scatter ``lag`` buckets later, updates, and issues its all-gather while the
backward still computes. In graphddp's generated code that measured slower, so this probe runs
the same pattern without a compiler: 2 gloo ranks on the emulated link of the benchmark (a
private network namespace, tbf at ``--link-gbit``), 14 buckets of the GPT's 26 MB, each bucket's
compute a busy loop of ``--compute-ms``, the reduce-scatter as graphddp issues it on gloo (the
kind's lowering: all-to-all, then the sum of the rows) and an all-gather of the half.

Run from a clone: ``.venv/bin/python -m tools.sharded_overlap_probe``; docs/sharding.md quotes it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.distributed as dist

from graphddp.testing import spawn
from graphddp.values.collectives import REDUCE_SCATTER
from tools.bench.netns import enter_emulated_link
from tools.probe_runs import busy_compute, print_medians

ENV = "GRAPHDDP_PROBE_IN_NETNS"
BUCKETS = 14
WAIT = torch.ops._c10d_functional.wait_tensor.default
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


def _step(lag: int | None, compute_ms: float, flats: list[torch.Tensor], group: str) -> None:
    """One backward: per bucket its compute, then its reduce-scatter issued; ``lag=None``: no
    communication; ``lag=0``: every update and all-gather after the last bucket (graphddp's
    default); ``lag=k``: bucket ``i``'s after bucket ``i + k``'s issue."""
    low = REDUCE_SCATTER.lower("gloo")
    pending, gathers = [], []

    def update(i: int) -> None:
        part = low.finish(WAIT(pending[i]), 2)
        gathers.append(GATHER(part, 2, group))

    for i, flat in enumerate(flats):
        busy_compute(compute_ms, 256)
        if lag is None:
            continue
        pending.append(low.issue(flat, group, 2))
        if lag and i >= lag:
            update(i - lag)
    if lag is not None:
        for i in range(len(flats) - lag if lag else 0, len(flats)):
            update(i)
    for g in gathers:
        WAIT(g)


def _probe(rank: int, world: int, compute_ms: float) -> None:
    group = dist.group.WORLD.group_name
    numel = 26 * 2**20 // 4 // BUCKETS // 2 * 2
    flats = [torch.randn(numel) for _ in range(BUCKETS)]
    runs: dict[str, Callable[[], None]] = {"compute only": lambda: _step(None, compute_ms, flats, group)}
    for lag in (0, 1, 2, 4):
        runs[f"lag {lag}" + (" (graphddp's placement)" if lag == 0 else "")] = lambda lag=lag: _step(lag, compute_ms, flats, group)
    print_medians(runs, 4, 32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbit", type=float, default=2.0)
    p.add_argument("--compute-ms", type=float, default=11.0, help="compute per bucket (the GPT's backward: about 11)")
    args = p.parse_args(argv)
    entered = enter_emulated_link(sys.argv[1:] if argv is None else argv, "tools.sharded_overlap_probe", ENV, args.link_gbit)
    if entered is not None:
        return entered
    print(f"{BUCKETS} buckets of 26 MB in all, {args.compute_ms:g} ms of compute each, 2 gloo ranks, "
          f"emulated {args.link_gbit:g} Gbit/s link", flush=True)
    spawn(_probe, 2, args.compute_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
