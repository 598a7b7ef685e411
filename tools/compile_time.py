"""Compile time of the first training step: plain ``torch.compile`` against ``graphddp.compile``.

Issue 12, part 2 (warm restarts). Each run is a fresh pair of gloo ranks (new processes, one
thread each) that builds a Hugging Face GPT-2 from its config (no download), compiles it with
inductor and times its first forward + backward, compile included. A mode runs *cold* (an
empty ``TORCHINDUCTOR_CACHE_DIR``) and then *warm* (the same directory, new processes), the way
a job restarts. Plain ``torch.compile`` runs without communication (each rank compiles its own
copy, as under DDP); graphddp runs ``graphddp.compile(model, **options)`` (``--graphddp-options``,
default: none given).

Rank 0 reports its first step (wall, and CPU seconds of the process and its finished
children, which the other load on a shared machine disturbs less) and a breakdown: Dynamo's
timers (``torch._dynamo.utils``), inductor's, AOTAutograd's and graphddp's cache counters, and
graphddp's passes (capture, plan, insert_collectives, verify), its compile cache and inductor's
inner compiles, timed by wrapping them in the rank processes only. Modes alternate run by run.
Run it from a tree nobody edits: graphddp's cache key covers graphddp's source.

    python -m tools.compile_time                       # both modes, cold then warm, small GPT-2
    python -m tools.compile_time --preset 15m --repeat 2
    python -m tools.compile_time --modes graphddp --warm-only --cache-dir /tmp/c   # reuse a cache
    python -m tools.compile_time --profile prof        # cProfile of rank 0, one file per run
    python -m tools.compile_time --graphddp-options '{"bucket_cap_mb": 25}'
    python -m tools.compile_time --graphddp-options '{"optimizer": "adamw"}'   # AdamW: after the backward / inside it
    python -m tools.compile_time --backend aot_eager --warm-runs 0 --graphddp-options '{"optimizer": "adamw", "sharding": "full"}'
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

PRESETS: dict[str, dict[str, int]] = {
    # n_layer, n_embd, n_head, vocab_size, seq (n_positions = seq), batch per rank
    "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, seq=32, batch=2),
    "small": dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, seq=128, batch=2),
    "medium": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, seq=128, batch=2),
    # About 16M parameters (most of them the 50257 x 256 embedding, tied to the head).
    "15m": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=50257, seq=128, batch=2),
}
MODES = ("plain", "graphddp")


def build_model(cfg: dict[str, int]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab_size"],
        n_positions=cfg["seq"], attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    ))


# -- timing graphddp's passes from outside -------------------------------------------------------------


class Timers:
    """Seconds per label, summed; ``wrap`` replaces ``owner.name`` by a timed version."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        fn = getattr(owner, name)
        label = label or name

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)


def _install_timers(timers: Timers, mode: str) -> None:
    """Wrap the functions whose time the breakdown reports (this process only)."""
    import torch._inductor.compile_fx as compile_fx

    # Every inductor graph compile, forward and backward, graphddp's and plain's: the name is
    # looked up in compile_fx's module at call time (graphddp imports it inside the function;
    # compile_fx's own default argument is bound at import, so plain gets it via fw/bw paths).
    timers.wrap(compile_fx, "compile_fx_inner", "inductor compile_fx_inner")
    if mode != "graphddp":
        return
    import graphddp.compiler.compose as compose
    import graphddp.compiler.full as full
    import graphddp.compiler.full_updates as full_updates
    import graphddp.compiler.rewrite as rewrite

    for name in ("extract_facts", "plan"):  # looked up in the rewrite's module at call time
        timers.wrap(rewrite, name, f"graphddp {name}")
    for name in ("insert_collectives", "verify"):  # looked up in the pass list's module at call time
        timers.wrap(compose, name, f"graphddp {name}")
    timers.wrap(rewrite.BackwardRewrite, "rewrite_backward", "graphddp rewrite_backward (all passes)")
    timers.wrap(full, "_placed", "graphddp sharding='full' placement")
    timers.wrap(full_updates.PartUpdates, "backward_variant", "graphddp sharding='full' updating variants")
    import graphddp.compiler.cache as cache

    for name in ("plan_key", "load", "store"):
        timers.wrap(cache, name, f"graphddp compile_cache.{name}")
    import graphddp.compiler.cache_derivation as cache_derivation

    timers.wrap(cache_derivation.Derivation, "_derive", "graphddp compile_cache derivation")


