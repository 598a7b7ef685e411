"""``sharding="auto"`` on 2 gloo ranks (its budget case on 3): the placement chosen at wrap time from a trace of
``example=``, the same on every rank, and trained like DDP over every rank.

A budget only full sharding's predicted peak fits (read off an unbounded choice of the same
model) makes it choose full sharding, which then trains a GPT with tied weights and a graph
break like DDP (SGD with momentum), on 3 ranks (uneven parts; that GPT fully sharded on 2 ranks:
test_full_sharding.py's tied_across_break_sgd); an
unbounded choice trains an MLP like DDP with AdamW whatever it chose; a budget nothing fits fails on every
rank at wrap time with the smallest predicted peak, before any rank builds a placement. A second
run of the same wrap keeps the first's choice, and not where the ranks' stores disagree.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_optim_ranks import TIGHT, _adamw, _gpt_loss, _sgd, _tokens, unequal_pair

import graphddp
from graphddp import models
from graphddp.plan.cost import CostModel
from graphddp.testing import spawn


def _mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _same_on_every_rank(value: object) -> None:
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    assert len(set(seen)) == 1, seen


def _train_like_ddp(make, loss, example, optimizer, steps: int, rank: int, **options) -> object:
    mine, ref = unequal_pair(make, rank)
    opt, ref_opt = optimizer(mine), optimizer(ref.module)
    ours = graphddp.compile(mine, optimizer=opt, sharding="auto", example=example, backend="aot_eager", **options)
    for step in range(steps):
        loss(ours, rank, step).backward()
        opt.step()
        opt.zero_grad()
        loss(ref, rank, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if ours.config.sharding == "optimizer" and ours.config.gather == "forward":
            ours.finish_gathers()
        whole = dict(ours.named_parameters()) if ours.config.sharding == "full" else dict(mine.named_parameters())
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(whole[n].detach(), q.detach(), **TIGHT, msg=lambda m: f"step {step} {n}: {m}")
    return ours


def _full_sharding_when_only_it_fits(rank: int, world: int, steps: int = 3) -> None:
    gpt = lambda: models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8)  # noqa: E731
    gpt_example = _tokens(0, 0)
    probe = gpt()
    unbounded = graphddp.compile(probe, optimizer=_sgd(probe), sharding="auto", example=gpt_example, backend="aot_eager").placement_choice
    least = min(c.peak_bytes for c in unbounded.candidates)
    fitting = {c.name for c in unbounded.candidates if c.peak_bytes == least}
    assert all(n.startswith("sharding='full'") for n in fitting), unbounded.to_table()
    ours = _train_like_ddp(gpt, _gpt_loss, gpt_example, _sgd, steps, rank, memory_budget=least)
    assert ours.placement_choice.chosen in fitting and ours.config.sharding == "full", ours.placement_choice.to_table()
    assert all(s.choice == ours.placement_choice for s in ours.schedules)
    _same_on_every_rank(ours.placement_choice.fingerprint())


def _cases(rank: int, world: int) -> None:
    mlp_loss = lambda m, r, s: F.mse_loss(m(_mlp_batch(r, s)[0]), _mlp_batch(r, s)[1])  # noqa: E731
    ours = _train_like_ddp(models.MLP, mlp_loss, (_mlp_batch(0, 0)[0],), _adamw, 3, rank)
    _same_on_every_rank((ours.placement_choice.chosen, ours.config.sharding))

    mlp = models.MLP()
    with pytest.raises(ValueError, match=r"memory_budget=64 bytes .*the smallest predicted peak is sharding='full'"):
        graphddp.compile(mlp, optimizer=_adamw(mlp), sharding="auto", example=(_mlp_batch(0, 0)[0],), backend="aot_eager", memory_budget=64)
    with pytest.raises(ValueError, match="sharding='auto' needs example="):
        graphddp.compile(models.MLP(), sharding="auto")
    dist.barrier()
    _a_second_run_keeps_the_first_runs_choice(rank)


def _a_second_run_keeps_the_first_runs_choice(rank: int) -> None:
    """Runs told apart by their stores only: the cost model given (no link or compute timed; a
    slow link, so that three placements are predicted within the tie band), so every run predicts alike."""
    from graphddp.runtime import choice_store

    def wrap(store: str) -> object:
        choice_store._path = lambda key: os.path.join(store, f"choice-{key}.json")
        mlp = models.MLP()
        return graphddp.compile(mlp, optimizer=_adamw(mlp), sharding="auto", example=(_mlp_batch(0, 0)[0],), backend="aot_eager",
                                cost=CostModel(bandwidth_gbps=0.1)).placement_choice

    def store(where: str, name: str) -> None:
        (stored,) = [f for f in os.listdir(shared[0]) if f.startswith("choice-")]  # not another rank's .tmp- file mid-write
        with open(os.path.join(where, stored), "w") as f:
            json.dump({"chosen": name}, f)

    saved = choice_store._path
    shared: list[object] = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared)
    try:
        first, second = wrap(shared[0]), wrap(shared[0])
        assert "earlier" not in first.winner.verdict, first.to_table()
        assert second.chosen == first.chosen and "earlier run" in second.winner.verdict, second.to_table()
        in_band = [c.name for c in first.candidates if "within" in c.verdict and c.name != first.chosen]
        assert len(in_band) >= 2, first.to_table()
        dist.barrier()
        if rank == 0:
            store(shared[0], in_band[0])  # an earlier run chose another placement the band holds: kept
        dist.barrier()
        assert wrap(shared[0]).chosen == in_band[0]
        mine = tempfile.mkdtemp()
        store(mine, in_band[rank % 2])  # each rank's store names another: none kept
        disagreed = wrap(mine)
        assert disagreed.chosen == first.chosen and "earlier" not in disagreed.winner.verdict, disagreed.to_table()
        if rank == 1:  # caches off on one rank: it holds no choice, but agrees (no hang), so none is kept
            os.environ["GRAPHDDP_COMPILE_CACHE"] = "0"
        try:
            off = wrap(shared[0])
        finally:
            os.environ.pop("GRAPHDDP_COMPILE_CACHE", None)
        assert off.chosen == first.chosen and "earlier" not in off.winner.verdict, off.to_table()
        # HF GPT-2 from its config, each rank's own keyword batch (the same shapes: the same key)
        gpt2 = os.path.join(shared[0], "gpt2")
        runs = []
        for _ in range(2):
            choice_store._path = lambda key: os.path.join(gpt2, f"choice-{key}.json")
            hf = models.tiny_hf_gpt2()
            runs.append(graphddp.compile(hf, optimizer=_adamw(hf), sharding="auto", example=models.tiny_hf_gpt2_batch(rank, 0),
                                         backend="aot_eager", cost=CostModel(bandwidth_gbps=0.1)).placement_choice)
        assert runs[1].chosen == runs[0].chosen and "earlier run" in runs[1].winner.verdict, runs[1].to_table()
        _same_on_every_rank(runs[1].fingerprint())
    finally:
        choice_store._path = saved
    dist.barrier()


def test_auto_chooses_the_same_placement_on_every_rank_and_trains_like_ddp() -> None:
    spawn(_cases, 2)


def test_on_three_ranks_a_budget_only_full_sharding_fits_chooses_it_and_trains_like_ddp() -> None:
    spawn(_full_sharding_when_only_it_fits, 3, 2)
