"""explain's plan for 2 ranks equals the plan a real 2-rank run makes (fingerprints)."""
from __future__ import annotations

import torch

import graphddp
from graphddp.models import MLP
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
