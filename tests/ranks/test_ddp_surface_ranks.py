"""DDP's public surface on the module graphddp returns, against DDP on 2 spawned gloo ranks.

What a training loop written for ``DistributedDataParallel`` touches besides ``forward``, each
next to ``torch.nn.parallel.DistributedDataParallel`` doing the same on the same data
(``backend="aot_eager"``, an MLP in three buckets, every rank on its own data):

* ``require_backward_grad_sync`` set per micro-step, as nanoGPT's train.py does: gradients after
  every micro-step and parameters after every optimizer step equal DDP's, and the backward of a
  micro-step run with the switch False dispatches no collective at all (counted by a dispatch
  mode around it); with ``optimizer=`` too, and in the ``graphddp.backend`` form;
* ``no_sync()`` and the switch interleaved, ``no_sync`` nested in a False switch and the switch
  set True inside ``no_sync`` included: DDP's ``no_sync`` is the switch, so both must follow it;
* ``register_comm_hook`` with each of DDP's four hooks (the plain all-reduce, fp16 and bf16
  compression, PowerSGD with its ``PowerSGDState``) against DDP with the same hook;
* DDP's constructor keywords graphddp accepts, passed to both, with a parameter no step uses.

The refusals (a hook registered late, twice, on top of ``comm_hook=``; the keywords graphddp
refuses) need no second rank: ``tests/unit/test_ddp_surface.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import graphddp
from graphddp import models
from graphddp.testing import paired_grads, spawn

CAP = 0.01  # three buckets on the MLP
MICRO = 4  # micro-steps per optimizer step
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
FP16_TOL = {"atol": 1e-3, "rtol": 2e-3}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched on real tensors while it is active: graphddp's bucket
    collectives (``_c10d_functional`` ops in the compiled backward, their waits left out) and
    eager ones (``c10d`` ops: the in-band agreement, an eager average). Ops on fake tensors
    are a graph being traced (a backward compiled on first use), not traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.bucket = 0
        self.eager = 0

    def counts(self) -> dict[str, int]:
        return {"bucket": self.bucket, "eager": self.eager}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        namespace = func.namespace
        if any(isinstance(t, FakeTensor) for t in pytree.tree_leaves((args, kwargs))):
            pass
        elif namespace == "_c10d_functional" and "wait" not in func.__name__:
            self.bucket += 1
        elif namespace == "c10d":
            self.eager += 1
        return func(*args, **(kwargs or {}))


def _pair(**graphddp_options):
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=CAP)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=CAP, **graphddp_options)
    return ref, ours


def _compare_grads(ours: nn.Module, ref: nn.Module, what: str, tol: dict = FP32_TOL) -> None:
    for name, p, q in paired_grads(ours, ref, 0):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{what}: grad {name}: {m}")


def _compare_params(ours: nn.Module, ref: nn.Module, what: str, tol: dict = FP32_TOL) -> None:
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, named[name], **tol, msg=lambda m: f"{what}: param {name}: {m}")


def _micro_step(ours, ref, rank: int, step: int) -> Collectives:
    """One forward and backward on both sides; returns what graphddp's backward dispatched."""
    x, y = _batch(rank, step)
    F.mse_loss(ref(x), y).div(MICRO).backward()
    loss = F.mse_loss(ours(x), y).div(MICRO)
    with Collectives() as counted:
        loss.backward()
    return counted


def _buckets(view) -> int:
    return sum(len(s.buckets) for s in view.schedules)


# -- require_backward_grad_sync per micro-step, as nanoGPT sets it --------------------------------


