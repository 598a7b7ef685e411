"""nanoGPT's training loop (karpathy/nanoGPT ``train.py``, the most copied DDP + torch.compile
loop), written for this project, with the one line users change: the wrapper.

    python examples/nanogpt_loop.py                       # 2 CPU ranks: DDP(torch.compile) and graphddp side by side
    python examples/nanogpt_loop.py --optimizer-inside    # graphddp.compile(model, optimizer=..., max_grad_norm=...)
    python examples/nanogpt_loop.py --sharding optimizer --gather forward
                                                          # ... sharding="optimizer" (ZeRO-2), all-gathers in the next forward
    python examples/nanogpt_loop.py --sharding full       # ... sharding="full": parameters, gradients, state 1/N per rank
    torchrun --nproc-per-node 2 examples/nanogpt_loop.py  # the same, launched by hand

What it keeps of nanoGPT's loop, because each is something a drop-in must survive:

* batches sampled with ``torch.randint`` from torch's global generator (``get_batch``);
* gradient accumulation over micro-steps with ``model.require_backward_grad_sync =
  (micro_step == gradient_accumulation_steps - 1)`` instead of ``no_sync()``;
* ``scaler = torch.amp.GradScaler(enabled=(dtype == "float16"))``, ``scaler.unscale_`` and
  ``torch.nn.utils.clip_grad_norm_`` before ``scaler.step``; a cosine LR with warm-up written into
  ``param_groups``; AdamW with a decayed and a non-decayed param group;
* ``estimate_loss`` on rank 0 only, under ``torch.no_grad()`` and ``model.eval()``;
* a checkpoint of ``raw_model.state_dict()`` and ``optimizer.state_dict()``, and a resume.

With ``--sharding optimizer`` or ``full`` (the optimizer inside, as both modes need, clipping
by the global norm as nanoGPT does) the checkpoint is written as those modes need it: every rank gathers the whole optimizer state
(``graphddp.full_optimizer_state_dict``) and, with ``full``, the whole parameters
(``model.state_dict()``), then rank 0 saves; and with ``full`` every rank evaluates (each
forward gathers from every rank; a forward on rank 0 alone is an error), the other ranks on a
copy of their generator, so their training batches stay nanoGPT's.

``--compare`` (the default) trains both wrappers in each rank, one iteration each in turn, each
with its own copy of the global generator's state (as two separate runs would have), and
prints both losses per iteration and both medians of ms per iteration: the loss-for-loss
check of the test suite (``tests/ranks/test_nanogpt_loop.py``) and the per-iteration cost of
issue 37. ``--wrapper`` trains one of them alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

# -- the model: nanoGPT's GPT, small ------------------------------------------------------------------


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's: PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = LayerNorm(cfg.n_embd, cfg.bias), CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout), h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {}))


# -- the loop -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--wrapper", choices=("compare", "ddp", "graphddp"), default="compare")
    p.add_argument("--sharding", choices=("none", "optimizer", "full"), default="none",
                   help="graphddp's sharding= (implies --optimizer-inside)")
    p.add_argument("--gather", choices=("backward", "forward"), default="backward",
                   help="with --sharding optimizer, graphddp's gather=: 'forward' hides the all-gathers, which clipping "
                        "leaves after the backward, behind the next forward")
    p.add_argument("--optimizer-inside", action="store_true",
                   help="graphddp.compile(model, optimizer=..., max_grad_norm=grad_clip): AdamW and clipping in the backward")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend for both wrappers")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--max-iters", type=int, default=12)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4, help="per rank")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lr-decay-iters", type=int, default=100, help="the cosine's length (nanoGPT's lr_decay_iters)")
    p.add_argument("--checkpoint-dir", default="", help="save at every evaluation, and resume from there if a checkpoint exists")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


@dataclasses.dataclass
class Trainer:
    """One wrapper's run: its model, optimizer, scaler, and its own copy of the global RNG state."""

    name: str
    model: nn.Module
    raw_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    clip_in_graph: bool
    rng: torch.Tensor
    iter_num: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    eval_losses: list[float] = dataclasses.field(default_factory=list)
    ms: list[float] = dataclasses.field(default_factory=list)


