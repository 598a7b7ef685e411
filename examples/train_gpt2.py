"""Train a small Hugging Face GPT-2 on real text with graphddp: the script a user would write.

``graphddp.compile(model)`` stands where ``DDP(torch.compile(model))`` would, in an ordinary
data-parallel training run: AdamW with warm-up and cosine decay, gradient clipping, gradient
accumulation with ``model.no_sync()`` (``--grad-accum``), a progress bar, periodic checkpoints
(the compiled module's ``state_dict()`` has the plain model's keys) and ``--resume``. With
``--compare-ddp`` it then trains the same model from the same state on the same data with
``torch.nn.parallel.DistributedDataParallel`` and prints both loss curves side by side: they
should lie on top of each other, which is the point of graphddp.

The model is GPT-2 built from a config (nothing is downloaded) over bytes: the vocabulary is the
256 byte values of the UTF-8 text, so no tokenizer is needed. The text is the World English
Bible's Genesis and Exodus (examples/data/, public domain). Step ``s`` draws
``world_size * grad_accum * batch_size`` random windows from a generator seeded with
``(seed, s)`` and each rank takes its own shard, so the data depend on the step alone: a resumed
run, and the DDP run, see exactly what an uninterrupted graphddp run sees.

The same file runs on CPU (gloo) and GPUs (NCCL, one process per GPU)::

    torchrun --nproc-per-node 2 examples/train_gpt2.py
    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        examples/train_gpt2.py --batch-size 64 --block-size 256
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import graphddp

TEXT = Path(__file__).resolve().parent / "data" / "web_genesis_exodus.txt"
MODEL_ARGS = ("block_size", "n_layer", "n_embd", "n_head")  # a checkpoint fits only the same shape

History = list[tuple[int, float]]  # (step, loss averaged over ranks and micro-batches)


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


@dataclass
class Run:
    label: str
    history: History
    tokens_per_s: float
    seconds: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train to (a resumed run counts from 0 too)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step; all but the last under no_sync()")
    p.add_argument("--block-size", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up before cosine decay to lr/10")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="graphddp's inner compiler")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="bucket cap for graphddp and DDP (default: DDP's)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("out/train_gpt2/checkpoints"))
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (and one at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints to keep")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from a checkpoint file, or from the newest in --checkpoint-dir")
    p.add_argument("--compare-ddp", action="store_true", help="then train the same steps with DDP and compare")
    p.add_argument("--plot", type=lambda s: Path(s) if s else None, default=Path("out/train_gpt2/loss.png"),
                   help="loss-curve PNG (needs matplotlib); '' for none")
    p.add_argument("--summary", type=Path, default=None, help="write losses and throughput as JSON")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines (and compared rows)")
    return p.parse_args(argv)


# -- setup ---------------------------------------------------------------------------------------
def init_distributed() -> Env:
    """Join the job torchrun started: NCCL with one GPU per process, else gloo on CPU."""
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc-per-node 2 examples/train_gpt2.py")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo")
    return Env(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown() -> None:
    """Leave together, then destroy the group once nothing holds it.

    Dynamo's caches keep compiled modules, and so the process group, alive; dropping them first
    lets the group die inside ``destroy_process_group`` instead of at interpreter exit.
    """
    dist.barrier()
    torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=256, n_positions=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: runs are comparable step by step
        use_cache=False,
    )
    return GPT2LMHeadModel(config).to(device)


# -- data ----------------------------------------------------------------------------------------
def load_tokens(path: Path = TEXT) -> torch.Tensor:
    """The text's UTF-8 bytes: byte-level tokens, vocabulary 256."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def batch(tokens: torch.Tensor, args: argparse.Namespace, env: Env, step: int, micro: int) -> torch.Tensor:
    """This rank's shard of step ``step``'s random windows, for micro-step ``micro``."""
    per_rank = args.grad_accum * args.batch_size
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - args.block_size, (env.world_size * per_rank,), generator=gen)
    first = env.rank * per_rank + micro * args.batch_size
    rows = [tokens[s:s + args.block_size] for s in starts[first:first + args.batch_size].tolist()]
    return torch.stack(rows).long().to(env.device, non_blocking=True)


# -- training ------------------------------------------------------------------------------------
def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, args: argparse.Namespace,
               env: Env, step: int) -> float:
    """One optimizer step; returns its loss averaged over ranks and micro-steps.

    All micro-steps but the last run under ``no_sync()`` and only accumulate locally; the last
    backward averages everything accumulated across ranks (graphddp inside its compiled backward
    graph, DDP in its hooks), so the gradient is that of the mean loss over the global batch.
    """
    for group in opt.param_groups:
        group["lr"] = learning_rate(step, args)
    total = torch.zeros((), device=env.device)
    for micro in range(args.grad_accum):
        x = batch(tokens, args, env, step, micro)
        last = micro == args.grad_accum - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = model(input_ids=x, labels=x).loss / args.grad_accum
            loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return total.item() / env.world_size


