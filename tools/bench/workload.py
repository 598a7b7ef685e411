"""What every mode trains: the model, the per-rank batch, the loss, and the run's constants."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphddp.config import DDPConfig

MB = 1024 * 1024
# Issue 12's sweep: the caps (MB) graphddp and eager DDP are both run at (graphddp_cap{c},
# ddp_cap{c}); ddp_best is the fastest of the ddp_cap modes that ran.
SWEEP_CAPS = (1, 2, 4, 8, 25)
DDP_CAPS = SWEEP_CAPS
GRAPHDDP_CAP_MODES = tuple(f"graphddp_cap{c}" for c in SWEEP_CAPS)
DDP_CAP_MODES = tuple(f"ddp_cap{c}" for c in DDP_CAPS)
MODES = (
    "compute_only", "compute_eager", "comm_only", "ideal_overlap", "no_overlap", "ddp_default", "ddp_same_buckets",
    *DDP_CAP_MODES, "ddp_compiled", "ddp_compiled_samecap", "ddp_compiled_autograd",
    "graphddp_tail_off", "graphddp", "graphddp_optim", "graphddp_optim_clip", "graphddp_clip", "graphddp_auto", *GRAPHDDP_CAP_MODES,
    "graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial", "graphddp_sharded", "graphddp_sharded_fwd", "ddp_zero", "fsdp2",
    "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "fsdp2_clip", "graphddp_full", "graphddp_full_keep", "fsdp2_reshard", "graphddp_full_bf16", "fsdp2_reshard_bf16",
)
# Issue 12: graphddp_auto (bucket_cap_mb="auto") against both sweeps at their best, and
# against DDP at its defaults; compute_only for the compute floor.
SWEEP_MODES = ("graphddp_auto", *GRAPHDDP_CAP_MODES, *DDP_CAP_MODES, "ddp_default", "compute_only")
# --modes shorthands: one name for several modes
# The optimizer state on a shard (tools/bench/sharded.py) next to graphddp replicated and eager DDP.
SHARDED_PRESET = ("graphddp_sharded", "graphddp_sharded_fwd", "graphddp_optim", "ddp_zero", "fsdp2", "ddp_cap1", "compute_only")
# Issue 37: clipping by global norm with the optimizer inside (max_grad_norm=) against the same
# step unclipped, and against clip_grad_norm_ + the optimizer after graphddp's backward.
CLIP_MODES = ("graphddp_optim_clip", "graphddp_clip")
CLIP_PRESET = (*CLIP_MODES, "graphddp_optim", "graphddp", "compute_only")
MAX_GRAD_NORM = 1.0  # nanoGPT's grad_clip; the clipped step does the same work whether or not it clips
# Full sharding (sharding="full", both reshard_after_forward placements) next to FSDP2 as users run it,
# FSDP2 keeping parameters to the backward, and sharding="optimizer".
FULL_MODES = ("graphddp_full", "graphddp_full_keep", "fsdp2_reshard")
FULL_PRESET = (*FULL_MODES, "fsdp2", "graphddp_sharded", "compute_only")
# ... with FSDP2's mixed precision (bf16 gathers, fp32 reductions), against the same without it
FULL_MP_MODES = ("graphddp_full_bf16", "fsdp2_reshard_bf16")
FULL_MP_PRESET = (*FULL_MP_MODES, "graphddp_full", "fsdp2_reshard")
# The sharded optimizer clipped by the global norm, next to itself unclipped, FSDP2 (ZeRO-2 shape)
# clipped and not, and the replicated optimizer clipped inside the backward
SHARDED_CLIP_PRESET = ("graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "graphddp_sharded", "fsdp2_clip", "fsdp2", "graphddp_optim_clip",
                       "compute_only")
MODE_PRESETS: dict[str, tuple[str, ...]] = {"ddp": ("ddp_default",), "sweep": SWEEP_MODES, "sharded": SHARDED_PRESET, "clip": CLIP_PRESET,
                                            "sharded_clip": SHARDED_CLIP_PRESET, "full": FULL_PRESET, "full_mp": FULL_MP_PRESET}
REPORTED = (  # rows of the table, in this order
    "graphddp", "graphddp_optim", "graphddp_optim_clip", "graphddp_clip", "graphddp_tail_off", "graphddp_auto", *GRAPHDDP_CAP_MODES, "compute_only",
    "compute_eager", "comm_only", "ideal_overlap", "no_overlap", "ddp_default", "ddp_same_buckets", "ddp_best",
    "best_swept", "ddp_compiled", "ddp_compiled_samecap", "ddp_compiled_autograd", *DDP_CAP_MODES,
    "graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial", "graphddp_sharded", "graphddp_sharded_fwd", "ddp_zero", "fsdp2",
    "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "fsdp2_clip", "graphddp_full", "graphddp_full_keep", "fsdp2_reshard", "graphddp_full_bf16", "fsdp2_reshard_bf16",
)
# Issue 13: PowerSGD, graphddp's in the graph against DDP's powerSGD_hook, with these settings
# (DDP's PowerSGDState keywords less process_group; the rank is --powersgd-rank). Both do a
# plain all-reduce for the first start_powerSGD_iter synchronising steps; the benchmark steps
# every PowerSGD mode past them (and past the compressed variant's compile) before timing.
POWERSGD_START_ITER = 2
POWERSGD_SETTINGS = {"start_powerSGD_iter": POWERSGD_START_ITER, "min_compression_rate": 2,
                     "use_error_feedback": True, "warm_start": True, "orthogonalization_epsilon": 0,
                     "random_seed": 0, "batch_tensors_with_same_shape": False}
POWERSGD_MODES = ("graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial")
# Modes that run only when named (or by a preset): make bench's default list keeps its length.
SHARDED_CLIP_MODES = ("graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "fsdp2_clip")
OPT_IN_MODES = (*POWERSGD_MODES, *CLIP_MODES, "graphddp_sharded", "graphddp_sharded_fwd", "ddp_zero", "fsdp2", *SHARDED_CLIP_MODES, *FULL_MODES, *FULL_MP_MODES, *GRAPHDDP_CAP_MODES, *(m for m in DDP_CAP_MODES if m not in ("ddp_cap1", "ddp_cap4", "ddp_cap25")))
DEFAULT_MODES = tuple(m for m in MODES if m not in OPT_IN_MODES)
# Rows of the bytes-on-the-wire table: each PowerSGD mode next to its uncompressed counterpart.
WIRE_ROWS = ("graphddp", "graphddp_powersgd", "ddp_default", "ddp_powersgd", "ddp_powersgd_serial")
TARGETS = (  # (label, numerator mode, denominator key in that mode's ratios, limit)
    ("graphddp / best eager DDP", "graphddp", "best_eager_ddp", 0.90),
    ("graphddp / ddp_compiled", "graphddp", "ddp_compiled", 0.80),
    ("graphddp / no_overlap", "graphddp", "no_overlap", 0.75),
    ("graphddp / release-time bound", "graphddp", "release_time_bound", 1.15),
    # Issue 11: the optimizer inside the backward, against what users run with the same AdamW.
    ("graphddp_optim / best eager DDP", "graphddp_optim", "best_eager_ddp", 0.90),
    ("graphddp_optim / ddp_compiled_autograd", "graphddp_optim", "ddp_compiled_autograd", 0.90),
    # Issue 12: the auto plan against the best of both cap sweeps (graphddp_cap*, ddp_cap*: the
    # fastest that ran, see summary's best_swept) and against eager DDP at its defaults.
    ("graphddp_auto / best swept", "graphddp_auto", "best_swept", 0.97),
    ("graphddp_auto / ddp_default", "graphddp_auto", "ddp_default", 0.90),
    # The optimizer state on a shard (--modes sharded): its math is 1/N, its bytes on the wire
    # an all-reduce's; against replicated graphddp and what users run instead.
    ("graphddp_sharded / graphddp_optim", "graphddp_sharded", "graphddp_optim", 0.97),
    ("graphddp_sharded / ddp_zero", "graphddp_sharded", "ddp_zero", 0.85),
    ("graphddp_sharded / fsdp2", "graphddp_sharded", "fsdp2", 0.85),
    # ... with each all-gather deferred into the next forward (gather="forward")
    ("graphddp_sharded_fwd / graphddp_optim", "graphddp_sharded_fwd", "graphddp_optim", 0.97),
    ("graphddp_sharded_fwd / ddp_zero", "graphddp_sharded_fwd", "ddp_zero", 0.85),
    ("graphddp_sharded_fwd / fsdp2", "graphddp_sharded_fwd", "fsdp2", 0.85),
)
# Issue 11's memory target: no gradient outlives its bucket, so graphddp_optim's peak should be
# at most the best eager DDP's peak less the model's gradient bytes.
MEMORY_TARGET = ("graphddp_optim peak / (DDP peak - grads)", 1.00)
# Inductor's DDP fusion passes for ddp_compiled_autograd: its default concat fusion
# ("fuse_ddp_with_concat_op") crashes on Hugging Face GPT-2 in torch 2.13; the coalesced one works.
CA_FUSE_PASSES = ("fuse_ddp_with_coalesced_op", "schedule_comm_wait")
OPTIMIZER = "AdamW(lr=1e-4, weight_decay=0.01)"


def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """Every mode's optimizer, one definition: AdamW, the step users run (issue 11).

    torch's defaults otherwise (on CPU its single-tensor loop, no foreach), so the separate
    step costs what it costs users; graphddp_optim compiles the same math into its backward.
    """
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


@dataclasses.dataclass
class BenchConfig:
    model: str
    tiny: bool
    steps: int
    warmup: int
    graphddp: DDPConfig  # graphddp's options; its backend is every compiled mode's inner compiler
    seed: int
    out: str
    network: dict
    model_kwargs: dict
    batch: int
    ready_probe_runs: int
    modes: tuple[str, ...] = MODES
    powersgd_rank: int = 1  # PowerSGD's matrix_approximation_rank (DDP's default)


def swept_options(config: DDPConfig, cap: float | str) -> dict:
    """graphddp's options of the graphddp mode with ``bucket_cap_mb=cap`` and every other cap
    unset: a number is DDP's semantics for a set cap (every bucket, the first too); "auto" is
    issue 12's planner, which refuses first/last/list caps."""
    return {**config.as_options(), "bucket_cap_mb": cap, "first_bucket_cap_mb": None, "last_bucket_cap_mb": None,
            "bucket_cap_mb_list": None}