def _accumulate_by_switch(rank: int, world: int, with_optimizer: bool) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=CAP)
    ours_module = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours_module.parameters(), lr=1e-2)
    options = {"optimizer": opt_ours} if with_optimizer else {}
    ours = graphddp.compile(ours_module, backend="aot_eager", bucket_cap_mb=CAP, **options)
    for step in range(2):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            ref.require_backward_grad_sync = ours.require_backward_grad_sync = last
            counted = _micro_step(ours, ref, rank, step * MICRO + micro)
            what = f"step {step} micro-step {micro}"
            if not last:
                assert (counted.bucket, counted.eager) == (0, 0), f"{what}: a local micro-step communicated: {counted.counts()}"
                _compare_grads(ours.module, ref.module, what)
            else:
                # one all-reduce per bucket, and the counter sees eager ones too (the agreement)
                assert counted.bucket == _buckets(ours) == 3 and counted.eager >= 1, f"{what}: {counted.counts()}"
                if not with_optimizer:  # with it the update ran and p.grad is None
                    _compare_grads(ours.module, ref.module, what)
        opt_ref.step()
        opt_ours.step()  # a no-op with optimizer=: the step ran at the end of the backward
        for opt in (opt_ref, opt_ours):
            opt.zero_grad(set_to_none=True)
        _compare_params(ours.module, ref.module, f"after step {step}")


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["plain", "optimizer"])
def test_require_backward_grad_sync_per_micro_step_accumulates_like_ddp_and_sends_nothing(with_optimizer):
    spawn(_accumulate_by_switch, 2, with_optimizer)


def _interleaved(rank: int, world: int) -> None:
    """Every combination a loop can make of the switch and no_sync(), on both sides; after each
    micro-step the gradients and the switch equal DDP's."""
    ref, ours = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    step = 0

    def run(what: str, syncs: bool) -> None:
        nonlocal step
        counted = _micro_step(ours, ref, rank, step)
        step += 1
        assert ours.require_backward_grad_sync == ref.require_backward_grad_sync, what
        assert (counted.bucket > 0) == syncs, f"{what}: {counted.counts()}"
        _compare_grads(ours.module, ref.module, what)

    for m in (ref, ours):
        m.require_backward_grad_sync = False
    run("switch False", syncs=False)
    for m in (ref, ours):
        with m.no_sync():
            assert m.require_backward_grad_sync is False
    assert ours.require_backward_grad_sync is False, "no_sync() restores the switch as it found it"
    with ref.no_sync(), ours.no_sync():
        run("no_sync inside a False switch", syncs=False)
    with ref.no_sync(), ours.no_sync():
        ref.require_backward_grad_sync = ours.require_backward_grad_sync = True
        run("switch set True inside no_sync", syncs=True)  # DDP reads the switch, not the context
    assert ours.require_backward_grad_sync is False and ref.require_backward_grad_sync is False
    for m in (ref, ours):
        m.require_backward_grad_sync = True
    with ref.no_sync(), ours.no_sync():
        assert ours.require_backward_grad_sync is False
        run("no_sync inside a True switch", syncs=False)
    assert ours.require_backward_grad_sync is True
    run("switch True", syncs=True)
    for opt in opts:
        opt.step()
    _compare_params(ours.module, ref.module, "after the optimizer step")


def test_no_sync_and_the_switch_interleaved_follow_ddp():
    spawn(_interleaved, 2)


def _backend_form_switch(rank: int, world: int) -> None:
    """graphddp.backend(model): the switch is the backend object's, as its no_sync() is."""
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=CAP)
    module = copy.deepcopy(model)
    backend = graphddp.backend(module, backend="aot_eager", bucket_cap_mb=CAP)
    compiled = torch.compile(module, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, module)]
    for micro in range(MICRO):
        last = micro == MICRO - 1
        ref.require_backward_grad_sync = backend.require_backward_grad_sync = last
        counted = _micro_step(compiled, ref, rank, micro)
        assert (counted.bucket > 0) == last, f"micro-step {micro}: {counted.counts()}"
        _compare_grads(module, ref.module, f"micro-step {micro}")
    for opt in opts:
        opt.step()
    _compare_params(module, ref.module, "after the optimizer step")


def test_the_backend_forms_switch_accumulates_like_ddp():
    spawn(_backend_form_switch, 2)


# -- register_comm_hook with DDP's own hooks ------------------------------------------------------


def _serial_powersgd(state, bucket):
    """DDP's powerSGD_hook, each bucket waited for inside the hook: on gloo, DDP's PowerSGD
    deadlocks with two buckets in flight (tests/ranks/test_hooks_ranks.py); its arithmetic is
    unchanged."""
    fut = ddp_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


