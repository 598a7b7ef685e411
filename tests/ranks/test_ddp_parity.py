"""Parity with torch's DistributedDataParallel beyond plain fp32 training: dtypes and checkpoints.

Spawned gloo CPU ranks (2) train graphddp (``backend="aot_eager"``) next to
``torch.nn.parallel.DistributedDataParallel`` on the same model and the same data, every rank
on different data, and compare every ``p.grad`` each step and the parameters after several
optimizer steps (``parity_harness.py``). Covered here: bf16 / fp16 / mixed-dtype parameters
(buckets never mix dtypes), CPU autocast, activation checkpointing, checkpoint save / resume.
Dynamic shapes are in ``test_ddp_parity_dynamic.py``, process groups and world size 1 in
``test_ddp_parity_groups.py``.
"""
from __future__ import annotations

import io

import torch
import torch.nn as nn
from parity_harness import (BF16_TOL, CAPS, FP16_TOL, _assert_buckets_single_dtype, _assert_each_trainable_param_reduced_once,
                            _image_batch, _mse, _token_batch, _train_side_by_side, _vector_batch, _xent)
from torch.utils.checkpoint import checkpoint

import graphddp
from graphddp import models
from graphddp.testing import spawn


# -- models and data ------------------------------------------------------------------------------


class MixedDtypeNet(nn.Module):
    """A bf16 front half and an fp32 back half, with explicit casts in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.low = models.MLP(width=64, depth=3, d_in=16, d_out=32).to(torch.bfloat16)
        self.high = models.MLP(width=64, depth=3, d_in=32, d_out=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.low(x.to(torch.bfloat16))
        return self.high(torch.relu(h).float())


class CheckpointedMLP(nn.Module):
    """Residual MLP blocks; the even-numbered ones run under non-reentrant checkpointing."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i % 2 == 0:
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return self.out(torch.tanh(h))


class CheckpointedGPT(models.TinyGPT):
    """TinyGPT with its first transformer block (attention included) checkpointed."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i == 0 else block(x)
        return self.head(self.ln(x))


# -- 1. dtypes -------------------------------------------------------------------------------------


def _low_precision(rank: int, world: int) -> None:
    for dtype, tol in ((torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL)):
        ours, _, _ = _train_side_by_side(
            lambda: models.MLP().to(dtype),
            lambda r, s: _vector_batch(r, s, dtype),
            _mse,
            steps=3,
            tol=tol,
        )
        assert _assert_buckets_single_dtype(ours) == {str(dtype).replace("torch.", "")}
        assert len(ours.schedules[0].buckets) > 1
        torch._dynamo.reset()

    ours, _, _ = _train_side_by_side(MixedDtypeNet, _vector_batch, _mse, steps=3, tol=BF16_TOL)
    assert _assert_buckets_single_dtype(ours) == {"bfloat16", "float32"}
    for bucket in ours.schedules[0].buckets:
        prefix = "low." if bucket.dtype == "bfloat16" else "high."
        assert all(n.startswith(prefix) for n in bucket.param_names), bucket.param_names


def test_low_precision_and_mixed_dtype_params_match_ddp():
    """bf16 and fp16 models match DDP; a bf16+fp32 model gets single-dtype buckets."""
    spawn(_low_precision, 2)


# -- 2. autocast -------------------------------------------------------------------------------------


def _autocast(rank: int, world: int) -> None:
    for make_model, batch, loss in ((models.MLP, _vector_batch, _mse), (models.TinyGPT, _token_batch, _xent)):
        ours, _, _ = _train_side_by_side(make_model, batch, loss, steps=3, tol=BF16_TOL, autocast=torch.bfloat16)
        # Autocast changes compute dtypes, not gradient dtypes: fp32 params, fp32 buckets.
        assert _assert_buckets_single_dtype(ours) == {"float32"}
        torch._dynamo.reset()


def test_cpu_autocast_bf16_matches_ddp():
    spawn(_autocast, 2)


# -- 3. activation checkpointing ------------------------------------------------------------------------


def _activation_checkpointing(rank: int, world: int) -> None:
    for make_model, batch, loss in ((CheckpointedMLP, _vector_batch, _mse), (CheckpointedGPT, _token_batch, _xent)):
        ours, _, _ = _train_side_by_side(make_model, batch, loss, steps=3)
        assert len(ours.schedules) == 1  # checkpoint is traced, not a graph break
        assert len(ours.schedules[0].buckets) > 1
        torch._dynamo.reset()


def test_activation_checkpointing_matches_ddp():
    spawn(_activation_checkpointing, 2)


# -- 4. checkpoint save / resume ---------------------------------------------------------------------------


def _step(model, opt, batch) -> None:
    inputs, target = batch
    opt.zero_grad(set_to_none=True)
    _xent(model(*inputs), target).backward()
    opt.step()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(rank: int, world: int) -> None:
    make = models.CNN  # parameters plus BatchNorm buffers (running stats, num_batches_tracked)
    batches = [_image_batch(rank, s) for s in range(4)]

    # State-dict keys are the plain module's, in both directions.
    torch.manual_seed(1)
    probe = graphddp.compile(make(), backend="aot_eager", **CAPS)
    plain = make()
    assert list(probe.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(probe.state_dict())  # strict
    torch.manual_seed(2)
    other = make()
    probe.load_state_dict(other.state_dict())  # strict
    for k, v in other.state_dict().items():
        assert torch.equal(probe.state_dict()[k], v), k

    # The uninterrupted run: 4 steps, a checkpoint after step 2.
    torch.manual_seed(1234)
    model = graphddp.compile(make(), backend="aot_eager", **CAPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    after = []
    saved = None
    for s in range(4):
        _step(model, opt, batches[s])
        after.append(_snapshot(model))
        if s == 1:
            saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved is not None and saved["opt"]["state"], "momentum buffers must be in the checkpoint"

    # A fresh model (other initial weights) and a fresh optimizer resume from the checkpoint.
    torch.manual_seed(4321)
    resumed = graphddp.compile(make(), backend="aot_eager", **CAPS)
    assert not torch.equal(resumed.module.conv1.weight, after[1]["conv1.weight"])
    resumed.load_state_dict(saved["model"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    for s in (2, 3):
        _step(resumed, opt2, batches[s])
        got = _snapshot(resumed)
        for k, v in after[s].items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} differs after step {s + 1} of the resumed run"
    _assert_each_trainable_param_reduced_once(resumed)


def test_checkpoint_resume_equals_uninterrupted_run():
    spawn(_resume, 2)