def graphddp_cap_mb(config: DDPConfig, bucket_nbytes: Iterable[int]) -> float:
    """graphddp's bucket cap in MB, for the modes that copy it (ddp_compiled_samecap): with
    ``bucket_cap_mb="auto"`` (no caps), the largest bucket it planned."""
    return max(bucket_nbytes) / MB if config.auto else config.effective_bucket_cap_mb


def model_spec(name: str, tiny: bool) -> tuple[dict, int, float, float, float]:
    """(model kwargs, batch, graphddp's bucket_cap_mb, first_bucket_cap_mb, last_bucket_cap_mb)."""
    if tiny:
        # ~3 MB of gradients: DDPOptimizer's 1 MB first-bucket floor still yields > 1 graph.
        return {"width": 256, "depth": 12, "d_in": 256, "d_out": 256}, 16, 1.0, 1.0, 1.0
    if name == "gpt":  # 6.8 M parameters, 26 MB of fp32 gradients
        return {"vocab": 2048, "dim": 256, "heads": 8, "layers": 8, "seq": 64}, 8, 2.0, 1.0, 1.0
    if name == "mlp":  # 8.4 M parameters, 32 MB of fp32 gradients; batch sized so bwd ~ comm at 2 Gbit/s
        return {"width": 1024, "depth": 8, "d_in": 1024, "d_out": 1024}, 640, 4.0, 1.0, 1.0
    raise SystemExit(f"unknown --model {name!r} (gpt or mlp)")


def make_model(cfg: BenchConfig) -> nn.Module:
    from graphddp.models import MLP, TinyGPT

    if cfg.tiny or cfg.model == "mlp":
        return MLP(**cfg.model_kwargs)
    return TinyGPT(**cfg.model_kwargs)


def make_batch(cfg: BenchConfig, rank: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + rank)  # each rank its own data
    if cfg.tiny or cfg.model == "mlp":
        x = torch.randn(cfg.batch, cfg.model_kwargs["d_in"], generator=gen)
        y = torch.randn(cfg.batch, cfg.model_kwargs["d_out"], generator=gen)
        return (x,), y
    vocab, seq = cfg.model_kwargs["vocab"], cfg.model_kwargs["seq"]
    idx = torch.randint(0, vocab, (cfg.batch, seq + 1), generator=gen)
    return (idx[:, :-1].contiguous(),), idx[:, 1:].contiguous()


def loss_fn(cfg: BenchConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if cfg.tiny or cfg.model == "mlp":
        return F.mse_loss
    return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
