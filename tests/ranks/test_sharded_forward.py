"""``sharding="optimizer", gather="forward"`` against DDP + the same torch.optim on gloo ranks.

Each step's all-gathers complete in the next forward, so the parameters are compared where
they are promised to be right: after each forward (the updates of the step before, against
DDP's parameters before its step), and after every read the docs name between steps
(``state_dict()``, the module's ``parameters()``, an evaluation forward under ``no_grad``,
``finish_gathers()``). Ranks start
unequal, an LR scheduler steps, one ``no_sync`` micro-batch; a recompile, a graph break with a
tied embedding, Hugging Face GPT-2, inductor (its generated forward waits for the first layers
before the last layers' gather), 3 ranks; and a ``load_state_dict`` between a backward and the
next forward, which the pending all-gathers must not overwrite.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from test_optim_ranks import TIGHT, start_unequal
from test_sharded import CASES, Case, call_lines, runs_a_matmul

import graphddp
from graphddp.testing import spawn

FORWARD_CASES = {
    "mlp_adamw": CASES["mlp_adamw"],
    "mlp_sgd_nesterov": CASES["mlp_sgd_nesterov"],
    "tied_across_break_sgd": CASES["tied_across_break_sgd"],
    "hf_gpt2_adamw": CASES["hf_gpt2_adamw"],
    "mlp_adamw_recompile": CASES["mlp_adamw_recompile"],
    "mlp_adamw_inductor": CASES["mlp_adamw_inductor"],
}


def _assert_params(mine: nn.Module, ref: nn.Module, tol: dict, what: str) -> None:
    for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **tol, msg=lambda m: f"{what} {n}: {m}")


def _train(rank: int, world: int, name: str) -> None:
    case: Case = FORWARD_CASES[name]
    mine, ref, opt, ref_opt = start_unequal(case, rank)
    ours = graphddp.compile(mine, optimizer=opt, sharding="optimizer", gather="forward", backend=case.backend, bucket_cap_mb=0.004)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    gathers = ours._state.step.gathers
    for step in range(case.steps):
        if step == case.no_sync_step:
            with ours.no_sync():
                case.loss(ours, rank, 50 + step).backward()
            with ref.no_sync():
                case.loss(ref, rank, 50 + step).backward()
        loss = case.loss(ours, rank, step)  # completes the step before's all-gathers
        _assert_params(mine, ref.module, case.tol, f"{name}: after step {step}'s forward")
        before = [p.detach().clone() for p in mine.parameters()]
        loss.backward()
        # Until the next forward writes them, the parameters whose all-gathers are pending hold
        # the previous step's values, on every rank alike: no compiler pass folded the update
        # into them (graph.trace.fresh_copy). (Those on a fallback, such as after no_sync, took
        # torch's step at the end of the backward: nothing pending for them.)
        pending = {n for p in gathers._pending.values() for n in p.names}
        held = [(n, p, old) for (n, p), old in zip(mine.named_parameters(), before) if n in pending]
        assert held or step == case.no_sync_step, f"{name} step {step}: no pending parameter to check"
        for n, p, old in held:
            assert torch.equal(p.detach(), old), f"{name} step {step}: the backward wrote {n}"
        case.loss(ref, rank, step).backward()
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            o.zero_grad()
            s.step()
        assert all(p.grad is None for p in mine.parameters()), f"{name} step {step}: a gradient kept"
        if step == case.steps - 1:  # the module's parameters() (an EMA, a norm) see the updated values
            pending = bool(gathers)
            assert pending or step == case.no_sync_step, f"{name}: nothing pending after the last backward"
            ours.zero_grad()
            assert bool(gathers) == pending, f"{name}: zero_grad() completed the all-gathers"
            for (n, p), q in zip(ours.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"{name}: ours.named_parameters() {n}: {m}")
            assert not gathers, f"{name}: parameters() left all-gathers pending"
        if step == 1:  # a checkpoint between steps holds the updated values
            state = ours.state_dict()
            for k, v in ref.module.state_dict().items():
                torch.testing.assert_close(state[k], v, **case.tol, msg=lambda m: f"{name}: state_dict() after step 1, {k}: {m}")
    assert gathers.taken >= 1, f"{name}: no forward took its all-gathers in its graph"
    with torch.no_grad():  # an evaluation forward after the last backward sees the updated values
        out, expected = case.loss(ours, rank, 99), case.loss(ref.module, rank, 99)
    torch.testing.assert_close(out, expected, **case.tol)
    ours.finish_gathers()
    _assert_params(mine, ref.module, case.tol, f"{name}: at the end")
    if case.backend == "inductor":
        _assert_waits_spread(ours._state.backend.forwards[0].slot_code, "forward", "its first and its last bucket's wait")
        _assert_waits_spread(ours.records[0].generated_code, "backward", "its first and its last reduce-scatter's wait")


def _assert_waits_spread(code: str | None, which: str, where: str) -> None:
    """In inductor's code a matmul runs between the first and the last wait: the forward does
    not wait for every bucket's all-gather before computing, nor the backward for every
    reduce-scatter at its end (inductor's own comm and locality passes did both: graphddp
    compiles these graphs in its own order, compiler.inductor.pinned_config)."""
    assert code is not None, f"no generated code of the {which}"
    lines = call_lines(code)
    waits = [i for i, line in enumerate(lines) if "wait_tensor.default(" in line]
    assert len(waits) >= 2, f"inductor's {which} waits for each bucket"
    assert runs_a_matmul(lines[waits[0]:waits[-1]]), f"inductor's {which} runs no matmul between {where}"


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_gather_in_forward_matches_ddp_on_two_ranks(name: str) -> None:
    spawn(_train, 2, name)


def test_gather_in_forward_matches_ddp_on_three_ranks() -> None:
    spawn(_train, 3, "mlp_adamw")


def _load_between_steps(rank: int, world: int, _: Any) -> None:
    """A checkpoint loaded after a backward and before the next forward is what that forward
    reads: the pending all-gathers are completed first, not written over it."""
    case = CASES["mlp_adamw"]
    mine, ref, opt, ref_opt = start_unequal(case, rank)
    ours = graphddp.compile(mine, optimizer=opt, sharding="optimizer", gather="forward", backend="aot_eager", bucket_cap_mb=0.004)
    saved = copy.deepcopy(ref.module.state_dict())  # the start
    for step in range(2):
        case.loss(ours, rank, step).backward()
    mine.load_state_dict(saved)  # through the wrapped module, not the graphddp one
    with torch.no_grad():
        torch.testing.assert_close(case.loss(ours, rank, 7), case.loss(ref.module, rank, 7), **TIGHT)
    _assert_params(mine, ref.module, TIGHT, "after load_state_dict and a forward")


def test_load_state_dict_between_steps_is_not_overwritten() -> None:
    spawn(_load_between_steps, 2, None)


def _one_rank_saves(rank: int, world: int, _: Any) -> None:
    """Rank 0 alone calls ``state_dict()`` between a backward and the next forward, as training
    scripts save checkpoints, and then every rank all-reduces its loss for the log: rank 0 gets
    the updated values, and the log's all-reduce meets the others' (completing the pending
    all-gathers is a wait, never a collective the other ranks would have to join)."""
    case = CASES["mlp_adamw"]
    mine, ref, opt, ref_opt = start_unequal(case, rank)
    ours = graphddp.compile(mine, optimizer=opt, sharding="optimizer", gather="forward", backend="aot_eager", bucket_cap_mb=0.004)
    for step in range(2):
        case.loss(ours, rank, step).backward()
        case.loss(ref, rank, step).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if rank == 0:
            state = ours.state_dict()
            for k, v in ref.module.state_dict().items():
                torch.testing.assert_close(state[k], v, **case.tol, msg=lambda m: f"rank 0's state_dict() after step {step}, {k}: {m}")
        logged = torch.tensor([float(rank + 1)])  # then every rank averages its loss for the log
        torch.distributed.all_reduce(logged)
        assert logged.item() == world * (world + 1) / 2, f"step {step}: the log's all-reduce met another collective"
    with torch.no_grad():
        torch.testing.assert_close(case.loss(ours, rank, 7), case.loss(ref.module, rank, 7), **case.tol)
    _assert_params(mine, ref.module, case.tol, "after rank 0 alone saved")


def test_one_rank_saving_between_steps_neither_hangs_nor_sees_old_values() -> None:
    spawn(_one_rank_saves, 2, None, timeout=120.0, pg_timeout=20.0, fresh=True)
