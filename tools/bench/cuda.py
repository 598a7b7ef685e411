"""``python -m tools.bench --device cuda``: graphddp's modes on one GPU, step time and memory.

What the GPU issues measure with. One process per mode, NCCL at world size 1 (no link: what
each mode costs on its own), every mode training the same model from the same seed with
AdamW under bf16 autocast and inductor:

  compile               torch.compile(model), fused AdamW, no data parallelism: the floor
  ddp_compiled          DDP(torch.compile(model)), 25 MB buckets, fused AdamW
  graphddp              graphddp.compile(model) at its defaults (the auto plan), fused AdamW
  graphddp_cap25        graphddp.compile(model, bucket_cap_mb=25), fused AdamW
  graphddp_optim        graphddp.compile(model, optimizer=AdamW): the update inside the backward
                        (every mode gets the same fused AdamW: graphddp compiles its math into
                        the backward, fused keeps its steps on the GPU, as torch does)
  graphddp_sharded      ... optimizer=AdamW, sharding="optimizer"
  graphddp_sharded_fwd  ... sharding="optimizer", gather="forward"
  graphddp_full         ... sharding="full": parameters held as parts, gathered in the forward
                        and again in the backward (reshard_after_forward=True)
  graphddp_full_keep    ... sharding="full", reshard_after_forward=False

Why one process per mode: memory is the allocator's own count (``memory_allocated``), which
sees every tensor of the process, so a mode is alone in its process. The processes compile at
once (their first steps overlap), then take turns: the parent lets one mode at a time run a
block of steps, rotating the order every round, so drift on the machine falls on every mode
alike (the interleaving of the CPU benchmark, in time rather than in one process).

Per mode: ``first_step_s`` (compile included, from the model's wrap), ``between_mb``
(``memory_allocated`` after a step, its ``zero_grad`` and a synchronize), ``step_peak_mb``
(``max_memory_allocated`` over one step after the warm-up), the same two as the bytes the
tensors requested (``between_requested_mb``, ``step_peak_requested_mb``: without the
allocator's rounding, what the lane's bounds compare), ``timed_peak_mb`` (over every
timed step) and ``step_ms`` (median over rounds of a round's mean, CUDA events). With
``--memory-sites`` the allocator records every allocation's Python stack and each mode also
reports where its bytes are between steps and at its step's peak (:mod:`tools.bench.memsites`).
With ``--profile-steps N`` each mode, in turn, traces N steady steps and reports the GPU's busy
and idle time per step, its kernel launches and the kernels that took longest
(:mod:`tools.bench.gpu_profile`; the traces are kept in ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

MODES = ("compile", "ddp_compiled", "graphddp", "graphddp_cap25", "graphddp_optim", "graphddp_sharded", "graphddp_sharded_fwd",
         "graphddp_full", "graphddp_full_keep")
MB = 1024 * 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench --device cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda",))
    p.add_argument("--model", choices=("gpt2", "cnn"), default="gpt2")
    p.add_argument("--layers", type=int, default=6, help="GPT-2 blocks (dim 768, vocab 50304, sequence 1024)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds; each mode runs --steps steps per round")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--memory-sites", action="store_true", help="record allocation stacks; report where the bytes are")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed rounds, trace this many steps of each mode in turn and report where "
                        "the GPU's time goes (tools.bench.gpu_profile)")
    p.add_argument("--padding", choices=("on", "off"), default="on",
                   help="inductor's comprehensive padding (on: inductor's default for GPU inputs)")
    p.add_argument("--inductor-config", action="append", default=[], metavar="NAME=VALUE",
                   help="set torch._inductor.config.NAME (a Python literal) in every mode's process, e.g. "
                        "combo_kernels=True: what a setting does to each mode's compile and step, measured")
    p.add_argument("--out", default="bench_out", help="directory for bench_cuda.json and bench_cuda.txt")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the workers are killed")
    p.add_argument("--backend", default="inductor", help="the inner compiler of every mode")
    p.add_argument("--simulate-on-cpu", action="store_true",
                   help="run the same processes on CPU with gloo (memory reads 0): checks the tool without a GPU")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one mode, in its own process --------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> tuple[Any, Callable[[], tuple[Any, ...]], Callable[..., Any]]:
    """(model on the GPU, a batch, loss(model, batch)), from seed 0."""
    import torch

    torch.manual_seed(0)
    device = torch.device("cpu" if args.simulate_on_cpu else "cuda")
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50304, n_positions=args.seq,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(device)
        ids = torch.randint(0, 50304, (args.batch, args.seq), device=device)

        def loss(m: Any, batch: tuple[Any, ...]) -> Any:
            return m(batch[0], labels=batch[0]).loss

        return model, lambda: (ids,), loss
    from graphddp.models import CNN

    model = CNN().to(device)
    x = torch.randn(args.batch * 32, 3, 16, 16, device=device)
    y = torch.randint(0, 10, (args.batch * 32,), device=device)
    return model, lambda: (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def wrap(mode: str, model: Any, backend: str, cuda: bool) -> tuple[Any, Any]:
    """(the module a step calls, the optimizer the loop steps)."""
    import torch

    import graphddp

    if mode in ("compile", "ddp_compiled", "graphddp", "graphddp_cap25"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
        if mode == "compile":
            return torch.compile(model, backend=backend), opt
        if mode == "ddp_compiled":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(torch.compile(model, backend=backend), device_ids=[0] if cuda else None, bucket_cap_mb=25), opt
        caps = {"bucket_cap_mb": 25} if mode == "graphddp_cap25" else {}
        return graphddp.compile(model, backend=backend, **caps), opt
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    sharding = {"graphddp_optim": {}, "graphddp_sharded": {"sharding": "optimizer"},
                "graphddp_sharded_fwd": {"sharding": "optimizer", "gather": "forward"},
                "graphddp_full": {"sharding": "full"},
                "graphddp_full_keep": {"sharding": "full", "reshard_after_forward": False}}[mode]
    return graphddp.compile(model, backend=backend, optimizer=opt, **sharding), opt


def inductor_settings(pairs: list[str]) -> dict[str, Any]:
    """``--inductor-config`` as {name: value}; a name inductor's config lacks, or a value that is
    no Python literal, is an error naming it (before any process starts)."""
    import ast

    from torch._inductor import config

    settings = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not hasattr(config, name.strip()):
            raise SystemExit(f"python -m tools.bench --device cuda: --inductor-config {pair!r}: "
                             "expected NAME=VALUE with NAME in torch._inductor.config")
        try:
            settings[name.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"python -m tools.bench --device cuda: --inductor-config {pair!r}: "
                             f"{text!r} is not a Python literal") from None
    return settings


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(path)
        time.sleep(0.0005)


class _Gpu:
    """The device calls a worker makes, reading 0 when ``--simulate-on-cpu`` runs it on CPU."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda, self.torch = cuda, torch

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def name(self) -> str:
        return self.torch.cuda.get_device_name(0) if self.cuda else "cpu (simulated)"

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0

    def requested(self, stat: str) -> int:
        """The bytes the process's tensors asked for (``requested_bytes.all.current`` or
        ``.peak``): ``allocated`` without the allocator's rounding. A large block whose
        remainder is at most 1 MB is not split, so which blocks carry such a tail depends on the
        order of allocations: the same tensors measured 1003.8 and 1005.5 MB allocated in two
        modes (H100)."""
        return self.torch.cuda.memory_stats().get(f"requested_bytes.all.{stat}", 0) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    mode, sync, cuda = args.worker, args.sync_dir, not args.simulate_on_cpu
    gpu = _Gpu(cuda)
    if cuda:
        torch.cuda.set_device(0)
    if args.padding == "off":
        torch._inductor.config.comprehensive_padding = False
    for name, value in inductor_settings(args.inductor_config).items():
        setattr(torch._inductor.config, name, value)
    if args.memory_sites and cuda:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    store = dist.FileStore(os.path.join(sync, f"store-{mode}"), 1)
    if cuda:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, batch, loss_fn = build_model(args)
    t0 = time.perf_counter()
    module, opt = wrap(mode, model, args.backend, cuda)

    def step() -> None:
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16):
            loss = loss_fn(module, batch())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    gpu.synchronize()
    result: dict[str, Any] = {"mode": mode, "first_step_s": time.perf_counter() - t0, "torch": torch.__version__,
                              "gpu": gpu.name(), "params": sum(p.numel() for p in model.parameters())}
    for _ in range(args.warmup):
        step()
    gpu.synchronize()
    result["between_mb"] = gpu.allocated() / MB
    result["between_requested_mb"] = gpu.requested("current") / MB
    sites = args.memory_sites and cuda
    if sites:
        from tools.bench import memsites

        before = torch.cuda.memory._snapshot()
        n0 = len(before["device_traces"][0])
        live = memsites.live_blocks(before)
        result["between_sites"] = memsites.summarize(live)
    gpu.reset_peak()
    step()
    gpu.synchronize()
    result["step_peak_mb"] = gpu.peak() / MB
    result["step_peak_requested_mb"] = gpu.requested("peak") / MB
    result["between_after_mb"] = gpu.allocated() / MB
    if sites:
        after = torch.cuda.memory._snapshot()
        trace = after["device_traces"][0]
        if len(trace) >= 1_000_000:
            result["peak_sites_note"] = "the allocator's trace wrapped: the peak's sites are incomplete"
        peak_mb, rows = memsites.peak_sites(live, trace[n0:])
        result["peak_sites_mb"], result["peak_sites"] = peak_mb, rows
        torch.cuda.memory._record_memory_history(None)
    open(os.path.join(sync, f"ready-{mode}"), "w").close()
    gpu.reset_peak()
    times = []
    for r in range(args.rounds):
        _wait_for(os.path.join(sync, f"go-{r}-{mode}"), args.timeout)
        gpu.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        gpu.synchronize()
        times.append((time.perf_counter() - t) * 1e3 / args.steps)
        open(os.path.join(sync, f"done-{r}-{mode}"), "w").close()
    if args.profile_steps:  # in turn, as the timed rounds: each mode alone on the GPU
        from tools.bench import gpu_profile

        _wait_for(os.path.join(sync, f"go-profile-{mode}"), args.timeout)
        try:  # a trace that cannot be taken or read loses the profile, not the mode's other figures
            result["profile"] = gpu_profile.profile_steps(step, args.profile_steps, args.out, mode, cuda)
        except Exception as e:  # noqa: BLE001 - reported in the mode's row
            result["profile_error"] = f"{type(e).__name__}: {e}"
        open(os.path.join(sync, f"done-profile-{mode}"), "w").close()
    result["round_ms"] = times
    result["step_ms"] = statistics.median(times)
    result["timed_peak_mb"] = gpu.peak() / MB
    result["timed_peak_requested_mb"] = gpu.requested("peak") / MB
    dist.destroy_process_group()
    return result


