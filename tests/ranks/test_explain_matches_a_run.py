"""explain's plan for 2 ranks equals the plan a real 2-rank run makes (fingerprints): the
replicated plan, and full sharding's schedule (read back from the compiled graphs, explain's
under a fake group that lowers collectives as NCCL does, the run's on gloo)."""
from __future__ import annotations

import torch

import graphddp
from graphddp.models import MLP, TinyGPT
from graphddp.testing import spawn

CAPS = dict(bucket_cap_mb=0.02, first_bucket_cap_mb=0.005)


def _mlp_inputs():
    torch.manual_seed(0)
    return MLP(width=64, depth=6), (torch.randn(8, 16),)


def _real_run(rank: int, world: int, expected: str) -> None:
    torch.manual_seed(0)
    model, inputs = _mlp_inputs()
    compiled = graphddp.compile(model, backend="aot_eager", **CAPS)
    compiled(*inputs).sum().backward()
    assert compiled.schedules[0].fingerprint() == expected  # explain == real run


def test_explain_matches_a_real_run():
    model, inputs = _mlp_inputs()
    (planned,) = graphddp.explain(model, *inputs, world_size=2, backend="aot_eager", **CAPS)
    spawn(_real_run, 2, planned.fingerprint())


def _gpt_inputs():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16), (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)),)


FULL = dict(sharding="full", backend="aot_eager", bucket_cap_mb=0.004)


def _full_run(rank: int, world: int, planned) -> None:
    model, inputs = _gpt_inputs()
    opt = torch.optim.AdamW(model.parameters())
    compiled = graphddp.compile(model, optimizer=opt, **FULL)
    compiled(*inputs).float().sum().backward()
    opt.step()
    (ran,) = compiled.schedules
    assert ran.fingerprint() == planned.fingerprint(), f"explain:\n{planned.to_table()}\nrun:\n{ran.to_table()}"
    assert ran.memory == planned.memory, (ran.memory, planned.memory)


def test_explain_of_full_sharding_matches_a_real_run():
    model, inputs = _gpt_inputs()
    (planned,) = graphddp.explain(model, *inputs, world_size=2, optimizer=torch.optim.AdamW, **FULL)
    assert planned.forward.of("gather") and planned.backward.of("reduce_scatter")
    spawn(_full_run, 2, planned)
