"""Hybrid sharding (``device_mesh=`` a 2-D mesh, dims ``("replicate", "shard")``) against DDP over every rank.

Each case trains graphddp on 4 ranks as 2 x 2 or 6 ranks as 3 x 2 with ``sharding="optimizer"``
or ``"full"`` next to ``DistributedDataParallel`` over all ranks with a plain optimizer of the
same class, from parameters that differ between ranks before wrapping, with rank-dependent
data and one ``no_sync`` micro-batch. After every step the parameters equal DDP's, so does the
full optimizer state (``graphddp.full_optimizer_state_dict``), and each rank holds 1/S of every
parameter's optimizer state (``"optimizer"``) or of every parameter and its state (``"full"``),
S the shard dim's size: the part :func:`graphddp.values.shards.part` gives its index in the
shard group. The compiled backward reduce-scatters over the shard group (S ranks) and
all-reduces each part over the replicate group: what :class:`graphddp.values.placement.Placement`
says, read from the graphs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE, TIGHT, _adamw, _hf_gpt2, _hf_loss, _sgd, assert_state_dicts_equal, step_beside_ddp, unequal_pair
from torch.distributed.device_mesh import init_device_mesh

import graphddp
from graphddp import models
from graphddp.optim.whole_state import ELEMENTWISE
from graphddp.testing import spawn
from graphddp.values.comm import ROLE_KEY, group_of, is_collective
from graphddp.values.placement import REPLICATE
from graphddp.values.shards import chunk, padded_part, part


def _mlp_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return F.mse_loss(m(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    sharding: str
    shape: tuple[int, int]  # (replicate, shard)
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 3
    max_grad_norm: float | None = None
    backend: str = "aot_eager"
    gather: str = "backward"
    backend_object: bool = False  # torch.compile(model, backend=graphddp.backend(model, ...)): the pipeline's form
    replicate_below_mb: float | None = None  # sharding="full": the parameters under it whole on every rank


CASES = {
    "optimizer_mlp_sgd_3x2": Case(models.MLP, _mlp_loss, _sgd, "optimizer", (3, 2)),
    "optimizer_mlp_adamw_2x2_clipped": Case(models.MLP, _mlp_loss, _adamw, "optimizer", (2, 2), max_grad_norm=0.05),
    "optimizer_mlp_adamw_2x2_gather_forward": Case(models.MLP, _mlp_loss, _adamw, "optimizer", (2, 2), gather="forward"),
    # The MLP with AdamW sharded on 2 x 2, unclipped, gathered in the backward, through the
    # pipeline's form only: graphddp.compile's form makes the same checks in the cases beside it.
    "optimizer_mlp_adamw_2x2_backend_object": Case(models.MLP, _mlp_loss, _adamw, "optimizer", (2, 2), backend_object=True),
    "full_mlp_sgd_3x2": Case(models.MLP, _mlp_loss, _sgd, "full", (3, 2)),
    # The biases and the last weight (1 KB) whole on every rank, all-reduced over all 4; the other
    # weights sharded over 2 and averaged over 2; the clip's norm counting each once.
    "full_mlp_adamw_2x2_clipped_small_whole": Case(models.MLP, _mlp_loss, _adamw, "full", (2, 2), max_grad_norm=0.05, replicate_below_mb=0.001),
    "full_hf_gpt2_adamw_2x2": Case(_hf_gpt2, _hf_loss, _adamw, "full", (2, 2), tol=ADAM_NOISE, steps=2),
    # The MLP with AdamW fully sharded on 2 x 2 under inductor only: every check here reads the
    # FX graphs and the values, the same under aot_eager.
    "full_mlp_adamw_2x2_inductor": Case(models.MLP, _mlp_loss, _adamw, "full", (2, 2), backend="inductor"),
}


def _check_state_parts(model: nn.Module, opt: torch.optim.Optimizer, shard: int, index: int, what: str) -> None:
    """Every elementwise state entry is this rank's part over the shard group (1/S), nothing else."""
    for name, p in model.named_parameters():
        lo, hi = part(p.numel(), shard, index)
        for k, v in opt.state.get(p, {}).items():
            if k in ELEMENTWISE:
                assert v.numel() == hi - lo, f"{what}: {name}[{k!r}] has {v.numel()} elements, its part over {shard} ranks {hi - lo}"