def _counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    wanted = ("inductor", "aot_autograd", "graphddp")
    return {k: {n: int(v) for n, v in counters[k].items() if "cache" in n or k == "graphddp"} for k in wanted if k in counters}


def _dynamo_times() -> dict[str, float]:
    """Dynamo's own timers: total seconds per phase (``dynamo_timed`` regions, nested)."""
    from torch._dynamo import utils

    return {k: round(sum(v), 3) for k, v in sorted(utils.compilation_time_metrics.items())}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the C++ compiler): less
    sensitive than wall time to whatever else the machine runs."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _optimizer(name: str | None, model: Any) -> Any:
    """``"optimizer": "adamw"`` among the options: AdamW in both modes, stepped after the
    backward by plain (inside the first step's time) and attached by graphddp (updated inside
    its backward), so the first step compares what each mode compiles for a training step."""
    import torch

    if name is None:
        return None
    if name != "adamw":
        raise SystemExit(f"tools.compile_time: optimizer {name!r}: only 'adamw' is supported")
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _rank(
    rank: int, world_size: int, mode: str, cfg: dict[str, int], out_path: str, profile: str | None, options: dict[str, Any],
) -> None:
    import torch
    import torch.distributed as dist

    timers = Timers()
    _install_timers(timers, mode)
    model = build_model(cfg)
    options = dict(options)
    optimizer = _optimizer(options.pop("optimizer", None), model)
    if mode == "plain":
        compiled = torch.compile(model, backend=options.get("backend", "inductor"))
    else:
        import graphddp

        compiled = graphddp.compile(model, optimizer=optimizer, **options)

    def step_optimizer() -> None:  # plain: torch's step after the backward; graphddp: already done inside it
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
    dist.barrier()
    profiler = None
    if profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu_start = _cpu_seconds()
    start = time.perf_counter()
    out = compiled(input_ids=ids, labels=ids)
    forward = time.perf_counter() - start
    out.loss.backward()
    step_optimizer()
    first = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    # The second step: nothing compiles, so first - second is what compiling cost.
    start = time.perf_counter()
    compiled(input_ids=ids, labels=ids).loss.backward()
    step_optimizer()
    second = time.perf_counter() - start
    report = {
        "rank": rank, "first_step_s": round(first, 3), "first_step_cpu_s": round(cpu, 3), "first_forward_s": round(forward, 3),
        "second_step_s": round(second, 3), "counters": _counters(), "dynamo_timed_s": _dynamo_times(),
        "wrapped_s": {k: round(v, 3) for k, v in sorted(timers.seconds.items())}, "wrapped_calls": timers.calls,
    }
    if mode == "graphddp":
        report["fingerprints"] = [s.fingerprint() for s in compiled.schedules]
        costs = {s.cost_model.describe() for s in compiled.schedules if getattr(s, "cost_model", None) is not None}
        report["cost_models"] = sorted(costs)  # what "auto" planned with: kept from an earlier run, or measured
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(report, f)


