"""Helpers for tests, examples and the benchmark: spawned gloo ranks, a fake process group,
and a DDP-equivalence harness. Shipped in the package so users can test their own models."""
from __future__ import annotations

import copy
import datetime
import faulthandler
import gc
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, store_path: str, args: tuple, errors: Any, pg_timeout: float
) -> None:
    # A rank that dies in C++ (abort, segfault) reports no Python traceback; faulthandler
    # prints where each thread was, so a crash in CI says more than an exit code.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            fn(rank, world_size, *args)
            dist.barrier()  # leave together: no rank tears gloo down under a peer still using it
        finally:
            release_process_group()
    except BaseException:  # report to the parent; the exit code alone loses the traceback
        errors.put((rank, traceback.format_exc()))
        raise
    # Passed. Skip interpreter finalization: gloo objects still referenced there (from Dynamo's
    # caches, say) are destroyed while Python is half torn down, which can abort the process
    # ("terminate called without an active exception") after every check has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def release_process_group() -> None:
    """Destroy the default group once nothing of ours holds it any more.

    Compiled modules, their guards and DDP reducers keep the group alive; dropping Dynamo's
    caches and collecting cycles first lets its last reference die inside
    ``destroy_process_group``, while the interpreter is whole.
    """
    torch._dynamo.reset()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo CPU ranks; re-raise failures.

    ``fn`` must be importable (module level). A rank that fails makes the others be
    terminated; ranks still running after ``timeout`` seconds are killed, so a test never hangs.
    ``pg_timeout`` is the process group's collective timeout, in seconds.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, fn, world_size, store, args, errors, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and time.monotonic() > deadline
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        if reports:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(reports))
            raise RuntimeError(f"{len(reports)} rank(s) failed:\n{text}")
        if timed_out:
            raise TimeoutError(f"ranks still running after {timeout}s")
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited with codes {bad}")


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A single-process 'fake' group that pretends to have ``world_size`` ranks (planning only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def paired_grads(ours: nn.Module, ref: nn.Module, step: int) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
    """``(name, our parameter, reference parameter)`` for every parameter both have a grad for.

    A gradient present on one side only fails here: that is a missed or extra reduction.
    """
    named_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = named_ref[name]
        if q.grad is None or p.grad is None:
            assert q.grad is None and p.grad is None, f"step {step} {name}: grad None mismatch"
            continue
        yield name, p, q


def assert_matches_ddp(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[int, int], Sequence[Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int = 3,
    lr: float = 0.05,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    ddp_kwargs: dict | None = None,
    **graphddp_kwargs: Any,
) -> Any:
    """On every rank: train DDP and graphddp side by side, compare every grad and param.

    ``make_batch(rank, step) -> (inputs, target)``; inputs is a tuple of positional args.
    Returns the graphddp module for further checks.
    """
    import graphddp

    torch.manual_seed(1234)
    model = make_model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **(ddp_kwargs or {}))
    ours = graphddp.compile(copy.deepcopy(model), **graphddp_kwargs)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
    rank = dist.get_rank()
    for step in range(steps):
        inputs, target = make_batch(rank, step)
        for m, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            loss_fn(m(*inputs), target).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"step {step} grad {name}: {m}")
        opt_ref.step()
        opt_ours.step()
    for name, p in ours.module.named_parameters():
        torch.testing.assert_close(p, dict(ref.module.named_parameters())[name], atol=atol, rtol=rtol,
                                   msg=lambda m: f"param {name} after {steps} steps: {m}")
    for name, b in ours.module.named_buffers():
        torch.testing.assert_close(b, dict(ref.module.named_buffers())[name], atol=atol, rtol=rtol,
                                   msg=lambda m: f"buffer {name} after {steps} steps: {m}")
    return ours
