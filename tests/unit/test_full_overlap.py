"""Full sharding's collectives overlap compute in the code inductor generates, not only in the
FX graph graphddp writes (graph/part_collectives.py places them; graph/verify/parts.py checks
that placement).

What failed before (config/inductor_settings.py, FUSION_MIN_SHARED_BYTES): inductor fused a
bucket's in-graph update, which runs after its reduce-scatter's wait, with the copy of other
parameters' parts into the next gather's buffer, two loops of one size that share no tensor;
the fused kernel ran after the wait, so the wait moved up to its issue, nothing computed while
that reduce-scatter travelled, and the next gather was issued late. On the benchmark's GPT
(2 gloo ranks, 2 Gbit/s) that was a stall of about 8 ms per block.
"""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

import graphddp
from graphddp.graph.codeinspect import windows_in_generated_code
from graphddp.models import TinyGPT


def test_every_collective_of_the_updating_backward_but_the_last_has_compute_in_flight(fake_world):
    fake_world(2)
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=64, heads=2, layers=1, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", bucket_cap_mb=0.02)
    x = torch.randint(0, 512, (2, 16))

    def step() -> None:
        ours(x).float().pow(2).mean().backward()

    _, codes = run_and_get_code(step)
    (backward,) = [c for c in codes if "update_exp_avg" in c]  # the backward that updates the parts
    windows = windows_in_generated_code(backward)
    assert len(windows) >= 8, windows  # gathers again and reduce-scatters, a few per block
    idle = [i for i, w in enumerate(windows[:-1]) if w.kernels_in_flight == 0]
    assert not idle, f"collectives {idle} of {len(windows)} waited with nothing computed while in flight: {windows}"
