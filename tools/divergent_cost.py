"""What a divergent step costs: ranks whose steps use different parameters (LayerDrop).

graphddp averages a step whose ranks ran different graphs over the union of their gradients,
at the end of the backward (``graphddp.runtime.union``); DDP needs ``find_unused_parameters=True`` for
such a model and averages every bucket, overlapped, after walking the autograd graph each
step. This tool trains Hugging Face BART (from its config, no download) with the same
``encoder_layerdrop``/``decoder_layerdrop`` on 2 gloo ranks, each rank drawing its own layers to
skip, and reports per mode the median step time (AdamW, forward + backward + step) and the
bytes the link carried per step (the emulated link's ``tc`` counters, both ranks, both ways):

* ``graphddp``: ``graphddp.compile(model, backend=...)``, no flag;
* ``ddp_find_unused``: ``DistributedDataParallel(model, find_unused_parameters=True)``;

each with LayerDrop on (divergent steps) and off (``--layerdrop 0``, every step static: the
case that must stay as fast as before). Runs inside a private network namespace whose
loopback is rate-limited (``--link-gbit``, as ``python -m tools.bench``); 0 for plain loopback
(no byte counts then).

    python -m tools.divergent_cost                    # layerdrop 0.2 and 0, 2 Gbit/s
    python -m tools.divergent_cost --layerdrop 0.2 --steps 20 --backend inductor
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

NETNS_ENV = "GRAPHDDP_DIVERGENT_IN_NETNS"


def _bart(layerdrop: float, size: str) -> Any:
    from transformers import BartConfig, BartForConditionalGeneration

    d, layers = (128, 4) if size == "small" else (32, 2)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=2048, d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, max_position_embeddings=64,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0,
    ))


def _sent_bytes() -> int | None:
    """Bytes the namespace's loopback qdisc has sent so far (None without one)."""
    if os.environ.get(NETNS_ENV) != "1":
        return None
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    match = re.search(r"Sent (\d+) bytes", out)
    return int(match.group(1)) if match else None


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import graphddp

    results = []
    for layerdrop in args.layerdrop:
        for mode in ("graphddp", "ddp_find_unused"):
            torch.manual_seed(0)
            model = _bart(layerdrop, args.size)
            if mode == "graphddp":
                wrapped = graphddp.compile(model, backend=args.backend)
            else:
                wrapped = DDP(model, find_unused_parameters=True)
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
            g = torch.Generator().manual_seed(rank)
            ids = torch.randint(4, 2048, (args.batch, args.seq), generator=g)
            times, sent = [], 0
            for step in range(args.warmup + args.steps):
                torch.manual_seed(1000 * rank + step)  # each rank draws its own layers to skip
                dist.barrier()
                before = _sent_bytes() if rank == 0 else None
                start = time.perf_counter()
                wrapped(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                dist.barrier()
                after = _sent_bytes() if rank == 0 else None
                if step >= args.warmup:
                    times.append(elapsed)
                    if before is not None and after is not None:
                        sent += after - before
            union = getattr(wrapped._state.backend, "union", None) if mode == "graphddp" else None
            divergent = union.steps if union is not None else None
            results.append({
                "mode": mode, "layerdrop": layerdrop, "median_step_ms": 1e3 * statistics.median(times),
                "link_bytes_per_step": sent / args.steps if sent else None, "divergent_steps": divergent,
                "steps": args.warmup + args.steps,
            })
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.divergent_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layerdrop", type=float, nargs="+", default=[0.2, 0.0])
    p.add_argument("--size", choices=("small", "tiny"), default="small")
    p.add_argument("--backend", default="aot_eager", help="graphddp's inner compiler (inductor, aot_eager)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--link-gbit", type=float, default=2.0)
    p.add_argument("--out", default="divergent_cost.json")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.link_gbit > 0 and os.environ.get(NETNS_ENV) != "1":
        from tools.bench.netns import reexec_in_netns

        rc, reason = reexec_in_netns(argv, module="tools.divergent_cost", env_flag=NETNS_ENV)
        if rc is not None:
            return rc
        print(f"[divergent_cost] no emulated link ({reason}): plain loopback, no byte counts", flush=True)
    elif os.environ.get(NETNS_ENV) == "1":
        from tools.bench.netns import setup_netns_link

        setup_netns_link(args.link_gbit)
    from graphddp.testing import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(_rank, 2, args, out, timeout=3000)
        with open(out) as f:
            results = json.load(f)
    link = f"{args.link_gbit} Gbit/s emulated link" if os.environ.get(NETNS_ENV) == "1" else "plain loopback"
    print(f"BART {args.size}, batch {args.batch} x {args.seq} per rank, 2 gloo ranks, {link}, graphddp backend {args.backend}")
    print(f"{'mode':<18}{'layerdrop':>10}{'step ms':>10}{'link MB/step':>14}{'divergent':>11}")
    for r in results:
        mb = f"{r['link_bytes_per_step'] / 1e6:.2f}" if r["link_bytes_per_step"] else "-"
        div = "-" if r["divergent_steps"] is None else f"{r['divergent_steps']}/{r['steps']}"
        print(f"{r['mode']:<18}{r['layerdrop']:>10}{r['median_step_ms']:>10.1f}{mb:>14}{div:>11}")
    with open(args.out, "w") as f:
        json.dump({"link": link, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
