"""Helpers for tests, examples and the benchmark: spawned gloo ranks, a fake process group and
a DDP-equivalence harness, shipped so users can test their own models."""
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
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def missing_torch_feature(feature: str) -> str | None:
    """Why a test of ``feature`` cannot run on this torch (a skip reason), or None: graphddp runs
    without them, as the features they serve say. ``"caches"``: graphddp's compile cache and
    stored calibrations (``runtime.disk.hooked``); ``"isolated_recompiles"``: each compile counting
    its own recompiles (``torch.compile(isolate_recompiles=)``)."""
    from graphddp.compiler.aot import ISOLATED
    from graphddp.runtime import disk

    have = {"caches": disk.hooked, "isolated_recompiles": lambda: bool(ISOLATED)}[feature]()
    return None if have else f"torch {torch.__version__} has no {feature} hook; graphddp runs without it"


# Set to "1" (graphddp's suite sets it), spawned ranks and force_inductor_gpu_paths' callers
# compile CPU graphs through the inductor paths that otherwise run only for GPU inputs.
GPU_PATHS_ENV = "GRAPHDDP_TEST_INDUCTOR_GPU_PATHS"


def force_inductor_gpu_paths() -> None:
    """Make inductor take, for CPU graphs, its GPU-only comprehensive padding path, which reads
    output-node bookkeeping a CPU compile never reads: a rewrite that leaves it stale crashes on
    every GPU and passes every CPU test. Process-wide, for test processes."""
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "disable_padding_cpu"):
        inductor_config.disable_padding_cpu = False
    inductor_config.comprehensive_padding = True


@contextmanager
def graph_caches_in(path: str) -> Iterator[None]:
    """The caches a warm compile reads (inductor's FX graphs, AOTAutograd's entries, graphddp's
    plans) in ``path`` instead of ``TORCHINDUCTOR_CACHE_DIR``, which keeps the C++ kernels: with
    ``path`` empty a compile runs cold (a miss at every level a hit is made of) but loads the
    kernels other compiles built, where an empty inductor cache would build every one again."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache

    from graphddp.compiler import cache

    saved = FxGraphCache.__dict__["_get_tmp_dir"], AOTAutogradCache.__dict__["_get_tmp_dir"], cache._path
    FxGraphCache._get_tmp_dir = staticmethod(lambda: os.path.join(path, "fxgraph"))
    AOTAutogradCache._get_tmp_dir = classmethod(lambda cls: os.path.join(path, "aotautograd"))
    cache._path = lambda key: os.path.join(path, "graphddp", key[:2], f"{key}.pkl")
    try:
        yield
    finally:
        FxGraphCache._get_tmp_dir, AOTAutogradCache._get_tmp_dir, cache._path = saved


def _init_rank(rank: int, world_size: int, store_path: str, pg_timeout: float) -> None:
    # A rank that dies in C++ (abort, segfault) reports no Python traceback; faulthandler
    # prints where each thread was, so a crash in CI says more than an exit code.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    if os.environ.get(GPU_PATHS_ENV) == "1":
        force_inductor_gpu_paths()
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def freeze_survivors() -> None:
    """Collect garbage, then hide every survivor from the collector (``gc.freeze``): every full
    collection (Dynamo's tracing triggers many) walks a test process's hundreds of thousands of
    long-lived objects. Only a cycle among them is never freed, which a test process can afford;
    a user's process (and the benchmark's ranks) must collect as usual."""
    gc.collect()
    gc.freeze()


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, store_path: str, args: tuple, errors: Any, pg_timeout: float,
    freeze: bool = False,
) -> None:
    reported = False
    try:
        _init_rank(rank, world_size, store_path, pg_timeout)
        if freeze:
            freeze_survivors()
        try:
            fn(rank, world_size, *args)
            dist.barrier()  # leave together: no rank tears gloo down under a peer still using it
        except BaseException:
            # Reported before the group goes: a peer's failure that its teardown causes comes second.
            errors.put((rank, traceback.format_exc()))
            reported = True
            raise
        finally:
            release_process_group()
    except BaseException:  # report to the parent; the exit code alone loses the traceback
        if not reported:
            errors.put((rank, traceback.format_exc()))
        raise
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """Exit a rank's process without interpreter finalization: gloo objects still referenced there
    (from Dynamo's caches, say) are destroyed while Python is half torn down, which can abort the
    process ("terminate called without an active exception") after every check has passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def release_process_group() -> None:
    """Destroy the default group after dropping Dynamo's caches and cycles, which hold it, so its
    last reference dies inside ``destroy_process_group`` while the interpreter is whole."""
    torch._dynamo.reset()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0,
    fresh: bool = False,
) -> None:
    """Run the importable ``fn(rank, world_size, *args)`` on ``world_size`` gloo CPU ranks and
    re-raise failures; a failure or ``timeout`` terminates the rest, so a test never hangs.

    After :func:`reuse_ranks`, calls with a pool's size and the default ``pg_timeout`` run on a
    :class:`RankPool`; ``fresh=True`` asks for new processes (a function that changes
    process-wide state, or kills a rank).
    """
    if _POOL_ENABLED and world_size in RankPool.WORLDS and pg_timeout == RankPool.PG_TIMEOUT and not fresh:
        return _pool(world_size).run(fn, args, timeout)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, fn, world_size, store, args, errors, pg_timeout, _POOL_ENABLED), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        reports = []
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                break
            while not errors.empty():  # read as they come: a long traceback fills the pipe, and its rank
                reports.append(errors.get())  # would block in put() until the deadline instead of failing
            if reports:
                break
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and time.monotonic() > deadline and not reports
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        while not errors.empty():
            reports.append(errors.get())
        if reports:
            raise _failed(reports)
        if timed_out:
            raise TimeoutError(f"ranks still running after {timeout}s")
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited with codes {bad}")