# -- the parent: start the modes, let them take turns, report ------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"python -m tools.bench --device cuda: unknown modes {unknown}; choose from {MODES}")
    try:
        import torch
    except ImportError:
        raise SystemExit("python -m tools.bench --device cuda: torch is not installed") from None
    inductor_settings(args.inductor_config)  # refused here, not in every process
    if not torch.cuda.is_available() and not args.simulate_on_cpu:
        print("[bench] --device cuda: CUDA is not available on this machine; nothing was run", flush=True)
        return 2
    os.makedirs(args.out, exist_ok=True)
    sync = tempfile.mkdtemp(prefix="graphddp-bench-cuda-")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "4")}
    procs = {}
    for mode in modes:
        log = open(os.path.join(sync, f"{mode}.log"), "w")  # copied to --out if the mode fails
        cmd = [sys.executable, "-m", "tools.bench.cuda", *argv, "--worker", mode, "--sync-dir", sync]
        procs[mode] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"[bench] {len(modes)} modes started, one process each: {', '.join(modes)}", flush=True)
    deadline = time.time() + args.timeout

    def alive(mode: str) -> bool:
        return procs[mode].poll() is None

    def wait_file(name: str, mode: str) -> bool:
        while not os.path.exists(os.path.join(sync, name)):
            if not alive(mode) or time.time() > deadline:
                return False
            time.sleep(0.002)
        return True

    ready = [m for m in modes if wait_file(f"ready-{m}", m)]
    for r in range(args.rounds):
        order = ready[r % len(ready):] + ready[:r % len(ready)] if ready else []
        for mode in order:
            open(os.path.join(sync, f"go-{r}-{mode}"), "w").close()
            if not wait_file(f"done-{r}-{mode}", mode):
                ready = [m for m in ready if m != mode]
    if args.profile_steps:
        for mode in list(ready):
            open(os.path.join(sync, f"go-profile-{mode}"), "w").close()
            if not wait_file(f"done-profile-{mode}", mode):
                ready = [m for m in ready if m != mode]
    results = {}
    for mode in modes:
        try:
            procs[mode].wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            procs[mode].kill()
        path = os.path.join(sync, f"result-{mode}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[mode] = json.load(f)
        else:
            with open(os.path.join(sync, f"{mode}.log")) as f:
                tail = f.read()
            with open(os.path.join(args.out, f"cuda-{mode}.log"), "w") as f:
                f.write(tail)
            tail = tail[-3000:]
            results[mode] = {"mode": mode, "error": tail}
    table = render(results, args)
    print(table, flush=True)
    with open(os.path.join(args.out, "bench_cuda.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "sync_dir")}, "modes": results}, f, indent=2)
    with open(os.path.join(args.out, "bench_cuda.txt"), "w") as f:
        f.write(table + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    from tools.bench import memsites

    first = next((r for r in results.values() if "gpu" in r), {})
    shape = f"{args.layers} layers, batch {args.batch} x {args.seq}" if args.model == "gpt2" else f"batch {args.batch * 32}"
    settings = "".join(f"; inductor {pair}" for pair in args.inductor_config)
    lines = [f"{args.model} ({shape}), bf16 autocast, {args.backend}, AdamW; "
             f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, NCCL at world size 1; "
             f"{args.rounds} rounds x {args.steps} steps{settings}", "",
             "| mode | step ms | between steps MB | step peak MB | peak over timed steps MB | first step s |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | failed | | | | |")
            continue
        lines.append(f"| {mode} | {r['step_ms']:.2f} | {r['between_mb']:.0f} | {r['step_peak_mb']:.0f} | "
                     f"{r['timed_peak_mb']:.0f} | {r['first_step_s']:.1f} |")
    for mode, r in results.items():
        if "error" in r:
            lines += ["", f"{mode} failed:", r["error"]]
        if "profile" in r:
            from tools.bench import gpu_profile

            lines += ["", gpu_profile.render(mode, r["profile"])]
        if "profile_error" in r:
            lines += ["", f"{mode}: no profile ({r['profile_error']})"]
        if "between_sites" in r:
            lines += ["", memsites.render(f"{mode}: between steps, {r['between_mb']:.0f} MB", r["between_sites"])]
            lines += [memsites.render(f"{mode}: at the step's peak, {r['peak_sites_mb']:.0f} MB", r["peak_sites"])]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker is None:
        return run(args, [a for a in argv])
    result = worker(args)
    with open(os.path.join(args.sync_dir, f"result-{args.worker}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
