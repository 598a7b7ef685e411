"""The per-rank modes the benchmark times, and the probes it runs around them."""
from __future__ import annotations

import contextlib
import copy
import os
import resource
import statistics
import time
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from tools.bench.procstat import cpu_seconds, runqueue_wait
from tools.bench.workload import CA_FUSE_PASSES, MB, BenchConfig, make_optimizer


class CountingBackend:
    """A torch.compile backend that counts the graphs it is handed, then runs ``inner``.

    Under DDPOptimizer it is called once per split subgraph, so ``graphs`` shows the split.
    """

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


def _now() -> float:
    return time.perf_counter()


class _StepProbe:
    """CPU accounting around one step: this thread, its process, the whole machine."""

    def __init__(self) -> None:
        self.thread, self.rq, self.proc = time.thread_time(), runqueue_wait(), time.process_time()
        self.machine = cpu_seconds()[0]
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def finish(self) -> dict[str, float]:
        return {"cpu": time.thread_time() - self.thread, "rq_wait": runqueue_wait() - self.rq,
                "proc_cpu": time.process_time() - self.proc, "machine_busy": cpu_seconds()[0] - self.machine,
                "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults}


class TrainMode:
    """One model + optimizer; ``step()`` times fwd, bwd, post-backward comm, optimizer.

    The optimizer is :func:`~tools.bench.workload.make_optimizer`'s over ``params`` unless
    ``opt`` is given: graphddp_optim passes the one attached to its backward, whose
    ``step``/``zero_grad`` are then no-ops, so its update is timed inside ``bwd``.
    ``backward_ctx`` wraps ``loss.backward()`` only (ddp_compiled_autograd's compiled
    autograd), so no other mode's backward runs under it.
    """

    def __init__(self, name: str, model: nn.Module, params: Any, batch: Any, loss: Callable,
                 after_backward: Callable[[], None] | None = None,
                 before_backward: Callable[[], None] | None = None, *,
                 opt: torch.optim.Optimizer | None = None,
                 backward_ctx: Callable[[], ContextManager[Any]] | None = None) -> None:
        self.name = name
        self.model = model
        self.opt = opt if opt is not None else make_optimizer(params)
        self.inputs, self.target = batch
        self.loss = loss
        self.after_backward = after_backward
        self.before_backward = before_backward
        self.backward_ctx = backward_ctx

    def step(self) -> dict[str, float]:
        probe = _StepProbe()
        t0 = _now()
        self.opt.zero_grad(set_to_none=True)
        out = self.model(*self.inputs)
        loss = self.loss(out, self.target)
        t1 = _now()
        if self.before_backward is not None:
            self.before_backward()
        with self.backward_ctx() if self.backward_ctx is not None else contextlib.nullcontext():
            loss.backward()
        t2 = _now()
        if self.after_backward is not None:
            self.after_backward()
        t3 = _now()
        self.opt.step()
        t4 = _now()
        return {"step": t4 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "comm": t3 - t2, "opt": t4 - t3,
                **probe.finish()}

    def held_grad_bytes(self) -> int:
        """Bytes of the gradients alive now, which the next step frees in its ``zero_grad``."""
        seen: dict[int, torch.Tensor] = {}
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    seen[id(p)] = p.grad
        return sum(g.numel() * g.element_size() for g in seen.values())


class CompiledAutogradBackward:
    """ddp_compiled_autograd's backward context: compiled autograd plus DDP's fusion passes.

    ``DDP(..., python_reducer)`` hooks every parameter's gradient accumulation with a
    functional all-reduce; compiled autograd traces those hooks into one backward graph, and
    inductor's ``_fuse_ddp_communication`` passes bucket the all-reduces (at DDP's caps,
    ``_fuse_ddp_bucket_size``). Both are switched on only inside this context, so the modes
    it is interleaved with keep the plain autograd engine and inductor's default passes
    (graphddp pins the fusion off for its own compiles anyway).
    """

    def __init__(self, backend: str, bucket_size_mb: float) -> None:
        self.backend = backend
        self.bucket_size_mb = bucket_size_mb
        self.inductor_patch = {"_fuse_ddp_communication": True, "_fuse_ddp_bucket_size": bucket_size_mb,
                               "_fuse_ddp_communication_passes": list(CA_FUSE_PASSES)}

    def compiler_fn(self, gm: Any) -> Any:
        """The compiled-autograd graph's compiler: torch.compile with the benchmark's backend."""
        return torch.compile(gm, backend=self.backend, fullgraph=True)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        from torch._dynamo import compiled_autograd

        with torch._inductor.config.patch(self.inductor_patch), \
                compiled_autograd._enable(self.compiler_fn, dynamic=False):
            yield


def ddp_compiled_autograd(module: nn.Module, backend: str) -> tuple[nn.Module, CompiledAutogradBackward]:
    """``torch.compile(DDP(module))`` with DDP's Python reducer, for compiled autograd.

    ``optimize_ddp = "python_reducer"`` is what makes DDP register its traceable hooks; DDP
    reads it once, at construction, and then turns inductor's ``_fuse_ddp_communication`` on
    for the whole process. All three settings are restored here, so the DDPOptimizer modes
    and later compiles see the process as it was; :class:`CompiledAutogradBackward` applies
    the fusion to this mode's backward alone.
    """
    dynamo, inductor = torch._dynamo.config, torch._inductor.config
    saved = (dynamo.optimize_ddp, inductor._fuse_ddp_communication, inductor._fuse_ddp_bucket_size)
    dynamo.optimize_ddp = "python_reducer"
    try:
        ddp = nn.parallel.DistributedDataParallel(module)
        bucket_size_mb = inductor._fuse_ddp_bucket_size  # DDP's resolved cap (25 MB by default)
    finally:
        dynamo.optimize_ddp, inductor._fuse_ddp_communication, inductor._fuse_ddp_bucket_size = saved
    return torch.compile(ddp, backend=backend), CompiledAutogradBackward(backend, bucket_size_mb)


def check_averaged_once(mode: TrainMode, module: nn.Module, world: int) -> dict[str, float]:
    """That ``mode``'s backward leaves every rank the average of the ranks' local gradients.

    One more forward/backward of ``mode`` (no optimizer step) against an eager copy of
    ``module`` (the mode's parameters as they are now) whose gradients are summed over the
    ranks and divided by ``world`` here. Relative max errors: ``averaged`` must be ~0;
    ``summed`` (``world - 1``) and ``local`` show a missing division and a
    missing all-reduce apart.
    """
    local = copy.deepcopy(module)
    mode.loss(local(*mode.inputs), mode.target).backward()
    local_grads = [p.grad.detach().clone() for p in local.parameters()]
    averaged = [g.clone() for g in local_grads]
    for g in averaged:
        dist.all_reduce(g)
        g.div_(world)
    mode.opt.zero_grad(set_to_none=True)
    loss = mode.loss(mode.model(*mode.inputs), mode.target)
    with mode.backward_ctx() if mode.backward_ctx is not None else contextlib.nullcontext():
        loss.backward()
    got = [p.grad for p in module.parameters()]
    scale = max(g.abs().max().item() for g in averaged) or 1.0

    def err(ref: list[torch.Tensor]) -> float:
        return max((a - b).abs().max().item() for a, b in zip(got, ref)) / scale

    return {"averaged": err(averaged), "summed": err([g * world for g in averaged]), "local": err(local_grads)}


class CommOnlyMode:
    """graphddp's buckets, all-reduced one after another on preallocated flat tensors."""

    name = "comm_only"

    def __init__(self, buckets: list[tuple[int, torch.dtype]]) -> None:
        self.flats = [torch.ones(numel, dtype=dtype) for numel, dtype in buckets]

    def step(self) -> dict[str, Any]:
        times = []
        probe = _StepProbe()
        t0 = _now()
        for flat in self.flats:
            s = _now()
            dist.all_reduce(flat)
            times.append(_now() - s)
        total = _now() - t0
        return {"step": total, "fwd": 0.0, "bwd": 0.0, "comm": total, "opt": 0.0, "buckets": times,
                **probe.finish()}


class UnboundComm:
    """ideal_overlap's communication: graphddp's buckets, all issued as the backward starts.

    ``issue`` (before backward) launches an async all-reduce of every bucket on its own
    preallocated tensor, so the link is never idle for want of a ready gradient; ``wait``
    (after backward) waits for them. Nothing depends on the gradients, so the step shows
    what the link and the shared CPU cores allow: the communication's CPU cost slows the
    compute exactly as it does in a real overlapped step, but no schedule can do better.
    """

    def __init__(self, buckets: list[tuple[int, torch.dtype]]) -> None:
        self.flats = [torch.ones(numel, dtype=dtype) for numel, dtype in buckets]
        self.works: list[Any] = []

    def issue(self) -> None:
        self.works = [dist.all_reduce(flat, async_op=True) for flat in self.flats]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


def flat_allreduce(model: nn.Module, world: int) -> Callable[[], None]:
    """no_overlap's post-backward communication: one flat all-reduce of every gradient."""
    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    return run


def check_update_in_backward(mode: TrainMode, module: nn.Module, world: int) -> dict[str, Any]:
    """One step of ``mode`` (its optimizer inside the backward) against torch's own step.

    A copy of ``module`` and of the optimizer's state gets the ranks' average of eager
    gradients and ``torch.optim``'s step; then ``mode`` steps. ``relative``: the L2 norm of the
    parameters' difference over the L2 norm of the step's move, float32 rounding (~1e-6)
    when the update is right, order 1 when it is not (wrong lr, decay, bias correction or
    gradient). One step, not whole trajectories: a ReLU network's training amplifies rounding
    differences within a few steps (an activation flips), between any two correct paths.
    """
    ref = copy.deepcopy(module)
    ref_opt = make_optimizer(ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(mode.opt.state_dict()))  # its own state tensors
    mode.loss(ref(*mode.inputs), mode.target).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    before = [p.detach().clone() for p in ref.parameters()]
    ref_opt.step()
    mode.step()
    diff_sq = moved_sq = 0.0
    for p, r, b in zip(module.parameters(), ref.parameters(), before):
        diff_sq += (p.detach() - r.detach()).double().square().sum().item()
        moved_sq += (r.detach() - b).double().square().sum().item()
    return {"relative": (diff_sq / moved_sq) ** 0.5 if moved_sq else float("inf"), "moved_l2": moved_sq ** 0.5,
            "grads_none": all(p.grad is None for p in module.parameters())}


def _ddp_buckets(ddp: nn.parallel.DistributedDataParallel, names: dict[int, str]) -> list[dict]:
    """DDP's current bucket partition (after its rebuild), in reduction order."""
    out = []
    for b in ddp.reducer._get_zeros_like_grad_buckets():
        out.append({"nbytes": b.buffer().numel() * b.buffer().element_size(),
                    "params": [names.get(id(p), "?") for p in b.parameters()]})
    return out


def _ready_fractions(cfg: BenchConfig, base: nn.Module, batch: Any, loss: Callable,
                     buckets: list[list[str]]) -> dict[str, Any]:
    """Per bucket, when its last gradient is accumulated, as a fraction of the eager backward.

    Measured with ``register_post_accumulate_grad_hook`` on an eager copy of the model (a
    compiled backward hands all gradients back at its very end, so hooks there say nothing).
    """
    model = copy.deepcopy(base)
    named = dict(model.named_parameters())
    stamps: dict[str, float] = {}
    handles = [named[n].register_post_accumulate_grad_hook(lambda _p, n=n: stamps.__setitem__(n, _now()))
               for b in buckets for n in b]
    runs = []
    inputs, target = batch
    for i in range(cfg.ready_probe_runs + 1):
        model.zero_grad(set_to_none=True)
        stamps.clear()
        l_ = loss(model(*inputs), target)
        t1 = _now()
        l_.backward()
        t2 = _now()
        if i == 0:
            continue  # warm-up
        runs.append([(max(stamps[n] for n in b) - t1) / (t2 - t1) for b in buckets])
    for h in handles:
        h.remove()
    fractions = [statistics.median(r[i] for r in runs) for i in range(len(buckets))]
    return {"fractions": fractions, "runs": len(runs)}


MEASURED = "graphddp_bench_measured_step"  # the profiled step whose memory is reported


def _profile_step(mode: Any) -> dict[str, Any]:
    """Two extra steps under torch.profiler(profile_memory=True); the second one measured:
    allocator peak and collectives.

    The peak is counted from the bytes live at the step's start, which hold the previous
    step's gradients where a mode keeps them (DDP, a separate optimizer) and none where it
    does not (graphddp_optim); the step's ``zero_grad`` frees them first. ``held_grad_mb``
    records them, so the summary can count every mode's gradients in its peak.

    Why two: the profiler reports no free of memory allocated before it started ("Memory block
    of unknown size was allocated before the profiling started"), so in a step profiled alone
    the old gradients its ``zero_grad`` frees, or the all-gathers the step before left for this
    forward (graphddp ``gather="forward"``), would count as live for the whole step: a peak too
    high by what the mode holds between steps. The first step's allocations are seen, so the
    second step's frees of them are too.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    held = mode.held_grad_bytes() if hasattr(mode, "held_grad_bytes") else 0
    dist.barrier()
    saved = os.dup(2)  # kineto prints start/stop lines on fd 2
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            mode.step()
            dist.barrier()
            with record_function(MEASURED):
                mode.step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    events = list(prof.profiler.kineto_results.events())
    begin = min(e.start_ns() for e in events if e.name() == MEASURED)
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = 0
    for e in (e for e in mem if e.start_ns() < begin):
        live += e.nbytes()
    at_start = peak = live
    for e in (e for e in mem if e.start_ns() >= begin):
        live += e.nbytes()
        peak = max(peak, live)
    peak, live = peak - at_start, live - at_start
    # Collective issue/wait times relative to the first event of the measured step.
    ops = [e for e in events if e.name() not in ("[memory]", MEASURED) and e.start_ns() >= begin]
    start = min((e.start_ns() for e in ops), default=0)
    colls = []
    for e in sorted(ops, key=lambda e: e.start_ns()):
        name = e.name()
        if any(k in name for k in ("all_reduce", "allreduce", "wait_tensor")) and "gloo" not in name:
            colls.append({"name": name, "start_ms": (e.start_ns() - start) / 1e6, "dur_ms": e.duration_ns() / 1e6})
    bwd = sorted((e for e in ops if e.name() == "CompiledFunctionBackward"), key=lambda e: e.start_ns())
    return {
        "peak_mb": peak / MB,
        "held_grad_mb": held / MB,
        "retained_mb": live / MB,
        "collectives": colls,
        "compiled_backward_ms": [[(e.start_ns() - start) / 1e6, e.duration_ns() / 1e6] for e in bwd],
    }
