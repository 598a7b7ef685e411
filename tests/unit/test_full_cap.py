"""``sharding="full"``'s bucket cap planned from the cost model (graphddp.plan.parts): the
arithmetic, and what a compiled graph's buckets do with it, under explain's fake group."""
from __future__ import annotations

import pytest
import torch

import graphddp
from graphddp import models
from graphddp.plan.parts import MAX_CAP_BYTES, MIN_CAP_BYTES, planned_cap_bytes
from graphddp.values.prediction import CostModel

MB = 1 << 20
# This machine's calibration of the benchmark's emulated 2 Gbit/s link (2 gloo ranks), as stored
# in the bench's inductor cache on 2026-11-27.
EMULATED = CostModel(bandwidth_gbps=1.0, latency_us=0.0, collective_overhead_us=260.0)
GPT_BYTES = 26 * MB  # the benchmark's GPT, fp32


def test_the_benchmarks_link_gets_a_cap_inside_the_band_its_sweep_found_best():
    # the sweep (docs/full-sharding.md): 0.25 MB 1.29x sharding="optimizer", 0.5-2 MB 1.08-1.13x
    for regathers in (True, False):
        cap = planned_cap_bytes(EMULATED, GPT_BYTES, 2, regathers)
        assert 0.5 * MB <= cap <= 2 * MB, cap / MB


def test_where_the_link_costs_nothing_the_cap_is_the_ceiling():
    assert planned_cap_bytes(EMULATED, GPT_BYTES, 1, True) == MAX_CAP_BYTES  # one rank sends nothing
    nvlink = CostModel(bandwidth_gbps=1200.0, latency_us=5.0, collective_overhead_us=110.0)  # the H100's ~110 us a collective
    assert planned_cap_bytes(nvlink, 313 * MB, 8, True) == MAX_CAP_BYTES


def test_the_cap_grows_with_what_a_collective_costs_and_shrinks_with_the_links_cost_per_byte():
    base = planned_cap_bytes(EMULATED, GPT_BYTES, 2, True)
    dear = CostModel(bandwidth_gbps=1.0, latency_us=0.0, collective_overhead_us=1000.0)
    slow = CostModel(bandwidth_gbps=0.25, latency_us=0.0, collective_overhead_us=260.0)
    assert planned_cap_bytes(dear, GPT_BYTES, 2, True) > base > planned_cap_bytes(slow, GPT_BYTES, 2, True)
    assert planned_cap_bytes(EMULATED, 4 * GPT_BYTES, 2, True) > base  # more bytes: more buckets, each larger
    assert planned_cap_bytes(EMULATED, GPT_BYTES, 2, False) < base  # no regather: less fixed time per bucket
    latent = CostModel(bandwidth_gbps=1.0, latency_us=500.0, collective_overhead_us=260.0)
    assert planned_cap_bytes(latent, GPT_BYTES, 2, True) > base  # latency is paid per collective too


def test_the_cap_stays_between_its_floor_and_ceiling():
    cheap = CostModel(bandwidth_gbps=0.001, latency_us=0.0, collective_overhead_us=0.001)
    assert planned_cap_bytes(cheap, GPT_BYTES, 2, True) == MIN_CAP_BYTES
    assert planned_cap_bytes(CostModel(collective_overhead_us=1e6), GPT_BYTES, 2, True) == MAX_CAP_BYTES


def _explain(**options) -> list:
    torch.manual_seed(0)
    model = models.TinyGPT(vocab=512, dim=128, heads=4, layers=4, seq=16)  # 3.4 MB of fp32 parameters
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    return graphddp.explain(model, tokens, world_size=8, sharding="full", optimizer=torch.optim.AdamW,
                            backend="aot_eager", **options)


def test_a_compiled_graphs_buckets_close_at_the_planned_cap_and_say_so():
    slow = CostModel(bandwidth_gbps=0.1, latency_us=0.0, collective_overhead_us=10.0)
    fast = CostModel(bandwidth_gbps=1000.0, latency_us=5.0, collective_overhead_us=100.0)  # a cap above the model
    (on_slow,) = _explain(cost=slow)
    (on_fast,) = _explain(cost=fast)
    for s, cost in ((on_slow, slow), (on_fast, fast)):
        for graph in s.graphs:
            whole = max(sum(b.whole_bytes for b in graph.of(k)) for k in ("gather", "reduce_scatter"))
            expected = planned_cap_bytes(cost, whole, 8, True)
            assert graph.cap is not None and graph.cap.nbytes == expected and graph.cap.source == "planned (given)"
            for kind in ("gather", "reduce_scatter"):
                sizes = [b.whole_bytes for b in graph.of(kind)]
                # DDP's rule: a bucket closes once it reaches the cap, so every one but the last reached it
                assert all(size >= expected for size in sizes[:-1]), (kind, sizes, expected)
    assert len(on_slow.forward.of("gather")) > len(on_fast.forward.of("gather")) == 1
    assert "capped at" in on_slow.to_table() and "planned (given)" in on_slow.to_table()


def test_a_given_cap_is_the_cap():
    (s,) = _explain(bucket_cap_mb=0.5)
    assert all(g.cap.nbytes == MB // 2 and g.cap.source == "bucket_cap_mb" for g in s.graphs)
    with pytest.raises(ValueError, match="cost"):
        _explain(bucket_cap_mb=0.5, cost=EMULATED)  # a cost with a given cap would plan nothing


def test_a_hybrid_placement_plans_with_its_replicate_all_reduce():
    from graphddp.values.placement import Level, Placement

    flat = planned_cap_bytes(EMULATED, GPT_BYTES, 2, True)
    assert planned_cap_bytes(EMULATED, GPT_BYTES, 2, True, Placement(Level("s", 2), Level("r", 1))) == flat
    hybrid = planned_cap_bytes(EMULATED, GPT_BYTES, 2, True, Placement(Level("s", 2), Level("r", 2)))
    # one more collective per bucket (its fixed time: a larger cap) carrying half a bucket's
    # bytes again (its link time: a smaller one); on this link the bytes weigh more
    assert MIN_CAP_BYTES < hybrid < flat, (hybrid / MB, flat / MB)
