"""The default plan is the same on every run of one model on one machine: ``bucket_cap_mb="auto"``
fed calibrations of one link that differ by their noise (a fitted latency of 0 us per ring step,
floored as the calibration floors a fit that is noise twice; a few percent on the bandwidth and
the collective's cost) plans the same buckets for each. Pure planning on real models' backward
graphs (graphddp.explain's fake group); what the calibration does with noise: test_calibrate.py."""
from __future__ import annotations

import itertools

import pytest
import torch

import graphddp
from graphddp import CostModel
from graphddp.config import DDPConfig
from graphddp.models import MLP, TinyGPT
from graphddp.plan.cost import floor_latency
from graphddp.plan.planner import plan
from graphddp.values.schedule import GraphFacts

# One machine's link as calibrations measure it: the latency per ring step fitted as 0 (noise)
# or at what it is, bandwidth and a collective's cost within 5% of their value.
LATENCIES_US = (0.0, 15.0, 20.0, 30.0)
BANDWIDTHS_GBPS = (9.5, 10.0, 10.5)
OVERHEADS_US = (190.0, 200.0, 210.0)


def _facts(model: torch.nn.Module, *inputs: torch.Tensor) -> GraphFacts:
    (schedule,) = graphddp.explain(model, *inputs, world_size=2, backend="aot_eager", bucket_cap_mb=25)
    return GraphFacts(nodes=schedule.nodes, slots=tuple(s for b in schedule.buckets for s in b.slots))


def _mlp() -> GraphFacts:
    torch.manual_seed(0)
    return _facts(MLP(width=256, depth=6), torch.randn(64, 16))


def _gpt() -> GraphFacts:
    torch.manual_seed(0)
    return _facts(TinyGPT(vocab=128, dim=64, heads=4, layers=2, seq=32), torch.randint(0, 128, (8, 32)))


@pytest.mark.parametrize(
    "model, compute",
    [(_mlp, {"compute_tflops": 0.1, "memory_gbps": 20.0, "op_overhead_us": 3.0}),
     (_gpt, {"compute_tflops": 0.05, "memory_gbps": 10.0, "op_overhead_us": 5.0})],
    ids=["mlp", "tiny_gpt"],
)
def test_noisy_calibrations_of_one_link_plan_the_same_buckets(fake_world, model, compute):
    facts = model()
    plans: dict[tuple[int, ...], list] = {}
    for latency, bandwidth, overhead in itertools.product(LATENCIES_US, BANDWIDTHS_GBPS, OVERHEADS_US):
        measured = CostModel(latency_us=latency, bandwidth_gbps=bandwidth, collective_overhead_us=overhead, **compute)
        schedule = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=floor_latency(measured, "cpu")), world_size=2)
        plans.setdefault(tuple(len(b.slots) for b in schedule.buckets), []).append((latency, bandwidth, overhead))
    assert len(plans) == 1, {cuts: figures[:3] for cuts, figures in plans.items()}
