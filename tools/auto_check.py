"""``sharding="auto"``'s choice against every placement measured, on the emulated link.

``python -m tools.auto_check`` (root, iproute2) runs gloo ranks in a private network namespace
whose loopback tbf limits to ``--link-gbit`` (:mod:`tools.bench.netns`, the benchmark's link).
For each model, every rank wraps one copy with ``sharding="auto"`` (the cost model calibrated on
the group at wrap time, no memory budget) and one copy per candidate placement with its options
given, all with AdamW, then trains the candidates in blocks of ``--block`` steps, interleaved,
each block fenced by barriers (a step's collectives left in flight, as ``gather="forward"``
leaves its all-gathers, overlap the next step as in a training loop; only the block's last waits
at the fence). Rank 0 prints, per placement, the predicted step, its forward and backward, and
peak (from the choice) next to the slower rank's median step measured (a block's time over its
steps) and rank 0's mean forward and backward, and whether the chosen placement's measured step
is within 5% of the fastest measured. docs/auto-sharding.md quotes it.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import graphddp
from graphddp.models import MLP, TinyGPT
from graphddp.plan.choose import TIE
from graphddp.testing import spawn
from tools.bench.netns import enter_emulated_link
from tools.emulated_step import timed

ENV = "GRAPHDDP_AUTO_IN_NETNS"


def _models(batch: int) -> dict:
    """name -> (make, example, loss of a model on a rank's step)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)
    tokens = torch.randint(0, 512, (batch // 16, 64), generator=g)
    return {
        "mlp 1024x6": (lambda: MLP(1024, 6, d_in=1024, d_out=1024), (x,), lambda m: F.mse_loss(m(x), y)),
        "gpt 4x256": (lambda: TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64), (tokens,),
                      lambda m: F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten())),
    }


def _rank(rank: int, world: int, steps: int, block: int, batch: int, backend: str, only: str, bf16: bool = False) -> None:
    torch.set_num_threads(1)
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for name, (make, example, loss) in _models(batch).items():
        if only not in name:
            continue
        torch.manual_seed(0)
        base = make()
        auto_model = copy.deepcopy(base)
        chosen = graphddp.compile(auto_model, optimizer=torch.optim.AdamW(auto_model.parameters()), sharding="auto",
                                  example=example, backend=backend, **policy).placement_choice
        runs = {}
        for c in chosen.candidates:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters())
            runs[c.name] = (graphddp.compile(model, optimizer=opt, backend=backend, **dict(c.options), **policy), opt)

        # per placement: each timed block's seconds per step, and rank 0's forward and backward seconds per step
        times: dict[str, list[float]] = {n: [] for n in runs}
        phases = {n: [0.0, 0.0] for n in runs}

        def steps_of(n: str) -> None:
            model, opt = runs[n]
            for _ in range(block):
                start = time.perf_counter()
                out = loss(model)
                middle = time.perf_counter()
                out.backward()
                phases[n][0] += middle - start
                phases[n][1] += time.perf_counter() - middle
                opt.step()
                opt.zero_grad()

        for i in range(steps + 2):  # two blocks of warm-up (the compiles), then the measured ones
            if i == 2:
                phases = {n: [0.0, 0.0] for n in runs}
            for n in runs:
                t = timed(lambda: steps_of(n))
                if i >= 2:
                    times[n].append(t / block)
        med = {n: statistics.median(v) for n, v in times.items()}
        rows: list = [None] * world
        dist.all_gather_object(rows, med)
        if rank == 0:
            slowest = {n: max(r[n] for r in rows) for n in med}
            fastest = min(slowest.values())
            print(f"\n{name}, {world} ranks, {backend}: {chosen.to_table().splitlines()[0]}")
            print("| placement | predicted step ms | measured step ms | predicted fwd / bwd ms | rank 0's fwd / bwd ms "
                  "| predicted peak MB | verdict |\n|---|---:|---:|---:|---:|---:|---|")
            for c in chosen.candidates:
                fwd, bwd = (x / (steps * block) * 1e3 for x in phases[c.name])
                print(f"| {c.name} | {c.step_seconds * 1e3:.1f} | {slowest[c.name] * 1e3:.1f} | {c.forward_seconds * 1e3:.1f} / "
                      f"{c.backward_seconds * 1e3:.1f} | {fwd:.1f} / {bwd:.1f} | {c.peak_bytes / 2**20:.1f} | {c.verdict} |")
            ok = slowest[chosen.chosen] <= fastest * (1 + TIE)
            print(f"chosen {chosen.chosen}: measured {slowest[chosen.chosen] / fastest:.3f} x the fastest measured "
                  f"({'within' if ok else 'NOT within'} {TIE:.0%})", flush=True)
        runs.clear()
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbit", type=float, default=2.0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="blocks measured per placement")
    p.add_argument("--block", type=int, default=3, help="steps per timed block")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--only", default="", help="the models whose name contains this (mlp, gpt)")
    p.add_argument("--bf16", action="store_true", help="every placement under FSDP2's bf16 policy (fp32 reduces): full sharding's only")
    args = p.parse_args(argv)
    entered = enter_emulated_link(sys.argv[1:] if argv is None else argv, "tools.auto_check", ENV, args.link_gbit)
    if entered is not None:
        return entered
    print(f"emulated {args.link_gbit:g} Gbit/s link, one thread per rank, AdamW, medians of {args.steps} interleaved blocks "
          f"of {args.block} steps, the slower rank")
    spawn(_rank, args.world, args.steps, args.block, args.batch, args.backend, args.only, args.bf16, timeout=3000.0, fresh=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