def _check_full_parts(ours: Any, mine: nn.Module, opt: torch.optim.Optimizer, ref: Any, ref_opt: Any, case: Case, what: str) -> None:
    """``sharding="full"``: the whole parameters (gathered) equal DDP's, each rank holds
    chunk(numel, S) elements of every parameter and of its elementwise state, and the whole
    optimizer state (gathered over the shard group) equals the reference optimizer's."""
    whole = dict(ours.named_parameters())
    for n, q in ref.module.named_parameters():
        torch.testing.assert_close(whole[n], q.detach(), **case.tol, msg=lambda m: f"{what} param {n}: {m}")
    shard = case.shape[1]
    for n, p in mine.named_parameters():
        held = ours.parts[n]
        size = held.numel if held.group is None else chunk(held.numel, shard)  # a parameter held whole (replicate_below_mb)
        assert (held.group is None) == (held.numel * 4 < (case.replicate_below_mb or 0) * 2**20), f"{what}: {n} held whole or not"
        assert p.dim() == 1 and p.numel() == size, f"{what}: {n} is held as {tuple(p.shape)}, not {size} elements"
        for k, v in opt.state.get(p, {}).items():
            if k in ELEMENTWISE:
                assert v.numel() == size, f"{what}: {n}[{k!r}] has {v.numel()} elements, its part over {shard} ranks {size}"
    assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), case.tol, what)


def _check_full_collectives(ours: Any, mesh: Any, what: str) -> None:
    """``sharding="full"``: every compiled graph's gathers and reduce-scatters (roles "gather",
    "reduce_scatter", graphddp.graph.part_collectives) on the shard group, and in each backward
    one all-reduce per reduce-scatter bucket, on the replicate group; the parameters held whole
    all-reduced (role "all_reduce") over every rank."""
    shard_name, replicate_name = mesh.get_group(1).group_name, mesh.get_group(0).group_name
    whole = [n for _, gm in ours.graphs for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == "all_reduce"]
    assert {group_of(n) for n in whole} <= {dist.group.WORLD.group_name}, what
    assert ours.graphs, what
    for kind, gm in ours.graphs:  # a graph between two graph breaks may read no parameter
        nodes = [n for n in gm.graph.nodes if is_collective(n)]
        parts = [n for n in nodes if n.meta.get(ROLE_KEY) in ("gather", "reduce_scatter")]
        assert {group_of(n) for n in parts} <= {shard_name}, f"{what} {kind}: {sorted({str(group_of(n)) for n in parts})}"
        scatters = [n for n in parts if n.meta.get(ROLE_KEY) == "reduce_scatter"]
        replicas = [n for n in nodes if n.meta.get(ROLE_KEY) == REPLICATE]
        assert len(replicas) == len(scatters), f"{what} {kind}: {len(replicas)} replicate all-reduces for {len(scatters)} reduce-scatter buckets"
        assert not replicas or {group_of(n) for n in replicas} == {replicate_name}, what
        held_whole = [n for n in nodes if n.meta.get(ROLE_KEY) == "all_reduce"]
        assert len(nodes) == len(parts) + len(replicas) + len(held_whole), f"{what} {kind}: other collectives {[n.name for n in nodes]}"
    backwards = [s.backward for s in ours.schedules if s.backward is not None]
    assert any(b.of("reduce_scatter") for b in backwards), f"{what}: no reduce-scatter bucket in a backward"