class Progress:
    """Rank 0's progress on stderr: a bar redrawn every step on a terminal, else a line every ``every`` steps.

    Throughput and ETA come from the last 20 steps, not counting the run's first step, which
    compiles.
    """

    def __init__(self, label: str, start: int, total: int, tokens_per_step: int, every: int, enabled: bool) -> None:
        self.label, self.total, self.tokens_per_step, self.every, self.enabled = label, total, tokens_per_step, every, enabled
        self.tty = sys.stderr.isatty()
        self.first = start + 1
        self.durations: deque[float] = deque(maxlen=20)
        self.last = time.perf_counter()
        if enabled and start < total:
            self._write(f"{label}: from step {start} to {total} ...", end="\n")

    def update(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if step > self.first:
            self.durations.append(now - self.last)
        self.last = now
        logged = step % self.every == 0 or step == self.total
        if not self.enabled or not (self.tty or logged):
            return
        line = f"{self.label:9s} {self._bar(step)} {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}"
        if self.durations:
            per_step = sum(self.durations) / len(self.durations)
            eta = round(per_step * (self.total - step))
            line += f"  {self.tokens_per_step / per_step / 1e3:7.1f}k tok/s  ETA {eta // 60}:{eta % 60:02d}"
        self._write(line, end="\n" if logged else "\r")

    def _bar(self, step: int, width: int = 24) -> str:
        filled = width * step // self.total
        return "[" + "#" * filled + "." * (width - filled) + "]"

    def _write(self, line: str, end: str) -> None:
        sys.stderr.write(("\r\x1b[K" if self.tty else "") + line + end)
        sys.stderr.flush()


def train(label: str, model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, args: argparse.Namespace,
          env: Env, start: int, history: History,
          after_step: Callable[[int], None] = lambda step: None) -> Run:
    """Train steps ``start`` to ``args.steps``; ``after_step(done)`` runs after each optimizer step."""
    tokens_per_step = env.world_size * args.grad_accum * args.batch_size * args.block_size
    progress = Progress(label, start, args.steps, tokens_per_step, args.log_every, env.rank == 0)
    timed_from = None
    for step in range(start, args.steps):
        loss = train_step(model, opt, tokens, args, env, step)
        history.append((step + 1, loss))
        progress.update(step + 1, loss)
        after_step(step + 1)
        if timed_from is None:  # the first step compiles: time the rest
            timed_from = (time.perf_counter(), step + 1)
    if timed_from is None or timed_from[1] == args.steps:
        return Run(label, history, float("nan"), 0.0)
    seconds = time.perf_counter() - timed_from[0]
    return Run(label, history, tokens_per_step * (args.steps - timed_from[1]) / seconds, seconds)


# -- checkpoints ---------------------------------------------------------------------------------
def save_checkpoint(directory: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``step_NNNNNN.pt`` atomically (a crash leaves the previous checkpoints whole), keep the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{state['step']:06d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(directory.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_checkpoint(args: argparse.Namespace, env: Env) -> dict[str, Any] | None:
    """Rank 0 reads the checkpoint ``--resume`` names and sends it to every rank (no shared filesystem needed)."""
    box: list[Any] = [None]
    if env.rank == 0 and args.resume is not None:
        path = Path(args.resume)
        if args.resume == "latest":
            found = sorted(args.checkpoint_dir.glob("step_*.pt"))
            path = found[-1] if found else None
        if path is None:
            print(f"--resume: no checkpoint in {args.checkpoint_dir}, starting at step 0", file=sys.stderr)
        else:
            box[0] = torch.load(path, map_location="cpu", weights_only=True)
            print(f"resuming from {path} (step {box[0]['step']})", file=sys.stderr)
    dist.broadcast_object_list(box, src=0)
    ckpt = box[0]
    if ckpt is not None:
        wrong = [k for k in MODEL_ARGS if ckpt["args"][k] != getattr(args, k)]
        if wrong:
            raise SystemExit(f"--resume: the checkpoint's {', '.join(wrong)} differ from this run's; pass the same values")
    return ckpt


# -- the two runs --------------------------------------------------------------------------------
def prepare(args: argparse.Namespace, env: Env, ckpt: dict[str, Any] | None,
            wrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer, int, History]:
    """A fresh model from ``--seed`` or ``ckpt``, wrapped for data parallelism, and its optimizer."""
    model = build_model(args, env.device)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if ckpt is None:
        return model, opt, 0, []
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt, ckpt["step"], [tuple(h) for h in ckpt["history"]]


def run_graphddp(args: argparse.Namespace, env: Env, tokens: torch.Tensor, ckpt: dict[str, Any] | None) -> tuple[Run, int]:
    """Train with graphddp, checkpointing on rank 0; returns the run and its number of backward graphs."""
    model, opt, start, history = prepare(
        args, env, ckpt, lambda m: graphddp.compile(m, backend=args.backend, bucket_cap_mb=args.bucket_cap_mb))

    def after_step(done: int) -> None:
        if done == start + 1 and env.rank == 0:  # the plans exist once the first backward has run
            planned = [s for s in model.schedules if s.buckets]
            print(f"graphddp compiled {len(model.schedules)} backward graph(s), {len(planned)} with gradients; "
                  "the all-reduce plan:")
            for schedule in planned:
                print(schedule.to_table(), end="\n\n", flush=True)
        if env.rank == 0 and (done % args.checkpoint_every == 0 or done == args.steps):
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done,
                     "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "history": history}
            save_checkpoint(args.checkpoint_dir, state, args.keep_checkpoints)

    run = train("graphddp", model, opt, tokens, args, env, start, history, after_step)
    return run, len(model.schedules)


def run_ddp(args: argparse.Namespace, env: Env, tokens: torch.Tensor, ckpt: dict[str, Any] | None) -> Run:
    """The same steps, from the same state, on the same data, with eager DDP."""
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    model, opt, start, _ = prepare(
        args, env, ckpt, lambda m: DistributedDataParallel(m, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb))
    return train("DDP", model, opt, tokens, args, env, start, [])  # its curve: this run's steps only


# -- reporting -----------------------------------------------------------------------------------
def compare(ours: Run, ddp: Run, every: int) -> tuple[float, float]:
    """Print both loss curves side by side; returns the largest absolute and relative difference."""
    theirs = dict(ddp.history)
    rows = [(s, loss, theirs[s]) for s, loss in ours.history if s in theirs]
    print(f"\n{'step':>6} {'graphddp':>10} {'DDP':>10} {'|diff|':>9}")
    for s, a, b in rows:
        if s % every == 0 or s == rows[-1][0]:
            print(f"{s:>6} {a:>10.5f} {b:>10.5f} {abs(a - b):>9.2e}")
    max_abs = max((abs(a - b) for _, a, b in rows), default=0.0)
    max_rel = max((abs(a - b) / abs(b) for _, a, b in rows), default=0.0)
    print(f"largest |graphddp - DDP| over {len(rows)} steps: {max_abs:.2e} (relative {max_rel:.2e}); "
          f"throughput graphddp {ours.tokens_per_s / 1e3:.1f}k tok/s, DDP {ddp.tokens_per_s / 1e3:.1f}k tok/s")
    return max_abs, max_rel


def plot(path: Path, runs: list[Run], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install -e '.[examples]'); no {path}", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, style in zip(runs, [dict(lw=1.6), dict(lw=1.2, ls="--")]):
        steps, losses = zip(*run.history)
        ax.plot(steps, losses, label=run.label, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"loss curve: {path}")


def report(args: argparse.Namespace, env: Env, n_tokens: int, ours: Run, graphs: int, ddp: Run | None, start: int) -> None:
    summary: dict[str, Any] = {
        "world_size": env.world_size, "device": env.device.type, "backend": args.backend, "start_step": start,
        "steps": args.steps, "tokens_per_step": env.world_size * args.grad_accum * args.batch_size * args.block_size,
        "backward_graphs": graphs,
        "graphddp": {"loss": ours.history, "tokens_per_s": ours.tokens_per_s, "seconds": ours.seconds},
    }
    if ours.history:
        print(f"graphddp: step {ours.history[-1][0]}, loss {ours.history[-1][1]:.4f}, "
              f"{ours.tokens_per_s / 1e3:.1f}k tok/s after the first step")
    if ddp is not None:
        max_abs, max_rel = compare(ours, ddp, args.log_every)
        summary["ddp"] = {"loss": ddp.history, "tokens_per_s": ddp.tokens_per_s, "seconds": ddp.seconds}
        summary["max_abs_diff"], summary["max_rel_diff"] = max_abs, max_rel
    if args.plot and ours.history:
        title = (f"GPT-2 ({args.n_layer} layers, {args.n_embd} wide, byte-level) on {n_tokens / 1e3:.0f} KB of text, "
                 f"{env.world_size} {env.device.type} ranks, graphddp ({args.backend})")
        plot(args.plot, [ours] + ([ddp] if ddp else []), title)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = init_distributed()
    tokens = load_tokens()
    ckpt = load_checkpoint(args, env)
    ours, graphs = run_graphddp(args, env, tokens, ckpt)
    ddp = run_ddp(args, env, tokens, ckpt) if args.compare_ddp else None
    if env.rank == 0:
        report(args, env, len(tokens), ours, graphs, ddp, 0 if ckpt is None else ckpt["step"])
    shutdown()


if __name__ == "__main__":
    main()
