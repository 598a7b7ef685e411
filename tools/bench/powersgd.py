"""Issue 13's modes: PowerSGD inside graphddp's graph against DDP's ``powerSGD_hook``.

graphddp_powersgd
    ``graphddp.compile(model, comm_hook=graphddp.hooks.PowerSGD(matrix_approximation_rank=R,
    **POWERSGD_SETTINGS), <the graphddp mode's other options>)``, AdamW after the backward.
ddp_powersgd
    eager ``DistributedDataParallel(model, bucket_cap_mb=<the model's gradients + 1 MB>)`` with
    ``register_comm_hook(PowerSGDState(None, R, **POWERSGD_SETTINGS), powerSGD_hook)``: DDP's hook
    as it is, on ONE bucket. Why one: with gloo, ``powerSGD_hook`` deadlocks when more than one
    bucket is in flight (its future callbacks wait on nested gloo futures: the ranks' collectives
    end up in different orders); one bucket never has another in flight. The cost: the one bucket
    is ready only when the backward ends, so nothing of its communication overlaps the backward.
    The cap is an explicit one, so DDP's first bucket gets it too (DDP's 1 MB first bucket is for
    its default caps only); the run checks that DDP made one bucket before any compressed step.
ddp_powersgd_serial
    eager DDP at its default caps (25 MB, first 1 MB) with ``powerSGD_hook`` wrapped so that each
    bucket's future completes before the hook returns (:func:`serial_powerSGD_hook`): DDP's math
    and buckets, no deadlock, but no bucket's communication overlaps the backward either (the
    autograd thread waits for each bucket's three collectives in turn).

Every mode steps past ``start_powerSGD_iter`` (plain all-reduce) before the timed rounds, and
past the first compressed step too (graphddp compiles its PowerSGD variant on first use), so
``--warmup 0`` still times compressed steps only; :func:`check_compressed` fails loudly
otherwise, and after the timed rounds :func:`check_all_compressed` checks that every step since
counted as a compressed one.

Bytes on the wire, per rank per step (what each rank puts into its all-reduces):
graphddp: ``sum(b.wire_nbytes)`` over the PowerSGD schedule's buckets, read from the rewritten
graph (cross-checked against ``graphddp.hooks.powersgd.wire_numel``); uncompressed: the same over the
"allreduce" phase's schedule. DDP: per DDP bucket, the numel of what is sent as is plus
``(n + m) * rank`` per compressed matrix, by DDP's own ``_should_compress`` rule over its
buckets' parameter shapes, times the element size; cross-checked against ``PowerSGDState``'s
``total_numel_after_compression`` over the compressed steps it counted; uncompressed: its
buckets' bytes.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tools.bench.modes import TrainMode, _now
from tools.bench.workload import MB, POWERSGD_SETTINGS, BenchConfig


def serial_powerSGD_hook(state, bucket):  # type: ignore[no-untyped-def]  # noqa: N802 - DDP's name
    """DDP's ``powerSGD_hook``, its bucket finished before the hook returns (one in flight).

    Unannotated: DDP's ``register_comm_hook`` refuses annotations other than its own types, and
    this module's postponed annotations would be strings.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    fut = powerSGD_hook(state, bucket)
    fut.wait()
    return fut


class PowerSGDMode:
    """One PowerSGD mode: its TrainMode, how to read its step count and phase, its wire bytes."""

    def __init__(self, name: str, train: TrainMode, start: int, iters: Callable[[], int],
                 compressing: Callable[[], bool]) -> None:
        self.name = name
        self.train = train
        self.start = start
        self.iters = iters
        self.compressing = compressing
        self.first_compressed_s: float | None = None
        self.ddp_kwargs: dict[str, Any] | None = None  # the DDP modes' constructor keywords
        self.iter_at_timing: int | None = None

    def step_to_compressed(self) -> None:
        """Step (collectively, fenced) until one compressed step has run; time that one."""
        while self.iters() <= self.start:
            compressed = self.iters() >= self.start
            dist.barrier()
            t = _now()
            self.train.step()
            dt = _now() - t
            dist.barrier()
            if compressed:
                self.first_compressed_s = dt

    def check_compressed(self) -> None:
        """Fail loudly unless the next step is a compressed one (before the timed rounds)."""
        it = self.iters()
        if not (self.compressing() and it > self.start):
            raise RuntimeError(
                f"{self.name}: before the timed rounds its PowerSGD is at step {it} (start_powerSGD_iter "
                f"{self.start}, compressing: {self.compressing()}): the timed steps would not all be compressed")
        self.iter_at_timing = it

    def check_all_compressed(self, timed_rounds: int) -> dict[str, int]:
        """After the timed rounds: each advanced the step count by one, all past the start."""
        it = self.iters()
        if self.iter_at_timing is None or it != self.iter_at_timing + timed_rounds or not self.compressing():
            raise RuntimeError(
                f"{self.name}: its PowerSGD step count went from {self.iter_at_timing} to {it} over "
                f"{timed_rounds} rounds (start_powerSGD_iter {self.start}): not one compressed step per round")
        return {"iter_before_rounds": self.iter_at_timing, "iter_after_rounds": it}