def _failed(reports: list[tuple[int, str]]) -> RuntimeError:
    text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(reports))
    return RuntimeError(f"{len(reports)} rank(s) failed:\n{text}")


# -- a pool of ranks reused across spawn() calls ----------------------------------------------------

_POOL_ENABLED = False
_POOLS: "dict[int, RankPool]" = {}


def reuse_ranks(enabled: bool = True) -> None:
    """Let :func:`spawn` run on long-lived groups of ranks: starting ranks costs seconds per call,
    most of a short test; a pool pays it once per size."""
    global _POOL_ENABLED
    _POOL_ENABLED = enabled
    if not enabled:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


def _pool(world_size: int) -> "RankPool":
    pool = _POOLS.get(world_size)
    if pool is None or not pool.healthy():
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


def _pool_entry(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    _init_rank(rank, world_size, store_path, RankPool.PG_TIMEOUT)
    freeze_survivors()
    while (task := tasks.get()) is not None:
        task_id, fn, args = task
        error = None
        try:
            fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001 - reported to the parent, which retires the pool
            error = traceback.format_exc()
        torch._dynamo.reset()
        freeze_survivors()
        if error is None:
            # Leave together, and prove the pair still pairs its collectives: a function that
            # left one unmatched would make these disagree (or hang: the parent's timeout).
            seen: list[Any] = [None] * world_size
            try:
                dist.all_gather_object(seen, task_id)
                if seen != [task_id] * world_size:
                    error = f"after the task the ranks' collectives no longer pair up: {seen}"
            except BaseException:  # noqa: BLE001
                error = traceback.format_exc()
        results.put((task_id, rank, error))
    _exit_without_finalizing()


class RankPool:
    """Gloo ranks that run one function after another, resetting Dynamo in between; after a failure
    or a timeout the pool is retired, so a failing test cannot leave a half-finished collective."""

    WORLDS = (2, 3, 4)
    PG_TIMEOUT = 120.0

    def __init__(self, world_size: int = 2) -> None:
        self.world = world_size
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self._tmp.name, "store")
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_pool_entry, args=(r, self.world, store, self._tasks[r], self._results), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self._ok = True

    def healthy(self) -> bool:
        return self._ok and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> None:
        import queue

        task_id, self._next_id = self._next_id, self._next_id + 1
        for q in self._tasks:
            q.put((task_id, fn, args))
        errors: dict[int, str] = {}
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(done) < self.world:
            try:
                got_id, rank, error = self._results.get(timeout=0.2 if not errors else 5.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
                if errors or dead or time.monotonic() > deadline:
                    self.close()
                    if errors:
                        break
                    if dead:
                        raise RuntimeError(f"rank(s) {dead} of the rank pool died running {fn.__name__}") from None
                    raise TimeoutError(f"ranks still running {fn.__name__} after {timeout}s") from None
                continue
            if got_id != task_id:
                continue  # a late report of a task that was abandoned
            done.add(rank)
            if error is not None:
                errors[rank] = error
        if errors:
            self.close()
            raise _failed(list(errors.items()))

    def close(self) -> None:
        self._ok = False
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - terminated below either way
                    pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
                p.join()
        self._tmp.cleanup()


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A single-process 'fake' group that pretends to have ``world_size`` ranks (planning only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def update_runs(model: Any) -> list[tuple[int, int]]:
    """Per compiled graph of ``model`` (what ``graphddp.compile`` returned): how many synchronising
    backwards updated inside it, and how many left the update to torch's step."""
    step = model._state.step
    runs = []
    for index in range(len(step.graphs)):
        counts = step.updates(index)
        inside = counts.get("inside", 0) + counts.get("inside, carried", 0)
        runs.append((inside, sum(counts.values()) - inside))
    return runs


def paired_grads(ours: nn.Module, ref: nn.Module, step: int) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
    """``(name, ours, reference)`` for every parameter both have a grad for; a grad on one side only
    (a missed or extra reduction) fails."""
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
    ddp_hook: tuple[Any, Callable[..., Any]] | None = None,
    **graphddp_kwargs: Any,
) -> Any:
    """On every rank: train DDP and graphddp side by side, compare every grad and param; returns
    the graphddp module. ``make_batch(rank, step) -> (args tuple, target)``; ``ddp_hook``: DDP's
    ``register_comm_hook`` arguments."""
    import graphddp

    torch.manual_seed(1234)
    model = make_model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **(ddp_kwargs or {}))
    if ddp_hook is not None:
        ref.register_comm_hook(*ddp_hook)
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
