"""User hooks and PowerSGD on spawned gloo ranks, against DDP with the same hook.

The reference for PowerSGD is DDP + torch's own ``powerSGD_hook`` with the same settings, with
one change: each bucket's future is waited for inside the hook. On gloo, DDP's PowerSGD
deadlocks once two buckets are in flight (its callbacks wait on nested gloo futures; seen with
torch 2.13), and waiting leaves its arithmetic, its state and its random draws as they are: it
only gives up DDP's overlap, which the comparison does not measure. Q's random initialisation
is reproduced bit for bit (the same numpy seed stream and CPU ``randn`` calls, in the same
bucket order), so gradients agree to float32 rounding.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from matrix_models import _gpt2_batch, _hf_gpt2
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd

import graphddp
from graphddp import models
from graphddp.hooks import PowerSGD
from graphddp.testing import assert_matches_ddp, paired_grads, spawn
from graphddp.hooks.examples import fp16_hook, int8_hook

CAP = 0.01  # three buckets on the MLP


def _serial_powersgd(state, bucket):
    fut = ddp_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _mlp_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return (torch.randn(8, 16, generator=g),), torch.randn(8, 4, generator=g)


def _gpt_batch(rank: int, step: int):
    _, kwargs, _ = _gpt2_batch(rank, step, None)
    return (kwargs["input_ids"],), kwargs["labels"]


def _gpt_loss(out, target):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())


# -- a user hook written in DDP's vocabulary --------------------------------------------------


def _user_fp16_on_gpt2(rank: int, world: int) -> None:
    assert_matches_ddp(
        _hf_gpt2, _gpt_batch, _gpt_loss, steps=3, atol=1e-5, rtol=1e-3,
        ddp_hook=(None, default_hooks.fp16_compress_hook), backend="aot_eager", comm_hook=(None, fp16_hook), bucket_cap_mb=0.02,
    )


def test_a_users_fp16_hook_equals_ddps_fp16_compress_hook_on_hf_gpt2():
    spawn(_user_fp16_on_gpt2, 2)


def _int8(rank: int, world: int) -> None:
    """Two collectives per bucket (a max, then the quantised sum): within half a quantum of DDP's mean."""
    torch.manual_seed(0)
    model = models.CNN()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", comm_hook=(None, int8_hook), bucket_cap_mb=0.005)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    for m in (ref, ours):
        F.cross_entropy(m(x), y).backward()
    schedule = ours.schedules[0]
    assert schedule.num_buckets > 1
    for b in schedule.buckets:
        grads = [dict(ref.module.named_parameters())[n].grad for n in b.param_names]
        quantum = max(g.abs().max() for g in grads) * world / 127  # the scale, from the max of any rank's sum
        for name in b.param_names:
            p, q = dict(ours.module.named_parameters())[name], dict(ref.module.named_parameters())[name]
            assert (p.grad - q.grad).abs().max() <= quantum, name


def test_a_two_stage_int8_hook_averages_within_its_quantisation_error():
    spawn(_int8, 2)


# -- PowerSGD against DDP's powerSGD_hook ------------------------------------------------------


def _powersgd(rank: int, world: int, make, batch, loss_fn, settings: dict, cap: float, backend: str, steps: int) -> None:
    torch.manual_seed(0)
    model = make()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)
    ref.register_comm_hook(ddp_powersgd.PowerSGDState(None, **settings), _serial_powersgd)
    hook = PowerSGD(**settings)
    ours = graphddp.compile(copy.deepcopy(model), backend=backend, comm_hook=hook, bucket_cap_mb=cap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    for step in range(steps):
        if step == 3:  # a local micro-batch: no hook runs, the count stands still (as in DDP)
            for m in (ref, ours):
                with m.no_sync():
                    loss_fn(m(*batch(rank, 100 + step)[0]), batch(rank, 100 + step)[1]).backward()
        inputs, target = batch(rank, step)
        for m in (ref, ours):
            loss_fn(m(*inputs), target).backward()
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, atol=2e-6, rtol=1e-4, msg=lambda m: f"step {step} grad {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert hook.iter == steps and hook.phase() == "powersgd"
    assert all(b.hook == "PowerSGD" for s in ours.schedules for b in s.buckets)
    wire = sum(b.wire_nbytes for s in ours.schedules for b in s.buckets)
    assert wire < sum(s.nbytes for s in ours.schedules) / 2


@pytest.mark.parametrize("settings", [
    dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
    dict(matrix_approximation_rank=4, start_powerSGD_iter=2, batch_tensors_with_same_shape=True, warm_start=False),
    dict(matrix_approximation_rank=2, start_powerSGD_iter=3, use_error_feedback=False, orthogonalization_epsilon=1e-8, random_seed=7),
], ids=["rank1", "rank4-qr-batched-cold", "rank2-no-feedback"])
def test_powersgd_equals_ddp_powersgd_hook_on_an_mlp(settings):
    spawn(_powersgd, 2, models.MLP, _mlp_batch, F.mse_loss, settings, CAP, "aot_eager", 7)


def test_powersgd_equals_ddp_powersgd_hook_on_hf_gpt2():
    settings = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1)
    spawn(_powersgd, 2, _hf_gpt2, _gpt_batch, _gpt_loss, settings, 0.05, "aot_eager", 6)


