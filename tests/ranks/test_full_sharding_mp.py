"""Full sharding with a mixed-precision policy against FSDP2 with the same policy.

``graphddp.compile(model, optimizer=opt, sharding="full", mp_policy=MixedPrecisionPolicy(...))``
takes FSDP2's own policy object with FSDP2's meaning, so the reference is FSDP2: ``fully_shard``
with the same policy (each transformer block, then the root) and the same optimizer, on the same
gloo ranks, from the same parameters, with rank-dependent data. Both compute in ``param_dtype``
from parameters cast before they are gathered and reduce their gradients in ``reduce_dtype``;
the parts and the optimizer state stay fp32. After every step the losses and the whole
parameters agree to what bf16 compute allows; the compiled graphs show the bytes: every gather
sends ``param_dtype``, every reduce-scatter ``reduce_dtype``. HF GPT-2's case runs
``sharding="auto"`` with the policy: it weighs full sharding's placements only and trains in the one it chose.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn as nn
from test_optim_ranks import _hf_gpt2, _hf_loss, _sgd, _tokens
from test_sharded import _mlp_loss
from torch.distributed.device_mesh import init_device_mesh

import graphddp
from graphddp import models
from graphddp.testing import spawn
from graphddp.values.comm import ROLE_KEY
from graphddp.values.placement import REPLICATE

ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default  # gloo: gathers and reduce-scatters
BF16 = {"atol": 2e-4, "rtol": 2e-3}  # SGD: a bf16 rounding of a gradient is lr * 2^-8 of it


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    reduce_dtype: torch.dtype | None  # None: param_dtype's (FSDP2's default)
    backend: str = "aot_eager"
    reshard: bool = True
    steps: int = 3
    mesh: tuple[int, int] | None = None  # hybrid sharding: (replicate, shard), for both sides
    auto: bool = False  # graphddp's sharding="auto" with the policy: it weighs full sharding's placements only


CASES = {
    "mlp_bf16_reduce_fp32": Case(models.MLP, _mlp_loss, torch.float32),
    "mlp_bf16_reduce_bf16_kept": Case(models.MLP, _mlp_loss, None, reshard=False),
    "hf_gpt2_bf16_reduce_fp32_auto": Case(_hf_gpt2, _hf_loss, torch.float32, auto=True),
    "mlp_bf16_reduce_fp32_inductor": Case(models.MLP, _mlp_loss, torch.float32, backend="inductor", steps=2),
    "mlp_bf16_reduce_fp32_hybrid_2x2": Case(models.MLP, _mlp_loss, torch.float32, mesh=(2, 2)),
}

THREE_RANKS = "mlp_bf16_reduce_fp32"


def _policy(case: Case):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=case.reduce_dtype)


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    return list(blocks) if blocks is not None else []


def _train(rank: int, world: int, name: str) -> None:
    from torch.distributed.fsdp import fully_shard

    case = CASES[name]
    mesh = None if case.mesh is None else init_device_mesh("cpu", case.mesh, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    base = case.make()
    mine, ref = copy.deepcopy(base), copy.deepcopy(base)
    for block in _blocks(ref):
        fully_shard(block, mesh=mesh, mp_policy=_policy(case), reshard_after_forward=case.reshard)
    fully_shard(ref, mesh=mesh, mp_policy=_policy(case), reshard_after_forward=case.reshard)
    opt, ref_opt = _sgd(mine), _sgd(ref)
    # small buckets (4 KB): the forward keeps only the backward's first one, so the backward
    # gathers the rest again, cast to bf16 as in the forward
    placement = {"sharding": "auto", "example": {"input_ids": _tokens(0, 0), "labels": _tokens(0, 0)}} if case.auto else \
        {"sharding": "full", "reshard_after_forward": case.reshard}
    ours = graphddp.compile(mine, optimizer=opt, backend=case.backend, device_mesh=mesh, mp_policy=_policy(case),
                            bucket_cap_mb=4 / 1024, **placement)
    if case.auto:
        weighed = [c.name for c in ours.placement_choice.candidates]
        assert ours.config.sharding == "full" and all(n.startswith("sharding='full'") for n in weighed), ours.placement_choice.to_table()
    for step in range(case.steps):
        losses = []
        for m, o in ((ours, opt), (ref, ref_opt)):
            loss = case.loss(m, rank, step)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-2 * abs(losses[1]), f"{name} step {step}: loss {losses[0]} vs FSDP2's {losses[1]}"
        whole = dict(ours.named_parameters())
        for n, q in ref.named_parameters():
            torch.testing.assert_close(whole[n], q.full_tensor().detach(), **BF16, msg=lambda m: f"{name} step {step} param {n}: {m}")
    if isinstance(base, models.MLP):  # fp32 inputs cast (cast_forward_inputs), computed in bf16
        with torch.no_grad():
            assert ours(torch.randn(2, 16)).dtype == torch.bfloat16, f"{name}: the forward did not compute in bf16"
    for p in mine.parameters():
        assert p.dtype == torch.float32, f"{name}: a part is held in {p.dtype}, not the parameter's fp32"
    sent = {"gather": set(), "reduce_scatter": set()}
    regathers = 0
    for kind, g in ours.graphs:
        for n in g.graph.nodes:
            if n.meta.get(ROLE_KEY) == REPLICATE:
                assert n.args[0].meta["val"].dtype == case.reduce_dtype, f"{name}: a replicate all-reduce sent {n.args[0].meta['val'].dtype}"
            if n.target is ALL_TO_ALL and n.meta.get(ROLE_KEY) in sent:
                sent[n.meta[ROLE_KEY]].add(n.args[0].meta["val"].dtype)
                regathers += kind == "backward" and n.meta[ROLE_KEY] == "gather"
    reshard = ours.config.reshard_after_forward
    assert (regathers > 0) == reshard, f"{name}: {regathers} gathers in the backward with reshard_after_forward={reshard}"
    assert sent["gather"] == {torch.bfloat16}, f"{name}: gathers sent {sent['gather']}, not bf16"
    assert sent["reduce_scatter"] == {case.reduce_dtype or torch.bfloat16}, f"{name}: reduce-scatters sent {sent['reduce_scatter']}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.mesh is None and n != THREE_RANKS])
def test_full_sharding_with_a_policy_matches_fsdp2_on_two_ranks(name: str) -> None:
    spawn(_train, 2, name)


def test_full_sharding_with_a_policy_matches_fsdp2_on_three_ranks() -> None:
    """Uneven parts; even ones, with the same policy, are the inductor case's on two ranks."""
    spawn(_train, 3, THREE_RANKS)


def test_hybrid_full_sharding_with_a_policy_matches_fsdp2_hsdp() -> None:
    """A 2-D mesh on both sides: FSDP2's HSDP and graphddp's hybrid sharding, the part
    gradients all-reduced over the replicate group in ``reduce_dtype`` too."""
    case = CASES["mlp_bf16_reduce_fp32_hybrid_2x2"]
    spawn(_train, case.mesh[0] * case.mesh[1], "mlp_bf16_reduce_fp32_hybrid_2x2")