POWERSGD = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=3)
# hook -> (how DDP registers it, what graphddp compiles it as, the dtype buckets travel in, tolerance)
HOOKS = {
    "allreduce_hook": (default_hooks.allreduce_hook, None, None, FP32_TOL),
    "fp16_compress_hook": (default_hooks.fp16_compress_hook, "fp16_compress", "float16", FP16_TOL),
    "bf16_compress_hook": (default_hooks.bf16_compress_hook, "bf16_compress", "bfloat16", BF16_TOL),
    "powerSGD_hook": (ddp_powersgd.powerSGD_hook, "PowerSGD", None, {"atol": 2e-6, "rtol": 1e-4}),
}


def _registered_hook(rank: int, world: int, name: str) -> None:
    hook, compiled_as, wire_dtype, tol = HOOKS[name]
    ref, ours = _pair()
    if name == "powerSGD_hook":
        ref.register_comm_hook(ddp_powersgd.PowerSGDState(None, **POWERSGD), _serial_powersgd)
        ours.register_comm_hook(ddp_powersgd.PowerSGDState(None, **POWERSGD), hook)
    elif name == "bf16_compress_hook":
        # DDP.register_comm_hook refuses bf16_compress_hook without NCCL; its reducer runs it on gloo.
        dist._register_comm_hook(ref.reducer, None, hook)
        ours.register_comm_hook(None, hook)
    else:
        ref.register_comm_hook(None, hook)
        ours.register_comm_hook(None, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    for step in range(5):
        x, y = _batch(rank, step)
        for m in (ref, ours):
            F.mse_loss(m(x), y).backward()
        _compare_grads(ours.module, ref.module, f"step {step}", tol)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    _compare_params(ours.module, ref.module, "after 5 steps", tol)
    buckets = [b for s in ours.schedules for b in s.buckets]
    assert len(buckets) == 3, buckets
    if name == "powerSGD_hook":
        assert ours.config.traced_hook.name == "PowerSGD" and ours.config.comm_hook.iter == 5, ours.config.comm_hook
        assert {b.hook for b in buckets} == {"PowerSGD"}, [b.hook for b in buckets]
    else:
        assert ours.config.comm_hook == compiled_as, f"{name} compiled as comm_hook={ours.config.comm_hook!r}"
        assert {b.comm_dtype for b in buckets} == {wire_dtype}, f"{name}: buckets travel in {[b.comm_dtype for b in buckets]}"


@pytest.mark.parametrize("name", list(HOOKS))
def test_register_comm_hook_with_ddps_hook_equals_ddp_with_it(name):
    spawn(_registered_hook, 2, name)


# -- DDP's constructor keywords -------------------------------------------------------------------


class WithUnused(nn.Module):
    """An MLP and a layer no step uses (DDP needs find_unused_parameters=True for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = models.MLP()
        self.unused = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _constructor_keywords(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = WithUnused()
    same = dict(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=CAP)
    ref = DDP(copy.deepcopy(model), **same)  # DDP takes no device_ids for a CPU module
    ours = graphddp.compile(
        copy.deepcopy(model), backend="aot_eager", device_ids=[torch.device("cpu")], output_device="cpu", **same
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        x, y = _batch(rank, step)
        for m in (ref, ours):
            F.mse_loss(m(x), y).backward()
        _compare_grads(ours.module, ref.module, f"step {step}")
        assert ours.module.unused.weight.grad is None and ref.module.unused.weight.grad is None
        params = dict(ours.module.named_parameters())
        for b in ours.schedules[0].buckets:  # gradient_as_bucket_view: one buffer per bucket
            assert len({params[n].grad.untyped_storage().data_ptr() for n in b.param_names}) == 1, b.param_names
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    _compare_params(ours.module, ref.module, "after 3 steps")


def test_ddps_constructor_keywords_graphddp_accepts_train_like_ddp_with_them():
    spawn(_constructor_keywords, 2)