# PowerSGD under inductor, its phase switch included (start_powerSGD_iter=2), against DDP's
# powerSGD_hook: test_recompile's inductor row (python_flag x powersgd).


# -- checkpoint and resume ---------------------------------------------------------------------


def _resume(rank: int, world: int) -> None:
    settings = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)

    def fresh():
        torch.manual_seed(0)
        model = graphddp.compile(models.MLP(), backend="aot_eager", comm_hook=PowerSGD(**settings), bucket_cap_mb=CAP)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(model, opt, steps):
        for step in steps:
            inputs, target = _mlp_batch(rank, step)
            F.mse_loss(model(*inputs), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    whole, whole_opt = fresh()
    train(whole, whole_opt, range(7))
    first, first_opt = fresh()
    train(first, first_opt, range(4))
    saved = copy.deepcopy((first.state_dict(), first_opt.state_dict()))
    assert saved[0]["graphddp_comm_hook"]["hook"]["iter"] == 4
    assert {k.split(".")[-1] for k in saved[0]["graphddp_comm_hook"]["tensors"]} == {"q", "error"}
    resumed, resumed_opt = fresh()  # a new process would build exactly this
    resumed.load_state_dict(saved[0])  # before its graphs exist: kept until they are compiled
    resumed_opt.load_state_dict(saved[1])
    train(resumed, resumed_opt, range(4, 7))
    for (name, p), q in zip(whole.module.named_parameters(), resumed.module.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    # A plain model refuses a hook's state instead of dropping it silently.
    plain = graphddp.compile(models.MLP(), backend="aot_eager")
    with pytest.raises(ValueError, match="graphddp_comm_hook"):
        plain.load_state_dict(saved[0])


def test_powersgd_checkpoint_and_resume_equals_an_uninterrupted_run():
    spawn(_resume, 2)


# -- a forward with a graph break: two backward graphs, each with its own buckets and state ----


def _graph_break_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return (torch.randn(8, 16, generator=g),), torch.randn(8, 4, generator=g)


def test_powersgd_across_a_graph_break_equals_ddp_powersgd_hook():
    """One parameter per bucket (a tiny cap) on both sides, so DDP's buckets and graphddp's
    per-graph buckets hold the same tensors and draw Q in the same order; the step count
    advances once per backward although two graphs run the hook."""
    spawn(_powersgd, 2, models.GraphBreakMLP, _graph_break_batch, F.mse_loss, dict(start_powerSGD_iter=2), 1e-6, "aot_eager", 6)


def _user_fp16_graph_break(rank: int, world: int) -> None:
    ours = assert_matches_ddp(
        models.GraphBreakMLP, _graph_break_batch, F.mse_loss, steps=3, atol=1e-6, rtol=1e-5,
        ddp_hook=(None, default_hooks.fp16_compress_hook), backend="aot_eager", comm_hook=(None, fp16_hook), bucket_cap_mb=CAP,
    )
    assert len(ours.schedules) == 2 and all(b.hook == "fp16_hook" for s in ours.schedules for b in s.buckets)


def test_a_users_fp16_hook_across_a_graph_break_equals_ddps_fp16_compress_hook():
    spawn(_user_fp16_graph_break, 2)


class _AliasedGradient(nn.Module):
    """``c(a(x) + b)`` with ``b`` of the activation's shape: ``b``'s gradient is the very tensor
    that flows back into ``a``, so a hook that writes ``b``'s bucket in place must not write it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(16, 16), nn.Linear(16, 4)
        self.b = nn.Parameter(torch.randn(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) + self.b)


def _divide_in_place(state, bucket):
    """DDP's allreduce_hook as a user ports it: the buffer divided in place, then summed."""
    buf = bucket.buffer()
    buf.div_(bucket.world_size)
    return funcol.all_reduce(buf, "sum", bucket.group)


def _in_place_on_aliased(rank: int, world: int) -> None:
    assert_matches_ddp(
        _AliasedGradient, _graph_break_batch, F.mse_loss, steps=2, atol=1e-6, rtol=1e-5,
        backend="inductor", comm_hook=(None, _divide_in_place), bucket_cap_mb=1e-6,
    )


def test_a_hook_writing_its_buffer_in_place_leaves_an_aliased_gradient_alone_under_inductor():
    """Inductor drops a clone it takes for a no-op (remove_noop_ops); graphddp's copy of a
    one-gradient bucket for the hook is one that no pass drops (graph.trace.fresh_copy)."""
    spawn(_in_place_on_aliased, 2)
