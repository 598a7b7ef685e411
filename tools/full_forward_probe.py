"""Where does ``sharding="full"``'s forward lose its time on gloo? A probe without a compiler.

Why: on the benchmark's GPT (2 gloo ranks, the emulated 2 Gbit/s link) the fully sharded
forward takes 131-139 ms where its compute takes 81-85 and its gathers need 105 ms of the link
(docs/full-sharding.md), at bucket caps of 1, 2 and 4 MB alike. This probe runs the same pattern
eagerly: the GPT's 26 MB of parameters gathered in buckets of ``--cap-mb`` as graphddp gathers on
gloo (an ``all_to_all_single`` of the part repeated per rank), each bucket issued ``prefetch``
ahead of the one being read, each bucket's compute a matmul loop of ``--compute-ms`` in all
spread over the buckets; and, to separate the link from the compute, the gathers alone and one
gather of everything.

``--graphddp`` profiles graphddp's own compiled forward of the benchmark's GPT instead (AdamW
inside, ``reshard_after_forward=True``): per gather, when it was issued and how long the compute
then waited for it, and the forward's time.

Run from a clone: ``.venv/bin/python -m tools.full_forward_probe [--graphddp]``; docs/full-sharding.md
quotes it.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from graphddp.testing import spawn
from tools.bench.netns import enter_emulated_link
from tools.probe_runs import busy_compute, print_medians

ENV = "GRAPHDDP_FULL_PROBE_IN_NETNS"
TOTAL_MB = 26.2  # the benchmark GPT's fp32 parameters
A2A = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _forward(parts: list[torch.Tensor], prefetch: int | None, compute_ms: float, group: str, world: int) -> None:
    """Per bucket: wait its gather, then its compute; gather ``i`` issued before waiting
    ``i - prefetch``. ``prefetch=None``: compute only."""
    n = len(parts)
    issued: list[torch.Tensor] = []

    def issue(i: int) -> None:
        part = parts[i]
        issued.append(A2A(part.repeat(world), [part.numel()] * world, [part.numel()] * world, group))

    if prefetch is not None:
        for i in range(min(prefetch + 1, n)):
            issue(i)
    for i in range(n):
        if prefetch is not None:
            if i + prefetch + 1 < n:
                issue(i + prefetch + 1)
            WAIT(issued[i])
        if compute_ms:
            busy_compute(compute_ms / n, 128)


def _probe(rank: int, world: int, compute_ms: float, cap_mb: float) -> None:
    group = dist.group.WORLD.group_name
    buckets = max(1, round(TOTAL_MB / cap_mb))
    part = int(TOTAL_MB * 2**20 / 4 / buckets / world)
    parts = [torch.randn(part) for _ in range(buckets)]
    whole = [torch.randn(part * buckets)]
    runs: dict[str, Callable[[], None]] = {
        "compute only": lambda: _forward(parts, None, compute_ms, group, world),
        "one gather of everything": lambda: _forward(whole, 0, 0.0, group, world),
        f"{buckets} gathers, no compute": lambda: _forward(parts, 1, 0.0, group, world),
    }
    for prefetch in (0, 1, 2):
        runs[f"{buckets} gathers + compute, {prefetch} ahead"] = lambda p=prefetch: _forward(parts, p, compute_ms, group, world)
    print_medians(runs, 5, 36)


def _graphddp(rank: int, world: int) -> None:
    """The benchmark's GPT under ``sharding="full"``: the forward timed over 9 steps (after 3),
    then one forward profiled: each gather's issue (ms from the forward's start) and each wait."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    import graphddp
    from graphddp.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=2048, dim=256, heads=8, layers=8, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ours = graphddp.compile(model, optimizer=opt, sharding="full")
    idx = torch.randint(0, 2048, (8, 65), generator=torch.Generator().manual_seed(1000 + rank))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def step() -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        out = ours(x)
        took = time.perf_counter() - start
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return took, time.perf_counter() - start

    timed = [step() for _ in range(12)][3:]
    forwards, steps = [f for f, _ in timed], [s for _, s in timed]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    if rank == 0:
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        origin = next(e.time_range.start for e in events if e.name.startswith("Torch-Compiled Region"))
        issues = [(e.time_range.start - origin) / 1e3 for e in events if e.name == "_c10d_functional::all_to_all_single"]
        waits = [(e.time_range.start - origin, e.time_range.elapsed_us()) for e in events if e.name == "_c10d_functional::wait_tensor"]
        forward_us = next(e.time_range.end for e in events if e.name.startswith("Torch-Compiled Region")) - origin
        waits = [(s / 1e3, d / 1e3) for s, d in waits if s < forward_us]  # the forward's
        issues = [t for t in issues if t * 1e3 < forward_us]
        print(f"step {statistics.median(steps) * 1e3:.1f} ms, forward {statistics.median(forwards) * 1e3:.1f} ms (medians of {len(forwards)}); "
              f"in the profiled forward {len(issues)} gathers, waited {sum(d for _, d in waits):.1f} ms in all", flush=True)
        print("gathers issued at (ms): " + ", ".join(f"{t:.1f}" for t in issues))
        print("waits (at ms: for ms):   " + ", ".join(f"{s:.1f}: {d:.1f}" for s, d in waits))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbit", type=float, default=2.0)
    p.add_argument("--compute-ms", type=float, default=83.0, help="the forward's compute in all (the GPT's: 81-85)")
    p.add_argument("--cap-mb", type=float, default=1.0, help="gathered MB per bucket")
    p.add_argument("--graphddp", action="store_true", help="profile graphddp's compiled forward of the GPT instead")
    args = p.parse_args(argv)
    entered = enter_emulated_link(sys.argv[1:] if argv is None else argv, "tools.full_forward_probe", ENV, args.link_gbit)
    if entered is not None:
        return entered
    if args.graphddp:
        print(f"graphddp, sharding='full', the benchmark's GPT, 2 gloo ranks, emulated {args.link_gbit:g} Gbit/s link", flush=True)
        spawn(_graphddp, 2)
        return 0
    print(f"{TOTAL_MB:g} MB gathered in buckets of {args.cap_mb:g} MB, {args.compute_ms:g} ms of compute, 2 gloo ranks, "
          f"emulated {args.link_gbit:g} Gbit/s link (the gathers need about {TOTAL_MB * 8 / args.link_gbit:.0f} ms of it)", flush=True)
    spawn(_probe, 2, args.compute_ms, args.cap_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