def build_graphddp(cfg: BenchConfig, base: nn.Module, batch: Any, loss: Callable) -> tuple[PowerSGDMode, Any]:
    """graphddp_powersgd: the graphddp mode's options with ``comm_hook=PowerSGD(...)``."""
    import graphddp

    hook = graphddp.hooks.PowerSGD(matrix_approximation_rank=cfg.powersgd_rank, **POWERSGD_SETTINGS)
    m = graphddp.compile(copy.deepcopy(base), **{**cfg.graphddp.as_options(), "comm_hook": hook})
    train = TrainMode("graphddp_powersgd", m, m.parameters(), batch, loss)
    mode = PowerSGDMode("graphddp_powersgd", train, hook.start_powerSGD_iter, lambda: hook.iter,
                        lambda: hook.phase() == "powersgd")
    return mode, hook


def graphddp_wire(model: Any, hook: Any) -> dict[str, Any]:
    """graphddp_powersgd's bytes on the wire per rank per step, compressed and uncompressed."""
    from graphddp.hooks.powersgd import wire_numel

    schedules = model.schedules  # the steady state: the "powersgd" phase's plans
    buckets = [b for s in schedules for b in s.buckets]
    wire = sum(b.wire_nbytes for b in buckets)
    by_layout = sum(wire_numel(hook, [b]) * getattr(torch, b.dtype).itemsize for b in buckets)
    hooked = [b.hook for b in buckets]
    plain = []
    for r in model.records:
        phase = (r.phases or {}).get("allreduce")
        plain.append(phase.schedule if phase is not None else None)
    uncompressed = (sum(b.wire_nbytes for s in plain for b in s.buckets) if all(s is not None for s in plain)
                    else sum(b.nbytes for b in buckets))
    return {"bytes": wire, "uncompressed_bytes": uncompressed, "bytes_by_layout": by_layout,
            "buckets": len(buckets), "bucket_hooks": hooked, "bucket_wire_bytes": [b.wire_nbytes for b in buckets],
            "schedules": [s.to_table() for s in schedules],
            "source": "sum(Bucket.wire_nbytes) of model.schedules (read from the rewritten graph); uncompressed: "
                      "the same over the 'allreduce' phase's schedules"}


def build_ddp(cfg: BenchConfig, base: nn.Module, batch: Any, loss: Callable, *, serial: bool) -> tuple[PowerSGDMode, Any]:
    """ddp_powersgd (one bucket, DDP's hook as is) or ddp_powersgd_serial (default caps, serialised)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    name = "ddp_powersgd_serial" if serial else "ddp_powersgd"
    model = copy.deepcopy(base)
    kwargs: dict[str, Any] = {}
    if not serial:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        kwargs["bucket_cap_mb"] = math.ceil(grad_bytes / MB) + 1
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank, **POWERSGD_SETTINGS)
    ddp.register_comm_hook(state, serial_powerSGD_hook if serial else powerSGD_hook)
    train = TrainMode(name, ddp, ddp.parameters(), batch, loss)
    mode = PowerSGDMode(name, train, state.start_powerSGD_iter, lambda: state.iter,
                        lambda: state.iter >= state.start_powerSGD_iter)
    mode.ddp_kwargs = kwargs
    return mode, state


def ddp_bucket_count(ddp: nn.parallel.DistributedDataParallel) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def check_one_bucket(mode: PowerSGDMode) -> None:
    """ddp_powersgd must have one DDP bucket: with more, DDP's hook deadlocks on gloo."""
    n = ddp_bucket_count(mode.train.model)
    if n != 1:
        raise RuntimeError(
            f"{mode.name}: DDP made {n} buckets at bucket_cap_mb={(mode.ddp_kwargs or {}).get('bucket_cap_mb')}; "
            "powerSGD_hook deadlocks on gloo with more than one bucket in flight, so the mode needs one")


def ddp_wire(ddp: nn.parallel.DistributedDataParallel, state: Any) -> dict[str, Any]:
    """DDP + powerSGD_hook's bytes on the wire per rank per step, by its rule and by its counters."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    per_bucket, plain, itemsize = [], 0, 4
    for b in ddp.reducer._get_zeros_like_grad_buckets():
        buf = b.buffer()
        itemsize = buf.element_size()
        plain += buf.numel() * itemsize
        numel = 0
        for p in b.parameters():
            n = p.shape[0] if p.dim() else 1
            m = p.numel() // n if n else 0
            rank = min(n, m, state.matrix_approximation_rank)
            compress, before, after = _should_compress(n, m, rank, state.min_compression_rate)
            numel += after if compress else before
        per_bucket.append(numel * itemsize)
    compressed_steps = state.iter - state.start_powerSGD_iter
    by_counters = (state.total_numel_after_compression * itemsize / compressed_steps) if compressed_steps > 0 else None
    return {"bytes": sum(per_bucket), "uncompressed_bytes": plain, "bytes_by_counters": by_counters,
            "buckets": len(per_bucket), "bucket_wire_bytes": per_bucket, "compressed_steps_counted": compressed_steps,
            "source": "per DDP bucket: numel sent as is + (n + m) * rank per matrix _should_compress picks, x element "
                      "size; bytes_by_counters: PowerSGDState.total_numel_after_compression / compressed steps"}
