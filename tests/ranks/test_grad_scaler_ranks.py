"""fp16's loop, ``scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt);
scaler.update()``, with the optimizer inside (replicated, ``sharding="optimizer"``,
``sharding="full"``, both also hybrid on a 2 x 2 mesh) against DDP + the same ``torch.optim`` + the
same ``GradScaler``, on 2 gloo ranks (3 and 4 in some cases) (:mod:`graphddp.optim.scaled_step`).

The scaler runs on CPU (``GradScaler("cpu")``) with ``growth_interval=2``, so the scale grows
during the run. At one step rank 1 puts an ``inf`` into its gradient: into one element
(:class:`ProbedMLP`: with ``sharding="full"`` only rank 0's part holds it after the
reduce-scatter) or into every one (GPT-2's whole loss); both sides must skip that step on
every rank and halve the scale.
After every step: parameters, optimizer state, the scale and the growth tracker equal DDP's.
The first and the last step do not scale (the update inside the backward, around the scaled
ones); one step is two micro-steps switched by ``require_backward_grad_sync``; the scaler's
``unscale_`` is explicit on some steps and left to ``step`` on others; with ``max_grad_norm``
DDP's side calls ``clip_grad_norm_`` after ``unscale_``. Midway the scalers' ``state_dict()`` is
saved and loaded into fresh scalers, which carry on.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE, TIGHT, _adamw, _hf_gpt2, _hf_loss, _sgd, assert_state_dicts_equal
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn

STEPS = 7
INF_STEP = 3  # rank 1's loss is inf here: every rank skips
MICRO_STEP = 2  # two micro-steps
RESUME_STEP = 4  # the scalers are saved and loaded before this step
EXPLICIT_UNSCALE = (1, 3, 5)  # scaler.unscale_(opt) before scaler.step(opt) at these steps


class ProbedMLP(nn.Module):
    """An MLP that also returns its first weight's first element. A loss term ``c * probe`` puts
    ``c`` into that one element's gradient only: made ``inf`` on one rank, the averaged gradient
    holds it in one element, which with ``sharding="full"`` lies in rank 0's part alone, so only
    rank 0's own inf check finds it unless the ranks agree."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = models.MLP(width=32, depth=4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp(x), self.mlp[0].weight[0, 0] * 1.0  # not a view: computed in the graph


def _mlp_loss(m: nn.Module, rank: int, step: int, inf: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    out, probe = m(x)
    return F.mse_loss(out, y) + (float("inf") if inf else 0.0) * probe


def _gpt2_loss(m: nn.Module, rank: int, step: int, inf: bool) -> torch.Tensor:
    """The whole loss ``inf``: every gradient element of the rank."""
    return _hf_loss(m, rank, step) * (float("inf") if inf else 1.0)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int, bool], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _adamw
    options: dict = dataclasses.field(default_factory=dict)
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    backend: str = "aot_eager"
    sharded_scaler: bool = False  # FSDP's ShardedGradScaler on graphddp's side (DDP's: GradScaler)
    form: str = "compile"  # or "backend": torch.compile(model, backend=graphddp.backend(model, ...))
    scheduler: bool = False  # a StepLR made after graphddp attached the optimizer, stepped after each step
    user_clip: float | None = None  # both sides call clip_grad_norm_ after unscale_ (on the scaled steps)
    world: int = 2
    mesh: tuple[int, int] | None = None  # hybrid sharding: device_mesh=(replicate, shard) over ``world`` ranks


CASES = {
    "replicated_mlp_adamw": Case(ProbedMLP, _mlp_loss),
    "replicated_mlp_sgd_clip": Case(ProbedMLP, _mlp_loss, _sgd, {"max_grad_norm": 0.05}),
    # The scheduler wraps the attached opt.step, which GradScaler.step calls
    "replicated_mlp_sgd_backend_form_scheduler": Case(ProbedMLP, _mlp_loss, _sgd, form="backend", scheduler=True),
    "sharded_mlp_sgd_gather_forward": Case(ProbedMLP, _mlp_loss, _sgd, {"sharding": "optimizer", "gather": "forward"}),
    "replicated_hf_gpt2": Case(_hf_gpt2, _gpt2_loss, tol=ADAM_NOISE),
    # DDP's loop as written: unscale_, clip_grad_norm_, step, on the gradients the scaled step left in p.grad
    "replicated_mlp_sgd_user_clip": Case(ProbedMLP, _mlp_loss, _sgd, user_clip=0.05),
    "sharded_mlp_adamw_user_clip": Case(ProbedMLP, _mlp_loss, options={"sharding": "optimizer"}, user_clip=0.05),
    "sharded_mlp_adamw": Case(ProbedMLP, _mlp_loss, options={"sharding": "optimizer"}),
    "full_mlp_adamw": Case(ProbedMLP, _mlp_loss, options={"sharding": "full"}),
    "full_mlp_adamw_3_ranks": Case(ProbedMLP, _mlp_loss, options={"sharding": "full"}, world=3),
    "full_mlp_adamw_clip": Case(ProbedMLP, _mlp_loss, options={"sharding": "full", "max_grad_norm": 0.05}),
    # Hybrid sharding on 2 x 2: full sharding's parts of rank 1's inf reach ranks 0 and 2 only
    # (its shard group's reduce-scatter, then the replicate all-reduce), so ranks 1 and 3 skip
    # only through the inf check's agreement (seen failing agreed over the replicate group);
    # optimizer sharding's scaled step holds whole averaged gradients on every rank
    "hybrid_full_mlp_adamw_2x2": Case(ProbedMLP, _mlp_loss, options={"sharding": "full"}, world=4, mesh=(2, 2)),
    "hybrid_sharded_mlp_adamw_2x2": Case(ProbedMLP, _mlp_loss, options={"sharding": "optimizer"}, world=4, mesh=(2, 2)),
    # An FSDP user's scaler: its own scale and unscale_ (which all-reduces the flag itself), GradScaler's step
    "full_mlp_adamw_sharded_grad_scaler": Case(ProbedMLP, _mlp_loss, options={"sharding": "full"}, sharded_scaler=True),
    # SGD: Adam turns the rounding noise of the attention's key bias (true gradient zero), summed
    # in another order by the reduce-scatter, into full steps
    "full_hf_gpt2_sgd": Case(_hf_gpt2, _gpt2_loss, _sgd, options={"sharding": "full"}, tol=ADAM_NOISE),
    # inductor: the variants without the update compiled by it, clipping after unscale_ (the
    # same case under aot_eager checked nothing more: every check reads values and records)
    "sharded_mlp_adamw_clip_inductor": Case(ProbedMLP, _mlp_loss, options={"sharding": "optimizer", "max_grad_norm": 0.05}, backend="inductor"),
}


