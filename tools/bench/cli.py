"""``python -m tools.bench``: parse options, set up the link, spawn the ranks, report."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import tools.bench
from graphddp.config import DDPConfig
from graphddp.frontend.cli import add_option_flags, options_from_args
from tools.bench.netns import NETNS_ENV, NETNS_SETUP_FAILED, _tc_stats, reexec_in_netns, setup_netns_link
from tools.bench.procstat import machine_load
from tools.bench.ranks import rank_main
from tools.bench.report import plot, render_table
from tools.bench.summary import summarize
from tools.bench.workload import DEFAULT_MODES, MODE_PRESETS, MODES, OPT_IN_MODES, SWEEP_MODES, BenchConfig, model_spec


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=tools.bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--steps", type=int, default=25, help="timed rounds (median over these)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds after each mode's first (compile) step")
    p.add_argument("--tiny", action="store_true",
                   help="tiny MLP and the aot_eager backend: a fast smoke run, not a measurement")
    graphddp_options = p.add_argument_group(
        "graphddp's options", "graphddp.compile's options (caps default per model; backend inductor, aot_eager with "
        "--tiny); the backend is also the inner compiler of every compiled mode")
    add_option_flags(graphddp_options)
    p.add_argument("--tail-off", action="store_true", help="no last_bucket_cap_mb (the model's default sets one)")
    p.add_argument("--link-gbit", type=float, default=2.0,
                   help="emulated link rate in Gbit/s (tbf on a private namespace's loopback); 0: plain loopback")
    p.add_argument("--powersgd-rank", type=int, default=1,
                   help="matrix_approximation_rank of the PowerSGD modes (graphddp_powersgd, ddp_powersgd*; DDP's default 1)")
    p.add_argument("--out", default="bench_out", help="directory for bench.json and bench.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-probe-runs", type=int, default=5)
    p.add_argument("--inductor-cache", default=os.path.join(tempfile.gettempdir(), "graphddp-bench-inductor-cache"),
                   help="TORCHINDUCTOR_CACHE_DIR for the ranks ('' for a fresh one: cold compile times)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated subset of modes (graphddp always runs; ddp means ddp_default; sweep means "
                        f"issue 12's {','.join(SWEEP_MODES)}); {','.join(OPT_IN_MODES)} run only when named "
                        "(or by sweep)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds before the ranks are killed")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="wait up to this many seconds for the cores to be idle (< 15%% busy) before starting")
    return p.parse_args(argv)


def resolve_modes(spec: str) -> tuple[str, ...]:
    """``--modes``: names and presets (``MODE_PRESETS``: ddp, sweep), comma-separated, to the
    modes that run, in ``MODES`` order; graphddp always runs (its schedule feeds other modes)."""
    asked: set[str] = set()
    for name in (m.strip() for m in spec.split(",")):
        if name:
            asked.update(MODE_PRESETS.get(name, (name,)))
    unknown = asked - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES} or the presets {sorted(MODE_PRESETS)}")
    return tuple(m for m in MODES if m in asked | {"graphddp"})


def _device(argv: list[str]) -> str:
    """``--device`` (cpu unless given): the CUDA benchmark is another program (tools.bench.cuda)."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    device = _device(argv)
    if device == "cuda":
        from tools.bench import cuda

        return cuda.main(argv)
    if device != "cpu":
        raise SystemExit(f"python -m tools.bench: --device must be cpu or cuda, got {device!r}")
    argv = [a for i, a in enumerate(argv) if a != "--device" and not a.startswith("--device=") and (i == 0 or argv[i - 1] != "--device")]
    args = parse_args(argv)
    network: dict[str, Any]
    if args.link_gbit > 0 and os.environ.get(NETNS_ENV) != "1":
        rc, reason = reexec_in_netns(argv)
        if rc is not None:
            return rc
        print(f"[bench] network emulation unavailable: {reason}; falling back to plain loopback", flush=True)
        network = {"emulated": False, "label": f"plain loopback, NOT emulated ({reason})", "rate_gbit": None}
    elif args.link_gbit > 0:
        try:
            network = {"emulated": True, "rate_gbit": args.link_gbit, **setup_netns_link(args.link_gbit)}
        except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            print(f"[bench] namespace link setup failed: {detail}", file=sys.stderr, flush=True)
            return NETNS_SETUP_FAILED
        network["label"] = (f"emulated {args.link_gbit:g} Gbit/s link: tbf on the loopback of a private netns, "
                            f"shared by both ranks' traffic (2-rank all-reduce of B bytes ~ 16*B/R ns)")
    else:
        network = {"emulated": False, "label": "plain loopback (no emulation: --link-gbit 0), CPU-bound", "rate_gbit": None}

    kwargs, batch, cap, first_cap, last_cap = model_spec(args.model, args.tiny)
    defaults = {"backend": "aot_eager" if args.tiny else "inductor", "bucket_cap_mb": cap,
                "first_bucket_cap_mb": first_cap, "last_bucket_cap_mb": None if args.tail_off else last_cap}
    given = options_from_args(args)
    if given.get("bucket_cap_mb") == "auto":  # the cost model picks every bucket: no model caps with it
        defaults.update(first_bucket_cap_mb=None, last_bucket_cap_mb=None)
    try:
        graphddp_config = DDPConfig.from_options("python -m tools.bench", {**defaults, **given})
    except (TypeError, ValueError) as e:
        raise SystemExit(f"python -m tools.bench: {e}") from None
    backend = graphddp_config.backend
    if args.powersgd_rank < 1:
        raise SystemExit("python -m tools.bench: --powersgd-rank must be >= 1")
    modes = resolve_modes(args.modes)
    cfg = BenchConfig(
        model=args.model, tiny=args.tiny, steps=args.steps, warmup=args.warmup, graphddp=graphddp_config,
        seed=args.seed, out=args.out, network=network, model_kwargs=kwargs, batch=batch,
        ready_probe_runs=args.ready_probe_runs, modes=modes, powersgd_rank=args.powersgd_rank,
    )
    os.makedirs(args.out, exist_ok=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # traffic stays on the loopback (of our namespace)
    fresh_cache = not args.inductor_cache
    cache = args.inductor_cache or tempfile.mkdtemp(prefix="graphddp-bench-inductor-")
    os.environ["GRAPHDDP_BENCH_CACHE_WARM"] = "1" if os.path.isdir(cache) and os.listdir(cache) else "0"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    print(f"[bench] model {'tiny mlp' if args.tiny else args.model}, backend {backend}, "
          f"{args.steps} steps + {args.warmup} warm-up, network: {network['label']}", flush=True)
    from graphddp.testing import spawn

    deadline = time.time() + args.wait_quiet
    load_before = machine_load()
    while load_before.get("busy_fraction", 0) > 0.15 and time.time() < deadline:
        load_before = machine_load(2.0)
    if load_before.get("busy_fraction", 0) > 0.25:
        print(f"[bench] WARNING: the machine is already {100 * load_before['busy_fraction']:.0f}% busy "
              f"(loadavg {load_before['loadavg']}): other processes will perturb the timings", flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "ranks.json")
        try:
            spawn(rank_main, 2, cfg, result_path, timeout=args.timeout)
        finally:
            if fresh_cache:
                shutil.rmtree(cache, ignore_errors=True)
        with open(result_path) as f:
            ranks = json.load(f)
    summary = summarize(cfg, ranks, time.time() - t0)
    summary["environment"]["load_before"] = load_before
    # Only what was measured during the timed steps (runqueue delay, cpu/wall) makes a warning:
    # the machine can be busy before the run and quiet during it.
    if network.get("emulated"):
        network["tc_stats_after"] = _tc_stats()
    table = render_table(summary)  # after the warnings are complete
    print("\n" + "\n".join(summary["graphddp"]["schedules"]) + "\n")
    if summary.get("graphddp_auto"):  # its plan, with the timeline it was chosen for
        print("graphddp_auto:\n" + "\n".join(summary["graphddp_auto"]["schedules"]) + "\n")
    print(table)
    json_path = os.path.join(args.out, "bench.json")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.out, "bench.txt"), "w") as f:
        f.write(table + "\n")
    print(f"[bench] wrote {json_path}")
    print("[bench] " + plot(summary, os.path.join(args.out, "bench.png")))
    print(f"[bench] total wall time {time.time() - t0:.0f} s")
    return 0