def get_lr(it: int, args: argparse.Namespace) -> float:
    warmup, decay_iters, min_lr = 2, args.lr_decay_iters, args.learning_rate / 10
    if it < warmup:
        return args.learning_rate * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, decay_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - min_lr)


def make_trainer(name: str, args: argparse.Namespace, device: torch.device, data: torch.Tensor) -> Trainer:
    import graphddp

    raw = GPT(GPTConfig()).to(device)  # from the caller's seed: ranks start apart, as in nanoGPT; the wrap makes them equal
    optimizer = raw.configure_optimizers(0.1, args.learning_rate, (0.9, 0.95), device.type)
    clip_in_graph = False
    if name == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(torch.compile(raw, backend=args.backend))
    elif args.optimizer_inside or args.sharding != "none":
        sharding = {} if args.sharding == "none" else {"sharding": args.sharding}
        if args.sharding == "optimizer":
            sharding["gather"] = args.gather
        clip = args.grad_clip or None  # nanoGPT: grad_clip 0 means no clipping
        model = graphddp.compile(raw, backend=args.backend, optimizer=optimizer, max_grad_norm=clip, **sharding)
        clip_in_graph = True
    else:
        model = graphddp.compile(raw, backend=args.backend)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "float16")
    # The generator as the wrap left it: a wrapper that drew from it would change every batch after.
    trainer = Trainer(name, model, raw, optimizer, scaler, clip_in_graph, torch.get_rng_state())
    if args.checkpoint_dir:
        resume(trainer, args, device)
    return trainer


def _checkpoint_path(trainer: Trainer, args: argparse.Namespace, what: str = "") -> str:
    return os.path.join(args.checkpoint_dir, f"ckpt-{trainer.name}{what}.pt")


def save(trainer: Trainer, args: argparse.Namespace) -> None:
    """nanoGPT's checkpoint (rank 0: the raw model's and the optimizer's state dicts), and each
    rank's generator state beside it (not nanoGPT's: it makes a resume continue loss for loss)."""
    rank = dist.get_rank()
    model_state, optimizer_state = _state_dicts(trainer, args)  # sharded: every rank gathers
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state, "iter_num": trainer.iter_num}, _checkpoint_path(trainer, args))
    torch.save(torch.get_rng_state(), _checkpoint_path(trainer, args, f"-rng{rank}"))
    dist.barrier()


def _sharded(trainer: Trainer, args: argparse.Namespace) -> str:
    return args.sharding if trainer.name == "graphddp" else "none"


def _state_dicts(trainer: Trainer, args: argparse.Namespace) -> tuple[dict, dict]:
    """nanoGPT's checkpoint: the raw model's and the optimizer's state dicts, whole. A sharded
    optimizer holds this rank's parts, and ``sharding="full"``'s raw model too: there every rank
    gathers the whole state (graphddp's calls), and rank 0 saves it."""
    import graphddp

    sharding = _sharded(trainer, args)
    if sharding == "none":
        return trainer.raw_model.state_dict(), trainer.optimizer.state_dict()
    model = trainer.model.state_dict() if sharding == "full" else trainer.raw_model.state_dict()
    return model, graphddp.full_optimizer_state_dict(trainer.model)


def resume(trainer: Trainer, args: argparse.Namespace, device: torch.device) -> None:
    path = _checkpoint_path(trainer, args)
    if not os.path.exists(path):
        return
    ckpt = torch.load(path, map_location=device, weights_only=False)
    sharding = _sharded(trainer, args)
    (trainer.model if sharding == "full" else trainer.raw_model).load_state_dict(ckpt["model"])
    if sharding == "none":
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
    else:
        import graphddp

        graphddp.load_full_optimizer_state_dict(trainer.model, ckpt["optimizer"])
    trainer.iter_num = ckpt["iter_num"]
    trainer.rng = torch.load(_checkpoint_path(trainer, args, f"-rng{dist.get_rank()}"))


