"""``sharding="full", replicate_below_mb=``: the small parameters whole on every rank, the large ones sharded.

Each case trains graphddp next to ``DistributedDataParallel`` with a plain optimizer of the same
class, from parameters that differ between ranks before wrapping, with rank-dependent data and one
``no_sync`` micro-batch. After every step the whole parameters and the whole optimizer state equal
DDP's; each parameter below the threshold is held whole on every rank (its state too), each other
one as this rank's part. In the compiled graphs no parameter held whole is gathered, and each
backward all-reduces the whole parameters' gradients over every rank's group (role ``all_reduce``)
beside the parts' reduce-scatters.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE, TIGHT, _adamw, _hf_gpt2, _hf_loss, _sgd, assert_state_dicts_equal, step_beside_ddp, unequal_pair

import graphddp
from graphddp import models
from graphddp.config import MB
from graphddp.optim.whole_state import ELEMENTWISE
from graphddp.testing import spawn
from graphddp.values.comm import ROLE_KEY, group_of, is_collective
from graphddp.values.shards import chunk, padded_part


def _mlp_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return F.mse_loss(m(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g))


def _wide_mlp() -> nn.Module:
    return models.MLP(width=96)  # weights 6-36 KB, biases under 0.4 KB


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    below_mb: float
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 2
    max_grad_norm: float | None = None
    backend: str = "aot_eager"
    reshard: bool = True
    backend_object: bool = False  # torch.compile(model, backend=graphddp.backend(model, ...)): the pipeline's form


CASES = {
    # biases and the first weight (6 KB) whole, the 36 KB weights sharded: the reduces alternate
    # kinds; through graphddp.backend (the pipeline's form), clipped, without resharding
    "mlp_adamw_clipped_no_reshard": Case(_wide_mlp, _mlp_loss, _adamw, 0.01, max_grad_norm=0.05, reshard=False, backend_object=True),
    # GPT-2 of dim 32: every block's parameters whole, the embeddings (tied to the head) sharded
    "hf_gpt2_adamw": Case(_hf_gpt2, _hf_loss, _adamw, 0.0075, tol=ADAM_NOISE),
    "mlp_sgd_inductor": Case(_wide_mlp, _mlp_loss, _sgd, 0.01, backend="inductor"),
}


def _check_held(mine: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, below: int, world: int, what: str) -> set[str]:
    """Each parameter held whole (below ``below`` bytes) or as its part, its state alike; returns the whole ones' names."""
    held_whole = set()
    shapes = dict(ref.named_parameters())
    for n, p in mine.named_parameters():
        numel = shapes[n].numel()
        whole = numel * p.element_size() < below
        size = numel if whole else chunk(numel, world)
        assert p.dim() == 1 and p.numel() == size, f"{what}: {n} is held as {tuple(p.shape)}, not {size} elements"
        for k, v in opt.state.get(p, {}).items():
            if k in ELEMENTWISE:
                assert v.numel() == size, f"{what}: {n}[{k!r}] has {v.numel()} elements, not {size}"
        if whole:
            held_whole.add(n)
    return held_whole


def _check_collectives(ours: Any, whole_names: set[str], what: str) -> None:
    """No whole parameter gathered; each backward's all-reduce buckets on every rank's group,
    carrying the whole parameters' gradients, and its reduce-scatter buckets the others'."""
    world = dist.group.WORLD.group_name
    reduced: set[str] = set()
    for schedule in ours.schedules:
        for graph in schedule.graphs:
            for b in graph.of("gather"):
                assert not set(b.params) & whole_names, f"{what}: gather bucket {b.index} gathers {set(b.params) & whole_names}"
            for b in graph.of("all_reduce"):
                assert set(b.params) <= whole_names, f"{what}: all-reduce bucket {b.index} carries parts {set(b.params) - whole_names}"
                reduced |= set(b.params)
            for b in graph.of("reduce_scatter"):
                assert not set(b.params) & whole_names, f"{what}: reduce-scatter bucket {b.index} carries {set(b.params) & whole_names}"
    assert reduced == whole_names, f"{what}: all-reduced {sorted(reduced)}, held whole {sorted(whole_names)}"
    for kind, gm in ours.graphs:
        for n in gm.graph.nodes:
            if is_collective(n) and n.meta.get(ROLE_KEY) == "all_reduce":
                assert group_of(n) == world, f"{what} {kind}: {n.name} on {group_of(n)!r}"


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    mine, ref = unequal_pair(case.make, rank)
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    options = dict(optimizer=opt, sharding="full", replicate_below_mb=case.below_mb, backend=case.backend, bucket_cap_mb=0.004,
                   max_grad_norm=case.max_grad_norm, reshard_after_forward=case.reshard)
    if case.backend_object:
        made = graphddp.backend(mine, **options)
        model, ours = torch.compile(mine, backend=made), made
    else:
        model = ours = graphddp.compile(mine, **options)
    below = int(case.below_mb * MB)
    for step in range(case.steps):
        what = f"{name} step {step}"
        step_beside_ddp(ours, model, opt, ref, ref_opt, case.loss, rank, step, case.max_grad_norm)
        gathered = mine.state_dict() if case.backend_object else dict(ours.named_parameters())
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(gathered[n], q.detach(), **case.tol, msg=lambda m: f"{what} param {n}: {m}")
        assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), case.tol, what)
        whole_names = _check_held(mine, ref.module, opt, below, world, what)
    assert whole_names and len(whole_names) < len(list(mine.parameters())), f"{name}: held whole {sorted(whole_names)}"
    _check_collectives(ours, whole_names, name)
    holder = mine if case.backend_object else ours  # the pipeline's form: the module's own state dicts
    for k, v in holder.state_dict().items():
        torch.testing.assert_close(v, ref.module.state_dict()[k], **case.tol, msg=lambda m: f"{name} state_dict[{k!r}]: {m}")
    saved = ref.module.state_dict()
    holder.load_state_dict(saved)  # each rank keeps its part, or the whole parameter
    for n, p in mine.named_parameters():
        cut = padded_part(saved[n], 1, 0) if n in whole_names else padded_part(saved[n], world, rank)
        torch.testing.assert_close(p.detach(), cut, rtol=0, atol=0, msg=lambda m: f"{name} load {n}: {m}")
    dist.barrier()


def _train_each(rank: int, world: int, names: tuple[str, ...]) -> None:
    for name in names:
        torch._dynamo.reset()  # each case compiles from scratch, as in a process of its own
        _train(rank, world, name)


def test_small_parameters_held_whole_train_like_ddp() -> None:
    spawn(_train_each, 2, tuple(CASES))
