"""How much of the per-step agreement's round trip a backward can hide, on this machine.

Two gloo CPU ranks issue the agreement's collective (:func:`graphddp.runtime.agree.max_reduce_async`,
what a gated backward issues when it starts), compute for ``--compute-ms`` (matmuls, one
thread: a backward up to its first bucket), then read the answer (what the first bucket's issue
does: :mod:`graphddp.runtime.gate`); the time the read still waits is what the step pays. A
barrier before each round starts both ranks together. On this project's 2-core machine gloo's
threads compete with the ranks' compute for the cores, so little of the round trip is hidden.

    python -m tools.agreement_latency --compute-ms 0 1 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _rounds(rank: int, world: int, compute_ms: list[float], rounds: int) -> None:
    from graphddp.runtime.agree import max_reduce_async

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for ms in compute_ms:
        waits = []
        for _ in range(rounds):
            dist.barrier()
            read = max_reduce_async([1, -1, 0, 0, 0, 0, 0], dist.group.WORLD)
            start = time.perf_counter()
            while (time.perf_counter() - start) * 1e3 < ms:
                a @ a
            before = time.perf_counter()
            read()
            waits.append((time.perf_counter() - before) * 1e6)
        if rank == 0:
            print(f"read after {ms:g} ms of compute: waited {statistics.median(waits):.0f} us median, "
                  f"{statistics.mean(waits):.0f} us mean ({rounds} rounds)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    from graphddp.testing import spawn

    spawn(_rounds, 2, args.compute_ms, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
