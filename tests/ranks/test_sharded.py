"""Sharded optimizer state (``sharding="optimizer"``) against DDP + the same torch.optim.

Every case trains graphddp with ``optimizer=opt, sharding="optimizer"`` next to
``DistributedDataParallel`` and a plain optimizer of the same class, from parameters that
differ between the ranks before wrapping, with rank-dependent data, an LR scheduler stepping
every step and one ``no_sync`` micro-batch. After every step: the parameters equal DDP's, no
gradient is kept, each rank's ``opt.state[p]`` holds only its part of ``p`` (flat, the size
:func:`graphddp.values.shards.part` says, nothing where it owns no element), and
``graphddp.full_optimizer_state_dict`` equals the reference optimizer's ``state_dict()``.
World sizes 2 and 3 (3 cuts most parameters unevenly). Tolerances as in test_optim_ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from matrix_features import BF16_TOL
from test_optim_ranks import ADAM_NOISE, CNN, FP16_ADAM, TIGHT, _adamw, _cnn_loss, _gpt_loss, _hf_gpt2, _hf_loss, _sgd, assert_state_dicts_equal, start_unequal, step_both
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.optim.whole_state import ELEMENTWISE
from graphddp.testing import spawn
from graphddp.hooks.examples import ddp_bf16_compress_hook
from graphddp.values.comm import ROLE_KEY
from graphddp.values.shards import part


def _mlp_loss(m: nn.Module, rank: int, step: int, rows: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return F.mse_loss(m(torch.randn(rows, 16, generator=g)), torch.randn(rows, 4, generator=g))


def _mlp_loss_new_shape(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    """A batch of another size from step 2 on: Dynamo compiles the frame again."""
    return _mlp_loss(m, rank, step, 8 if step < 2 else 5)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 4
    no_sync_step: int | None = 2
    backend: str = "aot_eager"
    fp16_compress: bool = False  # comm_hook="fp16_compress" here, DDP's fp16_compress_hook there
    bf16_compress: bool = False  # comm_hook="bf16_compress" here, DDP's bf16 recipe there (its hook refuses gloo)
    recompiles: bool = False


CASES = {
    "mlp_adamw": Case(models.MLP, _mlp_loss, _adamw),
    "mlp_sgd_nesterov": Case(models.MLP, _mlp_loss, _sgd),
    "frozen_mlp_adamw": Case(models.FrozenMLP, _mlp_loss, _adamw),
    "cnn_adamw": Case(CNN, _cnn_loss, _adamw),
    "tied_across_break_sgd": Case(lambda: models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8), _gpt_loss, _sgd),
    "hf_gpt2_adamw": Case(_hf_gpt2, _hf_loss, _adamw, tol=ADAM_NOISE),
    "cnn_adamw_fp16_compress": Case(CNN, _cnn_loss, _adamw, tol=FP16_ADAM, fp16_compress=True),
    "mlp_sgd_nesterov_bf16_compress": Case(models.MLP, _mlp_loss, _sgd, tol=BF16_TOL, bf16_compress=True),
    "mlp_adamw_recompile": Case(models.MLP, _mlp_loss_new_shape, _adamw, recompiles=True),
    "mlp_adamw_inductor": Case(models.MLP, _mlp_loss, _adamw, backend="inductor", steps=3),
}


def _check_parts(model: nn.Module, opt: torch.optim.Optimizer, world: int, rank: int, what: str) -> None:
    for name, p in model.named_parameters():
        lo, hi = part(p.numel(), world, rank)
        state = opt.state.get(p, {})
        if hi <= lo:
            assert not state, f"{what}: {name}: state on a rank that owns none of it"
        for k, v in state.items():
            if k in ELEMENTWISE:
                assert v.dim() == 1 and v.numel() == hi - lo, f"{what}: {name}[{k!r}] is {tuple(v.shape)}, its part has {hi - lo}"


def _pair(case: Case, rank: int) -> tuple[Any, nn.Module, torch.optim.Optimizer, DDP, torch.optim.Optimizer]:
    mine, ref, opt, ref_opt = start_unequal(case, rank)
    hook = "fp16_compress" if case.fp16_compress else "bf16_compress" if case.bf16_compress else None
    if case.bf16_compress:
        ref.register_comm_hook(None, ddp_bf16_compress_hook)
    ours = graphddp.compile(mine, optimizer=opt, sharding="optimizer", backend=case.backend, bucket_cap_mb=0.004, comm_hook=hook)
    return ours, mine, opt, ref, ref_opt


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    for step in range(case.steps):
        step_both(case, ours, ours, (opt, sched), ref, (ref_opt, ref_sched), rank, step)
        for (n, p), q in zip(mine.named_parameters(), ref.module.parameters()):
            assert p.grad is None, f"step {step}: {n}.grad kept"
            torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"{name} step {step} param {n}: {m}")
        _check_parts(mine, opt, world, rank, f"{name} step {step}")
        assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), case.tol, f"{name} step {step}")
    sharded = [b for s in ours.schedules for b in s.buckets if b.collective == "reduce_scatter"]
    assert sharded, f"{name}: no bucket was reduce-scattered"
    # On gloo a reduce-scatter travels as an all_to_all_single (half its reduce_scatter's bytes).
    ops = [n.target for r in ours.records for n in r.graph.graph.nodes if n.op == "call_function"]
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default not in ops, f"{name}: gloo's reduce_scatter was issued"
    # ... and an all-gather as an all_to_all_single too (two functional all-gathers in flight
    # corrupt gloo's heap: graphddp.values.collectives); the role tells them apart.
    assert torch.ops._c10d_functional.all_gather_into_tensor.default not in ops, f"{name}: gloo's all-gather was issued"
    all_to_alls = [n for r in ours.records for n in r.graph.graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default]
    scatters = [n for n in all_to_alls if n.meta.get(ROLE_KEY) == "reduce_scatter"]
    gathers = [n for n in all_to_alls if n.meta.get(ROLE_KEY) == "all_gather"]
    assert len(scatters) == len(sharded), f"{name}: {len(scatters)} reduce-scatters for {len(sharded)} sharded buckets"
    assert len(gathers) + len(scatters) == len(all_to_alls), f"{name}: all-to-alls of no role"
    assert len(gathers) == len(sharded), f"{name}: {len(gathers)} all-gathers for {len(sharded)} sharded buckets"
    if case.fp16_compress or case.bf16_compress:
        half = torch.float16 if case.fp16_compress else torch.bfloat16
        assert all(b.comm_dtype == str(half).split(".")[1] for b in sharded) and scatters, "the plan sends half precision"
        assert all(n.args[0].meta["val"].dtype == half for n in scatters), "the reduce-scatter travels in half precision"
    if case.recompiles:  # the new shape's graph planned and sharded like the first
        assert len(ours.records) > 1, f"{name}: {len(ours.records)} compiled backward graph(s), expected a recompile"
    if case.backend == "inductor":
        record = ours.records[0]
        roles = [n.meta.get(ROLE_KEY) for n in record.graph.graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default]
        _assert_gathers_overlap_the_backward(record.generated_code, roles, name)


def _assert_gathers_overlap_the_backward(code: str | None, roles: list[str], name: str) -> None:
    """In inductor's code, the first bucket's all-gather is issued while later buckets'
    gradients are still being computed: a matmul of the backward (an update has none) runs
    between it and the last reduce-scatter. On gloo both are all-to-alls, in the code in the
    graph's order (the compiler keeps graphddp's order): ``roles``, in graph order, names them."""
    assert code is not None, f"{name}: no generated code recorded"
    lines = call_lines(code)
    collectives = [i for i, line in enumerate(lines) if "all_to_all_single.default(" in line and "=" in line]
    assert len(collectives) == len(roles), f"{name}: {len(collectives)} all-to-alls in the code, {len(roles)} in the graph"
    gathers = [i for i, r in zip(collectives, roles) if r == "all_gather"]
    scatters = [i for i, r in zip(collectives, roles) if r == "reduce_scatter"]
    assert runs_a_matmul(lines[gathers[0]:scatters[-1]]), (
        f"{name}: no compute between the first all-gather and the last reduce-scatter in inductor's code"
    )


def call_lines(code: str) -> list[str]:
    """The lines of inductor's generated ``call`` (the graph's body, in run order)."""
    return code[code.index("def call("):].splitlines()


def runs_a_matmul(lines: list[str]) -> bool:
    """Whether these generated lines run a backward or forward matmul (an update runs none)."""
    return any(line.strip().startswith(("extern_kernels.mm", "extern_kernels.addmm")) for line in lines)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_optimizer_matches_ddp_on_two_ranks(name: str) -> None:
    spawn(_train, 2, name)


@pytest.mark.parametrize("name", ["cnn_adamw", "mlp_sgd_nesterov_bf16_compress"])
def test_sharded_optimizer_matches_ddp_on_three_ranks(name: str) -> None:
    spawn(_train, 3, name)


# -- checkpoints across world sizes ---------------------------------------------------------------


def _save_two(rank: int, world: int, path: str) -> None:
    case = CASES["mlp_adamw"]
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    for step in range(2):
        step_both(case, ours, ours, (opt, sched), ref, (ref_opt, ref_sched), rank, step)
    full = graphddp.full_optimizer_state_dict(ours)
    plain = case.optimizer(copy.deepcopy(ref.module))
    plain.load_state_dict(full)  # loads into a plain torch.optim of the same class
    assert_state_dicts_equal(plain.state_dict(), ref_opt.state_dict(), TIGHT, "a plain optimizer loaded with the full state")
    if rank == 0:
        torch.save({"model": mine.state_dict(), "opt": full, "ref_opt": ref_opt.state_dict()}, path)


def _resume_three(rank: int, world: int, path: str) -> None:
    case = CASES["mlp_adamw"]
    saved = torch.load(path)
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    ours.module.load_state_dict(saved["model"])
    ref.module.load_state_dict(saved["model"])
    graphddp.load_full_optimizer_state_dict(ours, saved["opt"])
    ref_opt.load_state_dict(saved["ref_opt"])
    for step in range(2, 4):
        case.loss(ours, rank, step).backward()
        case.loss(ref, rank, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (n, p), q in zip(mine.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **TIGHT, msg=lambda m: f"resumed on 3 ranks, step {step}, {n}: {m}")
        _check_parts(mine, opt, world, rank, f"resumed step {step}")
    assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), TIGHT, "resumed on 3 ranks")


def test_full_optimizer_state_round_trips_from_two_ranks_to_three(tmp_path) -> None:
    path = os.path.join(tmp_path, "ckpt.pt")
    spawn(_save_two, 2, path)
    spawn(_resume_three, 3, path)