def run_once(
    mode: str, cfg: dict[str, int], cache_dir: str, world_size: int, profile: str | None = None, options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One fresh pair of ranks with ``cache_dir`` as inductor's cache; rank 0's report, with
    every rank's first step under ``first_step_s_by_rank``."""
    from graphddp.testing import spawn

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        spawn(_rank, world_size, mode, cfg, out, profile, options or {}, timeout=1800, fresh=True)
        reports = [json.load(open(f"{out}.{r}")) for r in range(world_size)]
    report = reports[0]
    report["first_step_s_by_rank"] = [r["first_step_s"] for r in reports]
    report["first_step_cpu_s_by_rank"] = [r["first_step_cpu_s"] for r in reports]
    return report


def _print_breakdown(label: str, report: dict[str, Any]) -> None:
    print(f"  {label}: first step {report['first_step_s']:.2f} s (ranks {report['first_step_s_by_rank']}, "
          f"CPU {report['first_step_cpu_s_by_rank']}), "
          f"forward {report['first_forward_s']:.2f} s, second step {report['second_step_s']:.3f} s")
    keys = (
        "_compile.compile_inner", "entire_backward_compile", "backend_compile", "create_aot_dispatcher_function",
        "aot_trace_joint_graph", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
        "compile_fx_inner", "fx_codegen_and_compile", "async_compile.wait", "PyCodeCache.load_by_key_path",
    )
    times = report["dynamo_timed_s"]
    print("    dynamo_timed: " + ", ".join(f"{k}={times[k]}" for k in keys if k in times))
    print("    wrapped: " + ", ".join(f"{k}={v} ({report['wrapped_calls'][k]}x)" for k, v in report["wrapped_s"].items()))
    print("    counters: " + json.dumps(report["counters"], sort_keys=True))
    for cost in report.get("cost_models", ()):
        print(f"    cost model: {cost}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compile_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "seq", "batch"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override the preset's {key}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="both modes' torch.compile backend (aot_eager: tracing alone, no C++)")
    parser.add_argument(
        "--graphddp-options", default="{}",
        help='graphddp.compile options as JSON, e.g. \'{"bucket_cap_mb": 25}\' (default: its defaults; note '
        'bucket_cap_mb="auto" calibrates the link at wrap time, and a restart that measures other numbers plans anew)',
    )
    parser.add_argument("--repeat", type=int, default=1, help="cold+warm pairs per mode (each cold starts empty)")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm runs after each cold one")
    parser.add_argument("--cache-dir", help="inductor cache directories go under DIR/<mode> (default: new temporary ones, removed after)")
    parser.add_argument("--warm-only", action="store_true", help="with --cache-dir: skip the cold run")
    parser.add_argument("--profile", help="write cProfile stats of rank 0 as PROFILE.<mode>.<cold|warm>.<i>")
    parser.add_argument("--json", help="write every report here")
    args = parser.parse_args(argv)
    options = {**json.loads(args.graphddp_options), "backend": args.backend}
    cfg = dict(PRESETS[args.preset])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    print(f"GPT-2 {cfg}, {args.world_size} gloo ranks, 1 thread each, torch.compile backend {args.backend}, graphddp options {options}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def record(mode: str, kind: str, i: int, j: int, cache: str) -> None:
        profile = f"{args.profile}.{mode}.{kind}.{i}.{j}" if args.profile else None
        report = run_once(mode, cfg, cache, args.world_size, profile, options)
        results.setdefault(mode, {}).setdefault(kind, []).append(report)
        print(f"[{mode} {kind} #{i}.{j}]")
        _print_breakdown(kind, report)
        sys.stdout.flush()

    # Modes alternate run by run (cold, cold, warm, warm, ...), so a load that comes and goes
    # on the machine falls on every mode alike.
    for i in range(args.repeat):
        caches: dict[str, str] = {}
        try:
            for mode in args.modes:
                if args.cache_dir is not None:
                    caches[mode] = os.path.join(args.cache_dir, mode)
                else:
                    caches[mode] = tempfile.mkdtemp(prefix=f"compile_time_{mode}_")
                if not args.warm_only:
                    shutil.rmtree(caches[mode], ignore_errors=True)
                    record(mode, "cold", i, 0, caches[mode])
            for j in range(args.warm_runs):
                for mode in args.modes:
                    record(mode, "warm", i, j, caches[mode])
        finally:
            if args.cache_dir is None:
                for cache in caches.values():
                    shutil.rmtree(cache, ignore_errors=True)
    print("\nsummary (rank 0's first step, seconds: median [min..max] over runs; wall, then CPU incl. the C++ compiler)")
    medians: dict[tuple[str, str, str], float] = {}
    for mode, kinds in results.items():
        for kind, reports in kinds.items():
            line = f"  {mode:9s} {kind:5s}"
            for metric in ("first_step_s", "first_step_cpu_s"):
                values = [r[metric] for r in reports]
                medians[mode, kind, metric] = statistics.median(values)
                line += f" {medians[mode, kind, metric]:7.2f} [{min(values):.2f}..{max(values):.2f}]"
            print(f"{line}  n={len(reports)}")
    for kind, target in (("cold", 1.15), ("warm", 1.30)):
        if ("plain", kind, "first_step_s") in medians and ("graphddp", kind, "first_step_s") in medians:
            wall = medians["graphddp", kind, "first_step_s"] / medians["plain", kind, "first_step_s"]
            cpu = medians["graphddp", kind, "first_step_cpu_s"] / medians["plain", kind, "first_step_cpu_s"]
            print(f"  graphddp / plain {kind}: wall {wall:.2f}x, CPU {cpu:.2f}x (target <= {target}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "world_size": args.world_size, "graphddp_options": options, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
