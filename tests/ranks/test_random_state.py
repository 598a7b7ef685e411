"""graphddp leaves its user's random state alone, on 2 gloo ranks.

nanoGPT draws every batch from torch's global generator. A library that draws from it too
(calibration once did: a ``torch.randn`` at wrap time) shifts every later batch, and the run
no longer equals DDP's. So, in every mode below, torch's CPU generator, every CUDA generator
(where there is CUDA), Python's ``random`` and NumPy's global state are the same before
``graphddp.compile``, after it, and after steps that include a ``no_sync`` micro-batch and a
recompile (a new batch size); and nothing reseeds them in between. The second check is needed
because ``torch.manual_seed`` reseeds every CUDA device too, which ``fork_rng(devices=[])``
does not restore; without CUDA no state shows it (the seed waits for CUDA's lazy init).

On a model with dropout, with batches sampled from the global generator as nanoGPT samples
them, the user's randomness is drawn exactly as by ``DDP(torch.compile(model))``: the same CPU
state after the same steps, and the same losses (the same batches and dropout masks).

Calibration runs once per process group per process (the rank pool outlives a test), so the
cases that plan ``auto`` wrap on a new group and count the measurements.
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphddp
from graphddp import models
from graphddp.hooks import PowerSGD
from graphddp.runtime import calibrate
from graphddp.testing import spawn

CAP = 0.01  # MB: three buckets on the MLP
# (batch rows, a no_sync micro-batch first): the third step recompiles for 5 rows.
STEPS = ((8, False), (8, True), (5, False), (8, False))


def _states() -> dict[str, Any]:
    """Every global generator a user may draw from, in comparable form."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _assert_same(before: dict[str, Any], after: dict[str, Any], when: str) -> None:
    for name, was in before.items():
        now = after[name]
        if name == "torch":
            same = torch.equal(was, now)
        elif name == "cuda":
            same = len(was) == len(now) and all(torch.equal(a, b) for a, b in zip(was, now))
        else:
            same = was == now
        assert same, f"{when}: the global {name} generator changed"


RESEEDS = (
    (torch, "manual_seed"), (torch, "seed"), (torch.random, "manual_seed"), (torch.random, "seed"),
    (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"), (torch.cuda, "seed"), (torch.cuda, "seed_all"),
    (random, "seed"), (np.random, "seed"),
)


@contextlib.contextmanager
def _reseeds() -> Iterator[list[str]]:
    """Every call that reseeds a global generator while inside, by name."""
    calls: list[str] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in RESEEDS]

    def spy(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(label)
            return fn(*args, **kwargs)
        return call

    for owner, name, fn in saved:
        setattr(owner, name, spy(f"{owner.__name__}.{name}", fn))
    try:
        yield calls
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def _calibrated_anew(cache: str) -> Iterator[list[int]]:
    """Calibration's compute timing, counted; its stored numbers in ``cache`` (not the suite's)."""
    saved_env, measure = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), calibrate._compute_times
    runs: list[int] = []

    def counted(*args: Any) -> list[float]:
        runs.append(1)
        return measure(*args)

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    calibrate._compute_times = counted
    try:
        yield runs
    finally:
        calibrate._compute_times = measure
        if saved_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_env


def _batch(rank: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)  # the test's data never touches the globals
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def _global_batch(rank: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 16), torch.randn(rows, 4)  # as nanoGPT samples: from the global generator


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, batch: Callable[..., Any] = _batch) -> list[float]:
    losses = []
    for step, (rows, accumulate) in enumerate(STEPS):
        if accumulate:
            x, y = batch(rank, 100 + step, rows)
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
        x, y = batch(rank, step, rows)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _adamw(m: nn.Module) -> dict[str, Any]:
    return {"optimizer": torch.optim.AdamW(m.parameters(), lr=1e-3), "bucket_cap_mb": CAP}


MODES: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "auto": lambda m: {},
    "cap": lambda m: {"bucket_cap_mb": CAP},
    "adamw": _adamw,
    "sharded": lambda m: {**_adamw(m), "sharding": "optimizer"},
    "bf16": lambda m: {"comm_hook": "bf16_compress", "bucket_cap_mb": CAP},
    # Q drawn anew for every bucket at every synchronising step.
    "powersgd": lambda m: {"comm_hook": PowerSGD(start_powerSGD_iter=1, warm_start=False), "bucket_cap_mb": CAP},
}


def _untouched(rank: int, world: int, cache: str) -> None:
    for mode, options_of in MODES.items():
        # Dynamo starts afresh: its automatic-dynamic memory of MLP's code would otherwise make
        # the next mode's first graph dynamic, with nothing left to recompile.
        torch._dynamo.reset()
        group = dist.new_group(list(range(world)))  # never calibrated in this process
        torch.manual_seed(0)
        model = models.MLP()
        options = options_of(model)
        opt = options.get("optimizer") or torch.optim.SGD(model.parameters(), lr=0.05)
        before = _states()
        with _calibrated_anew(cache) as calibrations, _reseeds() as reseeds:
            ours = graphddp.compile(model, process_group=group, backend="aot_eager", **options)
            _assert_same(before, _states(), f"{mode}: graphddp.compile")
            _train(ours, opt, rank)
        _assert_same(before, _states(), f"{mode}: steps with no_sync and a recompile")
        assert reseeds == [], f"{mode}: {reseeds}"
        assert len(ours.schedules) >= 2, f"{mode}: no recompile"  # one plan per compiled backward
        source = ours.schedules[0].cost_model.source if ours.schedules[0].cost_model else None
        if mode == "auto":
            assert calibrations == [1] and (source or "").startswith("calibrated on process group"), (calibrations, source)
        else:
            assert calibrations == [] and source is None, (mode, calibrations, source)


def test_compile_calibration_and_steps_leave_every_global_generator_untouched(tmp_path):
    spawn(_untouched, 2, str(tmp_path))


class DropoutMLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(
            nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4)
        )


def _dropout_like_ddp(rank: int, world: int, cache: str) -> None:
    torch.manual_seed(0)
    model = DropoutMLP()
    runs = {}
    for name in ("graphddp", "ddp"):
        torch._dynamo.reset()  # each run compiles as the first one did
        group = dist.new_group(list(range(world)))
        copied = copy.deepcopy(model)
        opt = torch.optim.SGD(copied.parameters(), lr=0.05)
        torch.manual_seed(1234 + rank)
        with _calibrated_anew(cache) as calibrations:
            if name == "graphddp":  # the default plan: calibrated at wrap time
                wrapped = graphddp.compile(copied, process_group=group, backend="aot_eager")
            else:
                wrapped = nn.parallel.DistributedDataParallel(torch.compile(copied, backend="aot_eager"), process_group=group)
            losses = _train(wrapped, opt, rank, _global_batch)
        runs[name] = (losses, torch.get_rng_state(), calibrations)
    (ours, ours_state, calibrations), (ref, ref_state, _) = runs["graphddp"], runs["ddp"]
    assert calibrations == [1]
    assert torch.equal(ours_state, ref_state), "graphddp's run drew a different amount of randomness than DDP's"
    assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6), (ours, ref)


def test_dropout_draws_the_same_randomness_as_ddp_over_torch_compile(tmp_path):
    spawn(_dropout_like_ddp, 2, str(tmp_path))
