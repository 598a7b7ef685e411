"""The columns of the DDP matrix (test_ddp_matrix.py): each feature's steps on one rank, graphddp
next to DDP on a model of ``matrix_models``, and its checks, collected by ``Check``, never raised
inside a step; ``FEATURES`` names them. Tolerances: fp32, and the half-precision wire of the
compression hooks."""
from __future__ import annotations

import copy
import dataclasses
import io
import types
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from matrix_models import CAP_MB, Spec
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.hooks.examples import ddp_bf16_compress_hook

FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
# fp16 on the wire: a 1-ulp rounding difference of a half-precision value (2^-11 relative);
# bf16 keeps 8 bits of mantissa (2^-8 relative).
FP16_TOL = {"atol": 1e-3, "rtol": 2e-3}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


# -- soft checks: collect, never raise inside a step ------------------------------------------------


class Check:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def fail(self, msg: str) -> None:
        self.failures.append(f"rank {self.rank}: {msg}")

    def expect(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    def close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, tol: dict) -> None:
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as e:
            self.fail(f"{what}: {e}")


class _DictOut(nn.Module):
    """DDP's side only: DDP looks for output tensors in tensors, lists, dicts and dataclasses,
    not in a SimpleNamespace (with find_unused_parameters it would then count every parameter
    unused); hand it the same fields as a dict. Parameters keep the wrapped module's objects."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.m(*args, **kwargs)
        return dict(vars(out)) if isinstance(out, types.SimpleNamespace) else out


@dataclasses.dataclass
class Pair:
    ref: DDP  # DDP(_DictOut(ref_module))
    ref_module: nn.Module
    ours: Any
    opt_ref: torch.optim.Optimizer
    opt_ours: torch.optim.Optimizer


def _pair(spec: Spec, backend: str, ddp_kwargs: dict | None = None, prepare: Callable[[nn.Module], None] | None = None,
          **graphddp_kwargs: Any) -> Pair:
    torch.manual_seed(1234)
    model = spec.make()
    if prepare is not None:
        prepare(model)
    ref_module = copy.deepcopy(model)
    ref = DDP(_DictOut(ref_module), bucket_cap_mb=CAP_MB, **(ddp_kwargs or {}))
    ours = graphddp.compile(copy.deepcopy(model), backend=backend, **{"bucket_cap_mb": CAP_MB, **graphddp_kwargs})
    return Pair(ref, ref_module, ours,
                torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9))


def _fwd_bwd(m: nn.Module, spec: Spec, rank: int, step: int, length: int | None = None) -> None:
    args, kwargs, target = spec.batch(rank, step, length)
    spec.loss(m(*args, **kwargs), target).backward()


def _both(pair: Pair):
    return ((pair.ref, pair.opt_ref), (pair.ours, pair.opt_ours))


def _compare_grads(check: Check, pair: Pair, what: str, tol: dict = FP32_TOL) -> None:
    named_ref = dict(pair.ref_module.named_parameters())
    for name, p in pair.ours.module.named_parameters():
        q = named_ref[name]
        if p.grad is None or q.grad is None:
            check.expect(p.grad is None and q.grad is None,
                         f"{what} {name}: grad is None in {'graphddp' if p.grad is None else 'DDP'} only")
            continue
        check.close(p.grad, q.grad, f"{what} grad {name}", tol)


def _compare_state(check: Check, pair: Pair, what: str, tol: dict = FP32_TOL) -> None:
    named_ref = dict(pair.ref_module.named_parameters())
    for name, p in pair.ours.module.named_parameters():
        check.close(p.detach(), named_ref[name].detach(), f"{what} param {name}", tol)
    named_buf = dict(pair.ref_module.named_buffers())
    for name, b in pair.ours.module.named_buffers():
        check.close(b, named_buf[name], f"{what} buffer {name}", tol)


def _opt_step(pair: Pair) -> None:
    for _, opt in _both(pair):
        opt.step()
        opt.zero_grad(set_to_none=True)


def _check_every_trainable_reduced(check: Check, ours: Any, what: str) -> None:
    """Across the graphs of one step's forward every trainable parameter is reduced; a
    parameter appearing in several graphs (a tied weight across a graph break) is fine."""
    reduced = {n for s in ours.schedules for n in s.param_names}
    trainable = {n for n, p in ours.module.named_parameters() if p.requires_grad}
    check.expect(trainable <= reduced, f"{what}: never reduced by any schedule: {sorted(trainable - reduced)}")


# -- features ----------------------------------------------------------------------------------------


def _feature_no_sync(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    pair = _pair(spec, backend)
    for step in range(2):
        for m, _ in _both(pair):
            for micro in range(2):  # accumulated locally, no communication
                with m.no_sync():
                    _fwd_bwd(m, spec, rank, 10 * step + micro)
            _fwd_bwd(m, spec, rank, 10 * step + 9)  # synchronised: average of everything accumulated
        _compare_grads(check, pair, f"step {step}")
        _opt_step(pair)
    _compare_state(check, pair, "after 2 accumulation steps")
    # Each Dynamo graph compiled once: the local variant is chosen at run time, never by a
    # recompile (a guard on the sync flag was lost after a graph break), and each graph has
    # one plan, made for the synchronising steps.
    compiled = pair.ours._state.backend.graphs_compiled
    check.expect(compiled == spec.min_graphs == len(pair.ours.schedules),
                 f"no_sync: {compiled} graphs compiled, {len(pair.ours.schedules)} schedules, expected {spec.min_graphs}")
    local = [s.plain_compiles for s in pair.ours._state.backend.states]
    check.expect(local == [1] * spec.min_graphs, f"no_sync: local backwards compiled {local} times per graph, expected once each")


def _feature_toggle(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    pair = _pair(spec, backend, ddp_kwargs={"find_unused_parameters": True})
    frozen = [n for n, _ in pair.ours.module.named_parameters() if n.startswith(spec.freeze)]
    check.expect(bool(frozen), f"no parameter starts with {spec.freeze!r}")
    for step, freeze in enumerate((False, True, False)):
        for module in (pair.ref_module, pair.ours.module):
            for name, p in module.named_parameters():
                if name in frozen:
                    p.requires_grad_(not freeze)
        before = len(pair.ours.schedules)
        for m, _ in _both(pair):
            _fwd_bwd(m, spec, rank, step)
        _compare_grads(check, pair, f"step {step} ({'frozen' if freeze else 'trainable'})")
        params = dict(pair.ours.module.named_parameters())
        for name in frozen:
            check.expect((params[name].grad is None) == freeze, f"step {step}: {name}.grad is None should be {freeze}")
        new = pair.ours.schedules[before:]
        if step == 1:
            check.expect(bool(new), "freezing compiled no new backward graph (no re-plan)")
            for s in new:
                left = sorted(set(s.param_names) & set(frozen))
                check.expect(not left, f"frozen parameters still in the new plan: {left}")
        _opt_step(pair)
    _compare_state(check, pair, "after freeze / unfreeze")


def _feature_plain(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    """Three ordinary steps: every gradient and parameter equals DDP's; each trainable parameter
    is reduced by exactly one bucket per graph it appears in; small caps give several buckets."""
    pair = _pair(spec, backend, bucket_cap_mb=0.005, first_bucket_cap_mb=0.002)
    for step in range(3):
        for m, _ in _both(pair):
            _fwd_bwd(m, spec, rank, step)
        _compare_grads(check, pair, f"step {step}")
        if step == 0:  # DDP's gradient_as_bucket_view: a bucket's gradients share its flat buffer
            params = dict(pair.ours.module.named_parameters())
            for s in pair.ours.schedules:
                for b in s.buckets:
                    storages = {params[n].grad.untyped_storage().data_ptr() for n in b.param_names}
                    check.expect(len(storages) == 1, f"graph {s.graph_index} bucket {b.index}: gradients are not views of one buffer")
        _opt_step(pair)
    _compare_state(check, pair, "after 3 steps")
    _check_every_trainable_reduced(check, pair.ours, "plain")
    check.expect(len(pair.ours.schedules) == spec.min_graphs, f"{len(pair.ours.schedules)} schedules, expected {spec.min_graphs}")
    for s in pair.ours.schedules:
        names = list(s.param_names)
        check.expect(len(names) == len(set(names)), f"graph {s.graph_index}: a parameter in two buckets")
        frozen = {n for n, p in pair.ours.module.named_parameters() if not p.requires_grad}
        check.expect(not frozen & set(names), f"graph {s.graph_index}: frozen parameters reduced: {sorted(frozen & set(names))}")
    if spec.min_graphs == 1:
        check.expect(len(pair.ours.schedules[0].buckets) > 1, "small caps gave one bucket: no overlap tested")


def _feature_compressed(hook: str, wire: str, tol: dict, reference: Callable[..., Any]) -> Callable[..., None]:
    def run(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
        pair = _pair(spec, backend, comm_hook=hook)
        pair.ref.register_comm_hook(None, reference)
        for step in range(2):
            for m, _ in _both(pair):
                _fwd_bwd(m, spec, rank, step)
            _compare_grads(check, pair, f"step {step}", tol)
            _opt_step(pair)
        _compare_state(check, pair, f"after 2 {hook} steps", tol)
        # Same shapes both steps, no recompile: one schedule per Dynamo graph of the forward.
        check.expect(len(pair.ours.schedules) >= spec.min_graphs,
                     f"{len(pair.ours.schedules)} backward schedule(s), expected >= {spec.min_graphs} (graph breaks)")
        for s in pair.ours.schedules:
            for b in s.buckets:
                check.expect(b.comm_dtype == wire and 2 * b.wire_nbytes == b.nbytes,
                             f"graph {s.graph_index} bucket {b.index}: {b.comm_dtype}, {b.wire_nbytes} of {b.nbytes} bytes on the wire")

    return run


def _ranks_equal(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _feature_buffers(broadcast: bool) -> Callable[..., None]:
    def run(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
        pair = _pair(spec, backend, ddp_kwargs={"broadcast_buffers": broadcast}, broadcast_buffers=broadcast)
        for step in range(3):
            for m, _ in _both(pair):
                _fwd_bwd(m, spec, rank, step)
            _compare_grads(check, pair, f"step {step}")
            _compare_state(check, pair, f"step {step} before the optimizer")  # buffers after this forward
            _opt_step(pair)
        floats = [b for b in pair.ours.module.buffers() if b.is_floating_point()]
        if spec.mutable_buffers:
            # Each rank's forward updated the stats with its own batch: they differ now.
            check.expect(not _ranks_equal(floats), "buffers equal on every rank after a training forward")
        # An eval forward (no gradients, stats not updated) that follows a synchronised step:
        # with broadcast_buffers both DDP and graphddp broadcast rank 0's buffers first.
        args, kwargs, _ = spec.batch(rank, 99, None)
        with torch.no_grad():
            for m, _ in _both(pair):
                m.eval()
                m(*args, **kwargs)
                m.train()
        _compare_state(check, pair, "after an eval forward")
        if spec.mutable_buffers:
            same = _ranks_equal(floats)
            check.expect(same == broadcast, f"broadcast_buffers={broadcast}: after the eval forward the ranks' "
                                            f"buffers are {'equal' if same else 'different'}")

    return run


def _feature_rank_local_buffers(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    """broadcast_buffers=False with buffers that differ between ranks before wrapping: DDP
    (torch 2.13: init_sync_buffers follows broadcast_buffers) leaves them rank-local, at
    construction too; graphddp must match it."""

    def rank_local(model: nn.Module) -> None:
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.add_(0.5 * (rank + 1))

    pair = _pair(spec, backend, ddp_kwargs={"broadcast_buffers": False}, prepare=rank_local, broadcast_buffers=False)
    _compare_state(check, pair, "right after wrapping")
    for step in range(2):
        for m, _ in _both(pair):
            _fwd_bwd(m, spec, rank, step)
        _compare_grads(check, pair, f"step {step}")
        _opt_step(pair)
    _compare_state(check, pair, "after 2 steps")


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _feature_resume(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    pair = _pair(spec, backend)  # the uninterrupted run, next to DDP
    after, saved = [], None
    for step in range(3):
        for m, _ in _both(pair):
            _fwd_bwd(m, spec, rank, step)
        _compare_grads(check, pair, f"uninterrupted step {step}")
        _opt_step(pair)
        after.append(_snapshot(pair.ours.module))
        if step == 0:
            saved = _roundtrip({"model": pair.ours.state_dict(), "opt": pair.opt_ours.state_dict()})
    _compare_state(check, pair, "uninterrupted, after 3 steps")
    check.expect(bool(saved["opt"]["state"]), "no momentum buffers in the optimizer checkpoint")

    torch.manual_seed(4321)  # a fresh model with other initial weights
    resumed = graphddp.compile(spec.make(), backend=backend, bucket_cap_mb=CAP_MB)
    check.expect(any(not torch.equal(v, after[0][k]) for k, v in resumed.state_dict().items()),
                 "the fresh model already had the checkpoint's weights")
    resumed.load_state_dict(saved["model"])
    opt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(saved["opt"])
    for step in (1, 2):
        _fwd_bwd(resumed, spec, rank, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = _snapshot(resumed.module)
        for k, v in after[step].items():
            check.expect(torch.equal(got[k], v), f"{k} differs after step {step} of the resumed run "
                                                 f"(max diff {(got[k].double() - v.double()).abs().max().item():.3g})")


def _feature_dynamic(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    pair = _pair(spec, backend)
    lengths = spec.lengths[rank]  # rank-dependent at one step, as DDP allows
    for step, length in enumerate(lengths):
        for m, _ in _both(pair):
            _fwd_bwd(m, spec, rank, step, length)
        _compare_grads(check, pair, f"step {step} (length {length})")
        _opt_step(pair)
    _compare_state(check, pair, f"after lengths {lengths}")
    _check_every_trainable_reduced(check, pair.ours, "dynamic shapes")


def _feature_auto(spec: Spec, rank: int, world: int, backend: str, check: Check) -> None:
    """bucket_cap_mb="auto" (issue 12): buckets from the cost model calibrated on this group at
    wrap time, the same on every rank (else the in-band layout check raises), same gradients."""
    pair = _pair(spec, backend, bucket_cap_mb="auto")
    for step in range(2):
        for m, _ in _both(pair):
            with m.no_sync():
                _fwd_bwd(m, spec, rank, 10 * step)
            _fwd_bwd(m, spec, rank, 10 * step + 1)
        _compare_grads(check, pair, f"step {step}")
        _opt_step(pair)
    _compare_state(check, pair, "after 2 steps")
    _check_every_trainable_reduced(check, pair.ours, "auto buckets")
    for s in pair.ours.schedules:
        check.expect(s.cost_model is not None and s.cost_model.source.startswith("calibrated"),
                     f"graph {s.graph_index}: planned with {s.cost_model}, not the calibrated cost model")
    mine = [(s.fingerprint(), s.cost_model) for s in pair.ours.schedules]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    check.expect(all(x == mine for x in everyone), f"ranks planned differently: {everyone}")


FEATURES: dict[str, Callable[..., None]] = {
    "plain": _feature_plain,
    "auto_buckets": _feature_auto,
    "no_sync": _feature_no_sync,
    "toggle_requires_grad": _feature_toggle,
    "fp16_compress": _feature_compressed("fp16_compress", "float16", FP16_TOL, default_hooks.fp16_compress_hook),
    "bf16_compress": _feature_compressed("bf16_compress", "bfloat16", BF16_TOL, ddp_bf16_compress_hook),
    "buffers_on": _feature_buffers(True),
    "buffers_off": _feature_buffers(False),
    "buffers_off_rank_local": _feature_rank_local_buffers,
    "resume": _feature_resume,
    "dynamic_shapes": _feature_dynamic,
}
