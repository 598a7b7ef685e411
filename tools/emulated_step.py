"""A step predicted against the step measured, at 2 and 3 ranks on the emulated link.

``python -m tools.emulated_step`` (root, iproute2) runs gloo ranks in a private network namespace
whose loopback tbf limits to ``--link-gbit`` (:mod:`tools.bench.netns`, the benchmark's link;
every rank's traffic shares it). Each rank trains an MLP two ways, interleaved step by step:
``torch.compile`` alone (no communication: the single-rank step) and ``graphddp.compile`` with its
defaults (auto buckets on the cost model calibrated on the group at wrap time). The prediction is
made as ``tools/ddp_scaling.py`` makes DDP's: the forward as measured alone, then the backward's
measured compute spread over its nodes by graphddp's estimates, its buckets' collectives
simulated on the calibrated link (:func:`graphddp.simulate`). Rank 0 prints, per world size, the
slower rank's median step measured, the prediction and their ratio. docs/explain.md quotes it.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

import graphddp
from graphddp.models import MLP
from graphddp.testing import spawn
from tools.bench.netns import enter_emulated_link

ENV = "GRAPHDDP_STEP_IN_NETNS"
BACKEND = "aot_eager"


def timed(fn) -> float:
    """Seconds ``fn`` took on this rank, fenced by barriers so every rank times the same step."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, world: int, steps: int, width: int, depth: int, batch: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(width, depth, d_in=width, d_out=width)
    x = torch.randn(batch, width)
    alone = torch.compile(copy.deepcopy(model), backend=BACKEND)
    ddp = graphddp.compile(model, backend=BACKEND)
    held: list[torch.Tensor] = []
    forward = lambda: held.append(alone(x).sum())  # noqa: E731
    backward = lambda: held.pop().backward()  # noqa: E731
    step = lambda: ddp(x).sum().backward()  # noqa: E731
    for _ in range(3):
        forward(), backward(), step()
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for _ in range(steps):
        times["forward"].append(timed(forward))
        times["backward"].append(timed(backward))
        times["step"].append(timed(step))
    med = {k: statistics.median(v) for k, v in times.items()}
    (schedule,) = ddp.schedules
    cost = schedule.cost_model
    estimates = {n.name: cost.compute_seconds(n.flops, n.nbytes) for n in schedule.nodes if n.is_compute}
    scale = med["backward"] / sum(estimates.values())
    timeline = graphddp.simulate(schedule, cost, {k: v * scale for k, v in estimates.items()})
    predicted = med["forward"] + timeline.step_seconds
    rows: list = [None] * world
    dist.all_gather_object(rows, (med, predicted, len(schedule.buckets), cost.describe()))
    if rank == 0:
        slowest = max(rows, key=lambda r: r[0]["step"])
        med, predicted, buckets, link = slowest
        print(f"| {world} | {buckets} | {med['forward'] * 1e3:.1f} | {med['backward'] * 1e3:.1f} | {med['step'] * 1e3:.1f} | "
              f"{predicted * 1e3:.1f} | {predicted / med['step']:.2f} | {link} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbit", type=float, default=2.0)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    entered = enter_emulated_link(sys.argv[1:] if argv is None else argv, "tools.emulated_step", ENV, args.link_gbit)
    if entered is not None:
        return entered
    params = sum(q.numel() for q in MLP(args.width, args.depth, d_in=args.width, d_out=args.width).parameters())
    print(f"MLP {args.width} x {args.depth} ({params * 4 / 2**20:.1f} MB of fp32 gradients), batch {args.batch}, {BACKEND}, "
          f"one thread per rank, emulated {args.link_gbit:g} Gbit/s link; medians of {args.steps} interleaved steps, the slower rank")
    print("| ranks | buckets | forward ms (alone) | backward ms (alone) | step ms measured | step ms predicted | predicted / measured "
          "| calibrated cost model |\n|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for world in args.worlds:
        spawn(_rank, world, args.steps, args.width, args.depth, args.batch, timeout=1200.0, fresh=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
