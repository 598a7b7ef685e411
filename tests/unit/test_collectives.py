"""Collectives as kinds (graphddp.values.collectives): the layers ask a bucket's kind, so a new kind is
additive. All-reduce is priced, serialised and fingerprinted as before kinds existed; a kind the
test adds (the out-of-place functional all-reduce) goes through the rewrite, the verifier, the
code reader and the cost model without a change to any of them."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_passes import MIXED, PARAMS, schedule_for, trace

from graphddp import simulate
from graphddp.graph.capture import extract_facts
from graphddp.graph.codeinspect import windows_in_graph
from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.verify import VerificationError, verify
from graphddp.values import collectives
from graphddp.values.schedule import CostModel, Schedule

c10d = torch.ops._c10d_functional


def test_all_reduce_is_priced_as_the_cost_models_ring_all_reduce():
    cost = CostModel(bandwidth_gbps=10.0, latency_us=7.0)
    for world in (1, 2, 3, 8, 64):
        for nbytes in (0, 1, 1 << 20, 123_456_789):
            assert collectives.ALL_REDUCE.seconds(cost, nbytes, world) == pytest.approx(cost.allreduce_seconds(nbytes, world))


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown bucket collective 'all_to_all'"):
        collectives.kind("all_to_all")


def _plan():
    gm = trace()
    facts = extract_facts(gm, PARAMS)
    return gm, schedule_for(facts, MIXED)


def test_an_all_reduce_plan_serialises_and_fingerprints_as_before_kinds_and_another_kind_round_trips():
    _, schedule = _plan()
    assert all(b.collective == "all_reduce" for b in schedule.buckets)
    assert all("collective" not in b for b in schedule.to_dict()["buckets"])  # fingerprints unchanged
    other = dataclasses.replace(schedule, buckets=tuple(dataclasses.replace(b, collective="x") for b in schedule.buckets))
    assert other.fingerprint() != schedule.fingerprint()
    assert Schedule.from_dict(other.to_dict()) == other
    assert other.buckets[0].wire() != schedule.buckets[0].wire()  # ranks agree on the kind too
    # What a gradient is computed from is a run-time fact, not the plan: not in the fingerprint.
    sourced = dataclasses.replace(schedule, buckets=tuple(
        dataclasses.replace(b, slots=tuple(dataclasses.replace(s, sources=(99,)) for s in b.slots)) for b in schedule.buckets
    ))
    assert sourced.fingerprint() == schedule.fingerprint()
    assert Schedule.from_dict(sourced.to_dict()) == sourced


@pytest.fixture
def out_of_place_kind():
    """A second kind, added the way a new one is: one entry in KINDS."""
    kind = collectives.CollectiveKind(
        key="all_reduce_out_of_place",
        lowering=collectives.Lowering(c10d.all_reduce.default, lambda flat, group, world: c10d.all_reduce.default(flat, "sum", group)),
        ring_steps=lambda p: 2 * (p - 1),
        wire_share=lambda p: 3.0,  # priced differently on purpose, to see simulate use it
    )
    collectives.KINDS[kind.key] = kind
    yield kind
    del collectives.KINDS[kind.key]


def test_a_new_kind_needs_no_change_to_rewrite_verify_codeinspect_or_cost(out_of_place_kind):
    gm, schedule = _plan()
    mine = dataclasses.replace(
        schedule, buckets=tuple(dataclasses.replace(b, collective=out_of_place_kind.key) for b in schedule.buckets)
    )
    insert_collectives(gm, mine)
    verify(gm, mine, PARAMS)
    issued = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == out_of_place_kind.op]
    assert len(issued) == mine.num_buckets
    assert len(windows_in_graph(gm)) == mine.num_buckets
    cost = CostModel(bandwidth_gbps=1.0, latency_us=0.0)
    slower = simulate(mine, cost).buckets[0]
    plain = simulate(schedule, cost).buckets[0]
    assert (slower.end - slower.start) == pytest.approx((plain.end - plain.start) * 3.0 / 1.0)  # 3.0 vs 2(p-1)/p = 1 at p=2
    # The verifier holds a bucket to its own kind: issued as an all-reduce, it is rejected.
    gm2, _ = _plan()
    insert_collectives(gm2, schedule)
    with pytest.raises(VerificationError, match="kind all_reduce_out_of_place"):
        verify(gm2, mine, PARAMS)


def test_a_reduce_scatter_on_gloo_is_an_all_to_all_and_a_sum_of_the_rows_elsewhere_the_reduce_scatter():
    """gloo's reduce_scatter sends an all-reduce's bytes (tools/gloo_wire_bytes.py); its all-to-all
    sends a reduce-scatter's. The lowering's result is the kind's: rank j's sum of every part j."""
    kind = collectives.REDUCE_SCATTER
    assert kind.lower("gloo").op is c10d.all_to_all_single.default
    for backend in ("nccl", "fake", None):
        assert kind.lower(backend).op is c10d.reduce_scatter_tensor.default
    assert kind.ops == {c10d.all_to_all_single.default, c10d.reduce_scatter_tensor.default}
    assert collectives.issue_pattern().search("torch.ops._c10d_functional.all_to_all_single.default(buf7, [3, 3], [3, 3], '0')")
    # What rank 1 of 3 receives from the all-to-all: part 1 of ranks 0, 1, 2, in rank order.
    parts = [torch.arange(6.0).view(3, 2)[1] * (r + 1) for r in range(3)]
    received = torch.cat(parts)
    torch.testing.assert_close(kind.lower("gloo").finish(received, 3), sum(parts))
    assert kind.lower("nccl").finish(parts[0], 3) is parts[0]
    assert collectives.ALL_REDUCE.lower("gloo") is collectives.ALL_REDUCE.lowering  # gloo's all-reduce is its own
