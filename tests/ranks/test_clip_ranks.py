"""``max_grad_norm`` with the optimizer inside the backward against DDP + ``clip_grad_norm_`` +
the same ``torch.optim``, on 2 gloo ranks.

nanoGPT's loop with ``graphddp.compile(model, optimizer=opt, max_grad_norm=c)``: ranks start
from unequal parameters (both sides broadcast rank 0's), rank-dependent data, and one step made
of two micro-steps switched by ``require_backward_grad_sync`` (as nanoGPT sets it). DDP's side
clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and steps; ``c`` is small
enough that every step really clips (asserted on DDP's norm). After every step: parameters and
optimizer state equal DDP's (to float32 rounding), no gradient kept, and each graph updated in
the graph or after the backward as expected: in the graph when one graph makes every gradient,
after it (torch's clip and step) for the micro-steps' step, and for every step of a model with a
graph break (the norm spans two graphs), or whose tied weight is read on both sides of one.

``grad_norm_type`` (clip_grad_norm_'s ``norm_type``): 1, inf and 3 (2 is every other case above;
HF GPT-2's two cases above clip with 3 replicated and 1 sharded, their micro-steps included), each
against ``clip_grad_norm_(..., norm_type=p)`` with a bound DDP's norm exceeds, replicated,
``sharding="optimizer"`` (the parts' shares summed, or for inf maximised, across ranks) and
``"full"`` (the parts clipped before ``opt.step()``), on an MLP with SGD (its update moves with
the coefficient itself) and Hugging Face GPT-2 with AdamW.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from matrix_features import BF16_TOL
from matrix_models import _bert_batch, _hf_bert
from test_optim_ranks import ADAM_NOISE, TIGHT, _adamw, _gpt_loss, _hf_gpt2, _hf_loss, _sgd, assert_state_dicts_equal, unequal_pair

import graphddp
from graphddp import models
from graphddp.testing import spawn, update_runs
from graphddp.hooks.examples import ddp_bf16_compress_hook

MICRO_STEP = 2  # this step is two micro-steps, the first with require_backward_grad_sync=False
SHARDED = {"sharding": "optimizer"}


def _mlp_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return F.mse_loss(m(x), y)


def _mlp_loss_new_shape(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    """A batch of another size from step 2 on (``step`` is 10 x step + micro-step): Dynamo
    compiles the frame again, and the new graph clips and updates alone."""
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = 8 if step < 20 else 5
    x, y = torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    return F.mse_loss(m(x), y)


def _break_mlp_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return F.mse_loss(m(x), y)


def _bert_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    _, kwargs, _ = _bert_batch(rank, step, None)
    return m(**kwargs).loss


def _adamw_without_first(m: nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter but the first layer's (a bucket of their own at the cap
    below: its gradients are the user's, returned whole and kept)."""
    return torch.optim.AdamW(list(m.parameters())[2:], lr=1e-2, weight_decay=0.1)


