"""Why graphddp never has two functional all-gathers in flight on gloo: they corrupt the heap.

Two gloo CPU ranks issue ``_c10d_functional.all_gather_into_tensor`` on a list of tensors with
``--depth`` more in flight before each wait (as a prefetching forward does), for ``--rounds``
rounds. With torch 2.13 ``--kind functional --depth 1`` dies within a few hundred rounds
(``malloc(): unaligned tcache chunk detected``, or a segmentation fault, in a gloo run-loop
thread); ``--kind all_to_all`` (the same layout from ``all_to_all_single`` of the part repeated
``world`` times, what graphddp issues on gloo instead) and ``--kind eager``
(``dist.all_gather_into_tensor(..., async_op=True)``) run to the end at ``--depth 2``.

    python -m tools.gloo_gather_race --kind functional --depth 1
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

F = torch.ops._c10d_functional


def _rounds(rank: int, world: int, kind: str, depth: int, rounds: int) -> None:
    parts = [torch.randn(n) for n in (131072, 512, 65536, 256, 131072, 1024) * 5]
    for _ in range(rounds):
        inflight = []
        for p in parts:
            if kind == "eager":
                inflight.append(dist.all_gather_into_tensor(torch.empty(p.numel() * world), p, async_op=True))
            elif kind == "all_to_all":
                inflight.append(F.all_to_all_single.default(p.repeat(world), [p.numel()] * world, [p.numel()] * world, "0"))
            else:
                inflight.append(F.all_gather_into_tensor.default(p, world, "0"))
            while len(inflight) > depth:
                done = inflight.pop(0)
                done.wait() if kind == "eager" else F.wait_tensor.default(done)
        for done in inflight:
            done.wait() if kind == "eager" else F.wait_tensor.default(done)
    if rank == 0:
        print(f"{kind}, {depth + 1} in flight: {rounds} rounds, no crash")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("functional", "all_to_all", "eager"), default="functional")
    p.add_argument("--depth", type=int, default=1, help="collectives in flight besides the one waited for")
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args(argv)
    from graphddp.testing import spawn

    spawn(_rounds, 2, args.kind, args.depth, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