def _scaler(sharded: bool = False) -> torch.amp.GradScaler:
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _step(case: Case, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
          rank: int, step: int, clip: Callable[[], None] | None, switch: object) -> None:
    """One step of the loop; ``switch`` holds ``require_backward_grad_sync``."""
    micro = 2 if step == MICRO_STEP else 1
    for k in range(micro):
        switch.require_backward_grad_sync = k == micro - 1
        loss = case.loss(model, rank, 10 * step + k, step == INF_STEP and rank == 1)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is None:
        if clip is not None and not case.user_clip:  # clipping p.grad is refused where the update runs inside
            clip()
        opt.step()
    else:
        if step in EXPLICIT_UNSCALE or clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            clip()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    base = case.make()
    mine = copy.deepcopy(base)
    ref = DDP(copy.deepcopy(base))
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    options = dict(optimizer=opt, backend=case.backend, bucket_cap_mb=0.004, **case.options)
    if case.mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        options["device_mesh"] = init_device_mesh("cpu", case.mesh, mesh_dim_names=("replicate", "shard"))
    if case.form == "backend":
        view = graphddp.backend(mine, **options)
        ours = torch.compile(mine, backend=view)
    else:
        ours = view = graphddp.compile(mine, **options)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (opt, ref_opt)] if case.scheduler else []
    max_norm = case.options.get("max_grad_norm") or case.user_clip
    norms: list[float] = []
    ref_clip = (lambda: norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))) if max_norm else None
    our_clip = (lambda: torch.nn.utils.clip_grad_norm_(ours.parameters(), case.user_clip)) if case.user_clip else None
    scaler, ref_scaler = _scaler(case.sharded_scaler), _scaler()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(STEPS):
            scaled = 0 < step < STEPS - 1
            if step == RESUME_STEP:  # a checkpoint of the scalers, resumed by fresh ones
                saved, ref_saved = scaler.state_dict(), ref_scaler.state_dict()
                scaler, ref_scaler = _scaler(case.sharded_scaler), _scaler()
                scaler.load_state_dict(saved)
                ref_scaler.load_state_dict(ref_saved)
            before = ref_scaler.get_scale()
            _step(case, ours, opt, scaler if scaled else None, rank, step, our_clip, view)
            _step(case, ref, ref_opt, ref_scaler if scaled else None, rank, step, ref_clip, ref)
            for scheduler in schedulers:
                scheduler.step()
            what = f"{name} step {step}"
            if step == INF_STEP:
                assert scaler.get_scale() == ref_scaler.get_scale() == before / 2, f"{what}: the inf did not halve the scale"
            assert scaler.state_dict() == ref_scaler.state_dict(), f"{what}: {scaler.state_dict()} vs {ref_scaler.state_dict()}"
            whole, theirs = view.state_dict() if case.form == "compile" else mine.state_dict(), ref.module.state_dict()
            assert whole.keys() == theirs.keys(), what
            for n, q in theirs.items():
                torch.testing.assert_close(whole[n], q, **case.tol, msg=lambda m: f"{what} {n}: {m}")
            assert all(p.grad is None for p in mine.parameters()), f"{what}: a gradient kept"
            state = graphddp.full_optimizer_state_dict(view) if case.form == "compile" else opt.state_dict()
            assert_state_dicts_equal(state, ref_opt.state_dict(), case.tol, what)
    assert not max_norm or any(max_norm < n < float("inf") for n in norms), f"{name}: DDP's norms {norms}: nothing clipped"
    assert ref_scaler.get_scale() > 2.0**10, "the scale grew past its start after the skipped step"
    steps = ref_opt.state_dict()["state"][0].get("step")
    assert steps is None or float(steps) == STEPS - 1, f"{name}: the skipped step was taken ({steps})"


@pytest.mark.parametrize("name", list(CASES))
def test_a_grad_scaler_around_the_optimizer_inside_matches_ddp(name: str) -> None:
    spawn(_train, CASES[name].world, name)