def _adamw_without_last(m: nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter but the last layer's, which share a bucket with the layer
    before at the cap below."""
    return torch.optim.AdamW(list(m.parameters())[:-2], lr=1e-2, weight_decay=0.1)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    max_norm: float
    expect_runs: tuple  # per graph with an in-graph update: (steps updated in it, steps left to torch)
    fallback: str | None = None  # the reason records show, every step
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 4
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _adamw
    options: dict = dataclasses.field(default_factory=dict)  # more graphddp.compile options (sharding=)
    world: int = 2
    backend: str = "aot_eager"
    ddp_hook: Callable | None = None  # DDP's comm hook on the reference side (the same compression)
    norm_type: float = 2.0  # grad_norm_type here, clip_grad_norm_'s norm_type on DDP's side


CASES = {
    # The step after the micro-steps carries their gradients into the buckets: it clips in the graph too.
    "mlp_in_graph": Case(lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),)),
    # GPT-2 compiles for most of a case's time: its two cases here also take the norm types
    # NORM_CASES would give it (3 replicated, 1 sharded; inf fully sharded there), so that one
    # compile checks both; L2 on a Hugging Face model, micro-steps included: the BERT cases.
    "hf_gpt2_in_graph": Case(_hf_gpt2, _hf_loss, 0.1, ((4, 0),), tol=ADAM_NOISE, norm_type=3.0),
    "graph_break_after_backward": Case(models.GraphBreakMLP, _break_mlp_loss, 0.05, ((0, 4), (0, 4)), "clip spans graphs"),
    # The tied embedding's gradient comes from both graphs: neither updates in the graph. SGD:
    # Adam turns the rounding noise of the step after the micro-steps (averaged in two parts)
    # into full steps on the attention's key bias, whose true gradient is zero.
    "tied_across_break_after_backward": Case(
        lambda: models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8), _gpt_loss, 0.5, (), "shared", optimizer=_sgd
    ),
    # sharding="optimizer": each rank norms its parts of the reduce-scattered buckets, one
    # all-reduce of their squares gives the norm, then every part is updated and all-gathered.
    # The step after the micro-steps carries their gradients into its reduce-scatters: in the graph too.
    "mlp_sharded": Case(lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),), options=SHARDED),
    # A recompile is not a graph break: the older graph is an alternative, not part of the step.
    "mlp_sharded_recompile": Case(lambda: models.MLP(width=32, depth=4), _mlp_loss_new_shape, 0.05, ((2, 0), (2, 0)), options=SHARDED),
    "mlp_sharded_3_ranks": Case(lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),), options=SHARDED, world=3),
    "mlp_sharded_gather_forward_sgd": Case(
        lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),), optimizer=_sgd, options={**SHARDED, "gather": "forward"}
    ),
    # Under inductor: NORM_CASES' mlp_sharded_inductor (inf, in the graph) and test_grad_scaler_ranks.py's
    # sharded_mlp_adamw_clip_inductor (L2); a sharded no_sync carry under inductor: test_sharded.py's mlp_adamw_inductor.
    # bf16 on the wire: each rank norms its part of the decompressed average, as DDP's clip does the whole
    "mlp_sharded_bf16_compress": Case(
        lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),), tol=BF16_TOL,
        options={**SHARDED, "comm_hook": "bf16_compress"}, ddp_hook=ddp_bf16_compress_hook,
    ),
    # The backward starts at the compiled graph's own node (BERT's .loss comes out of the graph),
    # which torch's _will_engine_execute_node leaves out: the micro-steps still carry.
    "hf_bert_in_graph": Case(_hf_bert, _bert_loss, 0.5, ((4, 0),), tol=ADAM_NOISE),
    "hf_bert_sharded": Case(_hf_bert, _bert_loss, 0.5, ((4, 0),), tol=ADAM_NOISE, options=SHARDED),
    "hf_gpt2_sharded": Case(_hf_gpt2, _hf_loss, 5.0, ((4, 0),), tol=ADAM_NOISE, options=SHARDED, norm_type=1.0),
    # Gradients the optimizer does not hold stay whole (all-reduced, returned): in the norm once, and clipped.
    "mlp_sharded_partial_optimizer": Case(
        lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, ((4, 0),), optimizer=_adamw_without_first, options=SHARDED
    ),
    # ... and beside them in one bucket (the last layer's, left out): that bucket stays whole, so
    # the graph shards nothing (one norm over every gradient): torch clips, the shard steps, after.
    "mlp_sharded_mixed_bucket": Case(
        lambda: models.MLP(width=32, depth=4), _mlp_loss, 0.05, (), optimizer=_adamw_without_last, options=SHARDED
    ),
    "graph_break_sharded": Case(models.GraphBreakMLP, _break_mlp_loss, 0.05, ((0, 4), (0, 4)), "clip spans graphs", options=SHARDED),
}


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    mine, ref = unequal_pair(case.make, rank)
    if case.ddp_hook is not None:
        ref.register_comm_hook(None, case.ddp_hook)
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    ours = graphddp.compile(
        mine, optimizer=opt, max_grad_norm=case.max_norm, grad_norm_type=case.norm_type, backend=case.backend, bucket_cap_mb=0.004,
        **case.options,
    )
    sharded = case.options.get("sharding") == "optimizer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning: the records say it below
        for step in range(case.steps):
            micro = 2 if step == MICRO_STEP else 1
            for k in range(micro):  # nanoGPT's loop
                ours.require_backward_grad_sync = ref.require_backward_grad_sync = k == micro - 1
                case.loss(ours, rank, 10 * step + k).backward()
                case.loss(ref, rank, 10 * step + k).backward()
            norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), case.max_norm, norm_type=case.norm_type))
            assert norm > case.max_norm, f"{name} step {step}: DDP's norm {norm} does not exceed {case.max_norm}: nothing clipped"
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            if case.options.get("gather") == "forward":  # the next forward would write them
                ours.finish_gathers()
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            for (n, p), q in zip(mine.named_parameters(), ref.module.parameters()):
                if id(p) in held:
                    assert p.grad is None, f"{name} step {step}: {n}.grad kept"
                else:  # the user's gradient: averaged and clipped as clip_grad_norm_ left DDP's
                    torch.testing.assert_close(p.grad, q.grad, **case.tol, msg=lambda m: f"{name} step {step} {n}.grad: {m}")
                    p.grad = q.grad = None
                torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"{name} step {step} {n}: {m}")
            state = graphddp.full_optimizer_state_dict(ours) if sharded else opt.state_dict()
            assert_state_dicts_equal(state, ref_opt.state_dict(), case.tol, f"{name} step {step}")
    updating = [r for r in update_runs(ours) if sum(r)]
    assert tuple(updating) == case.expect_runs, f"{name}: (in-graph, after-backward) steps per graph {updating}"
    clipped = [s for s in ours.schedules if any(b.updates for b in s.buckets)]
    assert all(s.max_grad_norm == case.max_norm and s.grad_norm_type == case.norm_type for s in clipped)
    if case.fallback:
        assert all(case.fallback in r.fallbacks for r in ours.records if r.schedule.buckets), [r.fallbacks for r in ours.records]


@pytest.mark.parametrize("name", list(CASES))
def test_clipping_with_the_optimizer_inside_matches_ddp_clip_grad_norm_and_step(name: str) -> None:
    spawn(_train, CASES[name].world, name)


# -- grad_norm_type: clip_grad_norm_'s norm_type, in every mode that clips ---------------------------
INF = float("inf")


@dataclasses.dataclass(frozen=True)
class NormCase:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    max_norms: dict  # per norm type: small enough that every step clips (asserted on DDP's norm)
    options: dict = dataclasses.field(default_factory=dict)  # sharding=
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _sgd  # SGD: the update is proportional to the coefficient
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    in_graph: bool = True  # every step clipped and updated inside the backward (else by torch after it)
    steps: int = 3
    backend: str = "aot_eager"


MLP_NORMS = {1.0: 0.5, INF: 0.01, 3.0: 0.02}
NORM_CASES = {
    "mlp": NormCase(lambda: models.MLP(width=32, depth=4), _mlp_loss, MLP_NORMS),
    "mlp_sharded": NormCase(lambda: models.MLP(width=32, depth=4), _mlp_loss, MLP_NORMS, SHARDED),
    # inductor lowers the MAX all-reduce of the parts' largest |g| (inf), in the graph every step;
    # the SUM all-reduce of their squares (L2) in the graph under inductor: test_grad_scaler_ranks.py's
    # sharded_mlp_adamw_clip_inductor (its unscaled first and last steps clip and update inside).
    "mlp_sharded_inductor": NormCase(lambda: models.MLP(width=32, depth=4), _mlp_loss, {INF: 0.01}, SHARDED, backend="inductor"),
    "mlp_full": NormCase(lambda: models.MLP(width=32, depth=4), _mlp_loss, MLP_NORMS, {"sharding": "full"}, in_graph=False),
    # Two graphs make the step's gradients: torch's clip_grad_norm_(norm_type=) and step after the backward.
    "graph_break": NormCase(models.GraphBreakMLP, _break_mlp_loss, {1.0: 0.5, INF: 0.01}, in_graph=False),
    # GPT-2 compiles for most of a case's time: each mode takes one of the norms, each norm one
    # mode (the MLP takes every norm in every mode); 3 replicated and 1 sharded in CASES'
    # hf_gpt2_in_graph and hf_gpt2_sharded (the same checks, micro-steps besides).
    "hf_gpt2_full": NormCase(_hf_gpt2, _hf_loss, {INF: 0.05}, {"sharding": "full"}, optimizer=_adamw, tol=ADAM_NOISE, in_graph=False),
}


def _train_norms(rank: int, world: int, name: str) -> None:
    """Per norm type of the case, a fresh pair: graphddp with ``grad_norm_type=p`` against DDP,
    ``clip_grad_norm_(..., norm_type=p)`` and the same optimizer; parameters and optimizer
    state compared after every step."""
    case = NORM_CASES[name]
    full = case.options.get("sharding") == "full"
    for norm_type, max_norm in case.max_norms.items():
        what = f"{name} L{norm_type:g}"
        mine, ref = unequal_pair(case.make, rank)
        opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
        ours = graphddp.compile(
            mine, optimizer=opt, max_grad_norm=max_norm, grad_norm_type=norm_type, backend=case.backend, bucket_cap_mb=0.004,
            **case.options,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the graph break's fallback warning
            for step in range(case.steps):
                case.loss(ours, rank, step).backward()
                case.loss(ref, rank, step).backward()
                norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type))
                assert norm > max_norm, f"{what} step {step}: DDP's norm {norm} does not exceed {max_norm}: nothing clipped"
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
                whole = dict(ours.named_parameters()) if full else dict(mine.named_parameters())
                for n, q in ref.module.named_parameters():
                    torch.testing.assert_close(whole[n].detach(), q.detach(), **case.tol, msg=lambda m: f"{what} step {step} {n}: {m}")
                state = graphddp.full_optimizer_state_dict(ours) if case.options else opt.state_dict()
                assert_state_dicts_equal(state, ref_opt.state_dict(), case.tol, f"{what} step {step}")
        if full:  # the parts are clipped before opt.step(), which then steps them all
            assert ours.updates == {}, f"{what}: {ours.updates}"
            continue
        assert all(s.grad_norm_type == norm_type for s in ours.schedules if any(b.updates for b in s.buckets))
        runs = [r for r in update_runs(ours) if sum(r)]
        assert all(r == ((case.steps, 0) if case.in_graph else (0, case.steps)) for r in runs) and runs, f"{what}: {runs}"


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_every_norm_type_matches_ddp_clip_grad_norm_with_that_norm_type(name: str) -> None:
    spawn(_train_norms, 2, name)