def get_batch(data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - GPTConfig.block_size, (args.batch_size,))  # the global generator, as nanoGPT
    x = torch.stack([data[i:i + GPTConfig.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + GPTConfig.block_size] for i in ix])
    return x.to(device), y.to(device)


@torch.no_grad()
def estimate_loss(trainer: Trainer, data: torch.Tensor, args: argparse.Namespace, device: torch.device, ctx: Any) -> float:
    trainer.model.eval()
    losses = []
    for _ in range(args.eval_iters):
        x, y = get_batch(data, args, device)
        with ctx:
            _, loss = trainer.model(x, y)
        losses.append(loss.item())
    trainer.model.train()
    return sum(losses) / len(losses)


def train_iteration(trainer: Trainer, data: torch.Tensor, args: argparse.Namespace, device: torch.device, ctx: Any) -> None:
    """One of nanoGPT's iterations (its loop body), on this trainer's own RNG state."""
    torch.set_rng_state(trainer.rng)
    model, optimizer, scaler = trainer.model, trainer.optimizer, trainer.scaler
    lr = get_lr(trainer.iter_num, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if trainer.iter_num % args.eval_interval == 0 and trainer.iter_num > 0:
        if args.checkpoint_dir:  # before the evaluation draws: a resume evaluates again, alike
            save(trainer, args)
        if dist.get_rank() == 0:  # nanoGPT evaluates on the master process only
            trainer.eval_losses.append(estimate_loss(trainer, data, args, device, ctx))
        elif _sharded(trainer, args) == "full":  # every forward gathers from every rank: all evaluate
            with torch.random.fork_rng():  # on a copy: this rank's training batches stay nanoGPT's
                estimate_loss(trainer, data, args, device, ctx)
    start = time.perf_counter()
    x, y = get_batch(data, args, device)
    steps = args.gradient_accumulation_steps
    for micro_step in range(steps):
        model.require_backward_grad_sync = micro_step == steps - 1
        with ctx:
            _, loss = model(x, y)
            loss = loss / steps
        x, y = get_batch(data, args, device)
        scaler.scale(loss).backward()
    if args.grad_clip != 0.0 and not trainer.clip_in_graph:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    trainer.ms.append((time.perf_counter() - start) * 1e3)
    trainer.losses.append(loss.item() * steps)
    trainer.iter_num += 1
    trainer.rng = torch.get_rng_state()


def run(args: argparse.Namespace) -> dict[str, Trainer]:
    """Every rank: the trainers of ``--wrapper``, one iteration each in turn; their records."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if args.dtype == "float32" else torch.autocast(device.type, dtype=ptdtype)
    data = torch.randint(0, GPTConfig.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))  # the "dataset"
    names = ("ddp", "graphddp") if args.wrapper == "compare" else (args.wrapper,)
    torch.manual_seed(args.seed + rank)  # nanoGPT: seed_offset = ddp_rank, before the model is built
    base = torch.get_rng_state()
    trainers = {}
    for name in names:
        torch.set_rng_state(base)
        trainers[name] = make_trainer(name, args, device, data)
    while min(t.iter_num for t in trainers.values()) < args.max_iters:
        for t in trainers.values():
            train_iteration(t, data, args, device, ctx)
    return trainers


def report(trainers: dict[str, Trainer]) -> str:
    lines = []
    names = list(trainers)
    for i in range(len(trainers[names[0]].losses)):
        lines.append(f"iter {i}: " + "  ".join(f"{n} loss {trainers[n].losses[i]:.6f}" for n in names))
    for n in names:
        t = trainers[n]
        tail = t.ms[2:] or t.ms  # past the compiles
        lines.append(f"{n}: median {statistics.median(tail):.1f} ms/iter over {len(tail)} iterations; eval losses {[round(v, 6) for v in t.eval_losses]}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # relaunch under torchrun with --nproc ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--standalone",
               __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    trainers = run(args)
    if dist.get_rank() == 0:
        print(report(trainers), flush=True)
    dist.barrier()
    from graphddp.testing import release_process_group

    release_process_group()


if __name__ == "__main__":
    main()