def _check_collectives(ours: Any, mesh: Any, what: str) -> None:
    """Reduce-scatters and all-gathers over the shard group, one all-reduce per sharded bucket over the replicate group."""
    shard_name, replicate_name = mesh.get_group(1).group_name, mesh.get_group(0).group_name
    nodes = [n for r in ours.records for n in r.graph.graph.nodes if n.op == "call_function"]
    replicas = [n for n in nodes if n.meta.get(ROLE_KEY) == REPLICATE]
    sharded = [b for s in ours.schedules for b in s.buckets if b.collective == "reduce_scatter"]
    assert sharded and len(replicas) == len(sharded), f"{what}: {len(replicas)} replicate all-reduces for {len(sharded)} sharded buckets"
    assert {group_of(n) for n in replicas} == {replicate_name}, what
    # Between shard groups (nodes) each bucket sends one part: 1/S of its elements, padded per parameter.
    shard = mesh.shape[1]
    sent = sum(n.args[0].meta["val"].numel() for n in replicas)
    assert sent == sum(chunk(s.numel, shard) for b in sharded for s in b.slots), what
    assert sent * shard < sum(b.numel for b in sharded) + shard * sum(len(b.slots) for b in sharded), what
    parts = [n for n in nodes if is_collective(n) and n.meta.get(ROLE_KEY) in ("reduce_scatter", "all_gather")]
    assert parts and {group_of(n) for n in parts} == {shard_name}, f"{what}: {sorted({str(group_of(n)) for n in parts})}"
    (placement,) = {s.placement for s in ours.schedules if s.placement is not None}
    assert placement.shape() == tuple(mesh.shape), what


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    mesh = init_device_mesh("cpu", case.shape, mesh_dim_names=("replicate", "shard"))
    mine, ref = unequal_pair(case.make, rank)
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    options = dict(
        optimizer=opt, sharding=case.sharding, device_mesh=mesh, backend=case.backend, bucket_cap_mb=0.004, max_grad_norm=case.max_grad_norm,
        **({"gather": case.gather} if case.sharding == "optimizer" else {}),
        **({"replicate_below_mb": case.replicate_below_mb} if case.replicate_below_mb is not None else {}),
    )
    if case.backend_object:
        made = graphddp.backend(mine, **options)
        model, ours = torch.compile(mine, backend=made), made
    else:
        model = ours = graphddp.compile(mine, **options)
    shard, index = case.shape[1], mesh.get_local_rank(1)
    full = case.sharding == "full"
    for step in range(case.steps):
        step_beside_ddp(ours, model, opt, ref, ref_opt, case.loss, rank, step, case.max_grad_norm)
        if full:
            _check_full_parts(ours, mine, opt, ref, ref_opt, case, f"{name} step {step}")
            continue
        if case.gather == "forward":  # the updated parameters are on the wire until the next forward
            ours.finish_gathers()
        for (n, p), q in zip(mine.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"{name} step {step} {n}: {m}")
        _check_state_parts(mine, opt, shard, index, f"{name} step {step}")
        assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), case.tol, f"{name} step {step}")
    if full:
        for k, v in ours.state_dict().items():
            torch.testing.assert_close(v, ref.module.state_dict()[k], **case.tol, msg=lambda m: f"{name} state_dict[{k!r}]: {m}")
        _check_full_collectives(ours, mesh, name)
        whole = ref.module.state_dict()
        ours.load_state_dict(whole)  # each rank keeps its part over the shard group
        for n, p in mine.named_parameters():
            cut = padded_part(whole[n], 1, 0) if ours.parts[n].group is None else padded_part(whole[n], shard, index)
            torch.testing.assert_close(p.detach(), cut, rtol=0, atol=0, msg=lambda m: f"{name} load {n}: {m}")
    else:
        _check_collectives(ours, mesh, name)
    dist.barrier()


def _train_each(rank: int, world: int, names: tuple[str, ...]) -> None:
    """The cases of one mesh shape, one after another on the same ranks (their start-up paid once)."""
    for name in names:
        torch._dynamo.reset()  # each case compiles from scratch, as in a process of its own
        _train(rank, world, name)


# The cases by mesh shape and model, so that each spawn of 4 or 6 ranks runs several.
GROUPS = {
    f"{shape[0]}x{shape[1]}_{family}": tuple(n for n, c in CASES.items() if c.shape == shape and (c.make is _hf_gpt2) == (family == "hf"))
    for shape in {c.shape for c in CASES.values()} for family in ("mlp", "hf")
}
GROUPS = {k: v for k, v in sorted(GROUPS.items()) if v}


@pytest.mark.parametrize("group", list(GROUPS))
def test_hybrid_sharding_trains_like_ddp_over_every_rank(group: str) -> None:
    names = GROUPS[group]
    shape = CASES[names[0]].shape
    spawn(_train_each, shape[0] * shape[1], names)
