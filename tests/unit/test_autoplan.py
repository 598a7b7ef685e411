"""bucket_cap_mb="auto" (issue 12): the optimal partition under the cost model, its options,
and what the Schedule records. Pure planning and fake process groups; the 2-rank runs are in
ranks/test_ddp_matrix.py (feature "auto_buckets") and test_calibrate.py."""
from __future__ import annotations

import dataclasses
import time
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphddp
from graphddp import CostModel, Schedule, simulate
from graphddp.config import DDP_DEFAULT_CAPS, DDPConfig
from graphddp.plan import auto as autoplan
from graphddp.plan.cost import agreement_seconds, compute_timeline
from graphddp.plan.planner import plan, with_sharding
from graphddp.values.collectives import ALL_GATHER
from graphddp.values.schedule import Bucket, GradSlot, GraphFacts, NodeFact


def _facts(sizes: list[int], flops: list[int], dtypes: list[str] | None = None) -> GraphFacts:
    """One compute node per gradient, producing it; then the output."""
    nodes, slots = [], []
    for i, (numel, f) in enumerate(zip(sizes, flops)):
        nodes.append(NodeFact(name=f"n{i}", position=i, is_compute=True, flops=f, nbytes=4 * numel))
        dtype = dtypes[i] if dtypes else "float32"
        itemsize = 2 if dtype == "float16" else 4
        slots.append(GradSlot(output_index=i, param_name=f"p{i}", shape=(numel,), dtype=dtype, device="cpu",
                              numel=numel, nbytes=itemsize * numel, producer=f"n{i}", position=i))
    nodes.append(NodeFact(name="output", position=len(sizes), is_compute=False))
    return GraphFacts(nodes=tuple(nodes), slots=tuple(slots))


def _with_cuts(schedule: Schedule, facts: GraphFacts, cuts: list[int]) -> Schedule:
    bounds = [0, *cuts, len(facts.slots)]
    buckets = tuple(
        Bucket(index=k, slots=facts.slots[a:b], dtype="float32", device="cpu", issue_after=facts.slots[b - 1].producer,
               wait_before="output", overlap=())
        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
    )
    return dataclasses.replace(schedule, buckets=buckets)


# (sharding, gather, gated): replicated all-reduces, and the same gated (one CPU bucket then
# carries the agreement: a plan of more pays its collective, graphddp.runtime.steady);
# reduce-scatters with their all-gathers in the backward; reduce-scatters whose all-gathers
# complete in the next forward.
RUNS = ((None, "backward", False), (None, "backward", True), ("optimizer", "backward", False), ("optimizer", "forward", False))


def _as_run(schedule: Schedule, sharding: str | None, gather: str, gated: bool = False) -> Schedule:
    """``schedule`` as it runs under ``sharding``: sharded, every bucket reduce-scattered
    (the graph updates every parameter) and gathered where ``gather`` says."""
    if sharding is None:
        return schedule
    return with_sharding(schedule, {s.param_name for b in schedule.buckets for s in b.slots}, gather)


COSTS = st.builds(
    CostModel,
    bandwidth_gbps=st.sampled_from([0.05, 1.0, 10.0, 400.0]),
    latency_us=st.sampled_from([0.0, 5.0, 100.0, 2000.0]),
    compute_tflops=st.sampled_from([0.01, 0.05, 1.0]),
    collective_overhead_us=st.sampled_from([0.0, 20.0, 3000.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 256, 65536, 1 << 20]), min_size=1, max_size=7),
    flops=st.lists(st.integers(0, 10**10), min_size=7, max_size=7),
    cost=COSTS,
    world=st.sampled_from([2, 8, 64]),
    run=st.sampled_from(RUNS),
)
def test_auto_plan_is_never_beaten_by_any_partition(sizes, flops, cost, world, run):
    """Exhaustive: under the nominal model alone, no way of cutting the production order into
    buckets is predicted faster by graphddp.simulate by more than ``NEAR_TIE``, and the plan has
    no more buckets than the optimal cut of fewest buckets (an optimal plan is that cut); with
    the robustness scenarios, no candidate has a worst regret smaller by more than ``NEAR_TIE``,
    and one that is smaller comes after the plan in the near-tie order. Every
    schedule is simulated as it runs: replicated, or sharded with its gathers where ``run``
    puts them, so the sharded DP is checked against the sharded simulation."""
    facts = _facts(sizes, flops[: len(sizes)])
    config = DDPConfig(bucket_cap_mb="auto", cost=cost, sharding=run[0], gather=run[1])
    with _scenarios(((1.0, 1.0),)):
        auto = plan(facts, config, world_size=world, gated=run[2])
    got = simulate(_as_run(auto, *run)).step_seconds
    n = len(sizes)
    assert [x.output_index for b in auto.buckets for x in b.slots] == list(range(n))  # each once, in order
    every = [[i + 1 for i in range(n - 1) if mask >> i & 1] for mask in range(2 ** (n - 1))]
    tie = 1 + autoplan.NEAR_TIE
    times = {tuple(cuts): simulate(_as_run(_with_cuts(auto, facts, cuts), *run), cost).step_seconds for cuts in every}
    fastest = min(times.values())
    fewest = min(len(cuts) + 1 for cuts, t in times.items() if t <= fastest * (1 + 1e-9) + 1e-12)
    assert auto.num_buckets <= fewest, auto.to_table()
    for cuts, other in times.items():
        assert got <= other * tie * (1 + 1e-9) + 1e-12, (cuts, got, other, auto.to_table())
        if got <= fastest * (1 + 1e-9) + 1e-12 and other <= got * (1 + 1e-9):
            assert auto.num_buckets <= len(cuts) + 1, (cuts, auto.to_table())
    robust = _as_run(plan(facts, config, world_size=world, gated=run[2]), *run)
    cases = [dataclasses.replace(cost, compute_tflops=cost.compute_tflops * c, memory_gbps=cost.memory_gbps * c,
                                 op_overhead_us=cost.op_overhead_us / c, bandwidth_gbps=cost.bandwidth_gbps * l,
                                 latency_us=cost.latency_us / l) for c, l in autoplan.SCENARIOS]
    optimum = [min(simulate(_as_run(_with_cuts(auto, facts, cuts), *run), c).step_seconds for cuts in every) for c in cases]

    def regret(schedule: Schedule) -> float:
        return max(simulate(schedule, c).step_seconds / o for c, o in zip(cases, optimum))

    assert regret(robust) <= regret(_as_run(auto, *run)) * tie * (1 + 1e-9)
    nbytes = [s.nbytes for s in facts.slots]
    for caps in autoplan.CANDIDATE_CAPS_MB:  # never a worse compromise than a fixed cap, but for a near-tie
        capped = _as_run(_with_cuts(auto, facts, list(autoplan.capped_starts(nbytes, caps)[1:])), *run)
        assert regret(robust) <= regret(capped) * tie * (1 + 1e-9), (caps, robust.to_table(), capped.to_table())
        if regret(capped) * (1 + 1e-9) < regret(robust):  # a near-tie: the plan comes first in the order
            assert _order(robust) <= _order(capped), (caps, robust.to_table(), capped.to_table())


def _order(schedule: Schedule) -> tuple[int, list[int]]:
    """Where a plan stands in the near-tie order (graphddp.plan.auto.NEAR_TIE): fewer buckets
    first, then later cuts."""
    return schedule.num_buckets, [-b.slots[0].output_index for b in schedule.buckets]


def _nominal(facts: GraphFacts, cost: CostModel) -> tuple[list[float], float]:
    """When each gradient is ready, and when the compute ends, with no collective issued."""
    _, finished, end = compute_timeline(facts.nodes, cost)
    return [finished[s.producer] for s in facts.slots], end


def test_a_sharded_plan_is_cut_for_the_collectives_its_backward_runs():
    """The same backward, link and ranks, three runs. With its all-gathers in the backward a
    sharded bucket costs the link a reduce-scatter and an all-gather: uncompressed, an
    all-reduce's latencies and bytes, so the replicated plan. With the all-gathers in the next
    forward only the reduce-scatters remain, half the latency and bytes: more, smaller buckets,
    which beat the other plan under that run. Each plan's prediction is what graphddp.simulate
    says of it as it runs."""
    facts = _facts([1 << 18] * 12, [10**8] * 12)  # 12 gradients of 1 MB, 2 ms of compute each
    cost = CostModel(bandwidth_gbps=10.0, latency_us=1000.0, collective_overhead_us=0.0)
    runs = (RUNS[0], RUNS[2], RUNS[3])  # replicated, sharded with gathers in the backward, in the forward
    with _scenarios(((1.0, 1.0),)):
        plans = {
            run: plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost, sharding=run[0], gather=run[1]), world_size=8)
            for run in runs
        }
    assert {run: [len(b.slots) for b in s.buckets] for run, s in plans.items()} == {
        runs[0]: [3, 9], runs[1]: [3, 9], runs[2]: [2, 5, 5],
    }
    ready, end = _nominal(facts, cost)
    nbytes = [s.nbytes for s in facts.slots]
    for run, schedule in plans.items():
        pricing = autoplan.Pricing.of(run[0], run[1])
        starts, predicted = autoplan.best_partition(ready, nbytes, cost, 8, end, pricing, sum(nbytes))
        assert starts == [b.slots[0].output_index for b in schedule.buckets]
        assert simulate(_as_run(schedule, *run)).step_seconds == pytest.approx(predicted, rel=1e-12)
        if run == runs[2]:
            assert predicted < simulate(_as_run(plans[runs[0]], *run)).step_seconds, plans[runs[0]].to_table()
        else:
            assert predicted < simulate(_as_run(plans[runs[2]], *run)).step_seconds, (run, plans[runs[2]].to_table())


def test_a_compressed_sharded_plan_gathers_the_parameters_own_bytes():
    """fp16 compression halves the reduce-scatter on the wire, not the all-gather of the
    float32 parameters: the plan's prediction counts each as graphddp.simulate does."""
    facts = _facts([1 << 18] * 8, [10**8] * 8)
    cost = CostModel(bandwidth_gbps=1.0, latency_us=100.0)
    config = DDPConfig(bucket_cap_mb="auto", cost=cost, comm_hook="fp16_compress", sharding="optimizer")
    with _scenarios(((1.0, 1.0),)), _exact():
        schedule = plan(facts, config, world_size=8)
    ready, end = _nominal(facts, cost)
    nbytes = [s.nbytes for s in facts.slots]
    starts, predicted = autoplan.best_partition(
        ready, [n // 2 for n in nbytes], cost, 8, end, autoplan.Pricing.of("optimizer"), sum(nbytes),
    )
    assert starts == [b.slots[0].output_index for b in schedule.buckets]
    assert simulate(_as_run(schedule, "optimizer", "backward")).step_seconds == pytest.approx(predicted, rel=1e-12)


def test_gathers_in_the_backward_cost_an_all_reduces_link_time_and_in_the_forward_nothing():
    """For any cuts, a sharded bucket with its all-gather in the backward takes the link as long
    as an all-reduce of it (a reduce-scatter and an all-gather: the same ring steps and bytes),
    and with the all-gather in the next forward its reduce-scatter only: the backward then ends
    with the compute or the last reduce-scatter, in the plan's model and in graphddp.simulate.
    A sharded bucket planned before ``gather`` existed (None) is gathered in the backward."""
    facts = _facts([1 << 18] * 12, [10**8] * 12)
    cost = CostModel(bandwidth_gbps=10.0, latency_us=1000.0, collective_overhead_us=30.0)
    base = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=8)
    ready, end = _nominal(facts, cost)
    nbytes = [s.nbytes for s in facts.slots]
    backward, forward = autoplan.Pricing.of("optimizer", "backward"), autoplan.Pricing.of("optimizer", "forward")
    assert forward.alongside is None and backward.alongside is ALL_GATHER and autoplan.Pricing.of(None) == autoplan.REPLICATED
    for starts in ([0], [0, 4, 8], list(range(12))):
        late = autoplan.predicted_step(starts, ready, nbytes, cost, 8, end, backward, sum(nbytes))
        early = autoplan.predicted_step(starts, ready, nbytes, cost, 8, end, forward, sum(nbytes))
        replicated = autoplan.predicted_step(starts, ready, nbytes, cost, 8, end)
        assert late == pytest.approx(replicated, rel=1e-12) and early < late
        cut = _with_cuts(base, facts, starts[1:])
        in_forward = simulate(_as_run(cut, "optimizer", "forward"))
        assert in_forward.step_seconds == max([in_forward.compute_seconds] + [t.end for t in in_forward.buckets])
        assert in_forward.step_seconds == pytest.approx(early, rel=1e-12)
        assert simulate(_as_run(cut, "optimizer", "backward")).step_seconds == pytest.approx(late, rel=1e-12)
        legacy = _as_run(cut, "optimizer", "backward")
        legacy = dataclasses.replace(legacy, buckets=tuple(dataclasses.replace(b, gather=None) for b in legacy.buckets))
        assert simulate(legacy).step_seconds == simulate(_as_run(cut, "optimizer", "backward")).step_seconds


@pytest.mark.parametrize("caps", autoplan.CANDIDATE_CAPS_MB)
def test_cap_candidates_are_cut_as_ddp_cuts(caps):
    """The cap plans the robust choice weighs are the planner's own DDP-rule buckets."""
    facts = _facts([1 << 18, 3 << 18, 1 << 16, 1 << 20, 5 << 18, 1 << 10, 1 << 19, 7 << 17, 1 << 20], [0] * 9)
    config = DDPConfig(bucket_cap_mb=caps[-1], first_bucket_cap_mb=caps[0])
    ddp = [b.slots[0].output_index for b in plan(facts, config).buckets]
    assert list(autoplan.capped_starts([s.nbytes for s in facts.slots], caps)) == ddp
    assert autoplan.capped_starts([], caps) == ()


def test_a_cap_plan_wins_when_it_is_the_better_compromise():
    """Each scenario's optimum is extreme for its own scenario; here a fixed cap's worst
    regret is smaller than all of theirs, and the robust choice takes it."""
    facts = _facts([1 << 16] * 16, [10**7] * 16)  # 16 gradients of 256 KB
    cost = CostModel(bandwidth_gbps=8.0, latency_us=50.0, collective_overhead_us=140.0)
    with _candidate_caps(()):
        optima_only = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=2)
    chosen = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=2)
    nbytes = [s.nbytes for s in facts.slots]
    starts = [b.slots[0].output_index for b in chosen.buckets]
    assert tuple(starts) == autoplan.capped_starts(nbytes, (1.0,)) == (0, 4, 8, 12)
    assert starts != [b.slots[0].output_index for b in optima_only.buckets]


def _candidate_caps(caps):
    return mock.patch.object(autoplan, "CANDIDATE_CAPS_MB", caps)


def _scenarios(cases):
    return mock.patch.object(autoplan, "SCENARIOS", cases)


def _exact():
    """The model's exact optimum, no near-tie given up for fewer buckets: for tests of what the
    model prices, not of the choice's stability (test_plan_stability.py)."""
    return mock.patch.object(autoplan, "NEAR_TIE", 0.0)


def test_the_robust_plan_keeps_a_busy_links_last_bucket_small():
    """On a link that is busy from the first bucket to the end, the nominal optimum sends the
    late gradients as one large last bucket (hidden only if the link never idles); the plan
    chosen against a faster link or compute keeps that bucket smaller, for little predicted cost."""
    facts = _facts([1 << 18] * 24, [10**8] * 24)
    cost = CostModel(bandwidth_gbps=2.0, latency_us=600.0, collective_overhead_us=140.0)
    with _scenarios(((1.0, 1.0),)), _exact():
        nominal = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=2)
    with _exact():
        robust = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=2)
    assert robust.buckets[-1].nbytes < nominal.buckets[-1].nbytes
    assert simulate(robust).step_seconds <= 1.05 * simulate(nominal).step_seconds


def test_the_regimes_come_out_as_the_model_says():
    sizes, flops = [1 << 18] * 12, [10**8] * 12  # 12 MB, 2 ms of compute per gradient at 0.05 TFLOP/s
    facts = _facts(sizes, flops)

    def buckets(**cost) -> list[int]:
        with _exact():
            return [len(b.slots) for b in plan(facts, DDPConfig(bucket_cap_mb="auto", cost=CostModel(**cost)), world_size=8).buckets]

    # A collective costs more than any overlap can win back: one bucket.
    assert buckets(latency_us=1e5) == [12]
    assert buckets(collective_overhead_us=1e5) == [12]
    # A fast link, a collective nearly free: every gradient's transfer hides behind the next
    # gradient's compute, except the last one's: the tail is a bucket of one.
    tight = buckets(bandwidth_gbps=1000.0, latency_us=0.0, collective_overhead_us=0.0)
    assert tight[-1] == 1 and len(tight) > 1
    # The link is the bottleneck: it starts with the first gradient alone and never idles
    # after; merging the rest saves latency, so the later buckets are large.
    with _exact():
        slow = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=CostModel(bandwidth_gbps=2.0)), world_size=8)
    timing = simulate(slow).buckets
    assert len(slow.buckets[0].slots) == 1 and len(slow.buckets) < 12
    assert all(b.start == a.end for a, b in zip(timing, timing[1:]))


def test_auto_beats_every_swept_cap_on_a_transformer(fake_world):
    """On a real backward graph (TinyGPT, 6.6 M parameters): the auto plan's prediction is at
    most every swept cap's under the same cost model, at two link speeds."""
    from graphddp.models import TinyGPT

    model = TinyGPT(vocab=512, dim=128, heads=4, layers=4, seq=32)
    x = torch.randint(0, 512, (2, 32))
    base = graphddp.explain(model, x, world_size=8, backend="aot_eager")[0]
    facts = GraphFacts(nodes=base.nodes, slots=tuple(s for b in base.buckets for s in b.slots))
    for gbit in (1.0, 4.0):
        cost = CostModel(bandwidth_gbps=gbit, latency_us=30.0)
        auto = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=8)
        best = simulate(auto).step_seconds
        for cap in (1, 2, 4, 8, 25):
            capped = plan(facts, DDPConfig(bucket_cap_mb=cap), world_size=8)
            assert best <= simulate(capped, cost).step_seconds * (1 + 1e-9), (gbit, cap)


def test_explain_shows_the_auto_plan_and_its_prediction():
    from transformers import GPT2Config, GPT2LMHeadModel

    # dim 128: at 64 its backward is too short for more buckets to gain more than the
    # agreement's own collective a one-bucket plan saves (graphddp.runtime.steady)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=256, n_positions=32, use_cache=False))
    idx = torch.randint(0, 256, (2, 16))
    loss = lambda out: out.logits.float().sum()  # noqa: E731
    slow = CostModel(bandwidth_gbps=0.1, latency_us=5000.0, source="a slow WAN")
    fast = CostModel(bandwidth_gbps=100.0, latency_us=1.0, collective_overhead_us=0.0)
    (plan_slow,) = graphddp.explain(model, idx, world_size=64, backend="aot_eager", loss_fn=loss, bucket_cap_mb="auto", cost=slow)
    (plan_fast,) = graphddp.explain(model, idx, world_size=64, backend="aot_eager", loss_fn=loss, bucket_cap_mb="auto", cost=fast)
    assert plan_slow.cost_model == slow and plan_fast.cost_model == fast
    assert plan_slow.num_buckets < plan_fast.num_buckets  # latency makes buckets few and large
    table = graphddp.render.table(plan_slow)  # predicted with the model the plan was made with
    assert "auto buckets" in table and "a slow WAN" in table and "predicted (0.1 Gbit/s" in table
    assert plan_slow.bucket_cap_mb is None and plan_slow.first_bucket_cap_mb is None
    # Without cost= under explain's fake group nothing can be measured: the defaults, said so.
    (default,) = graphddp.explain(model, idx, world_size=8, backend="aot_eager", loss_fn=loss, bucket_cap_mb="auto")
    assert default.cost_model.source.startswith("default") and default.cost_model.numbers == CostModel().numbers


def test_the_schedule_records_the_cost_model_and_the_fingerprint_only_the_buckets():
    facts = _facts([1 << 16] * 6, [10**8] * 6)
    a = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=CostModel(bandwidth_gbps=3.0, source="run 1")), world_size=8)
    b = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=CostModel(bandwidth_gbps=3.1, source="run 2")), world_size=8)
    assert Schedule.from_json(a.to_json()) == a
    assert a.to_dict()["cost_model"]["source"] == "run 1"
    assert [len(x.slots) for x in a.buckets] == [len(x.slots) for x in b.buckets]
    assert a.fingerprint() == b.fingerprint()  # calibration noise that plans the same buckets
    capped = plan(facts, DDPConfig(bucket_cap_mb=0.25), world_size=8)
    assert capped.cost_model is None and "caps first=0.25 MB" in capped.to_table()


def test_a_compression_hook_plans_with_the_bytes_on_the_wire():
    facts = _facts([1 << 18] * 8, [10**8] * 8)
    cost = CostModel(bandwidth_gbps=1.0, latency_us=100.0)
    with _exact():  # the cap plans weighed for a near-tie cut the gradients' own bytes, not the wire's
        fp16 = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost, comm_hook="fp16_compress"), world_size=8)
        half = _facts([1 << 17] * 8, [10**8] * 8)  # the same gradients at half the bytes
        expect = plan(half, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=8)
    assert [len(b.slots) for b in fp16.buckets] == [len(b.slots) for b in expect.buckets]


def test_dtypes_are_planned_apart():
    facts = _facts([1 << 16] * 6, [10**8] * 6, dtypes=["float32", "float16"] * 3)
    s = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=CostModel(latency_us=1e4)), world_size=8)
    assert sorted((b.dtype, len(b.slots)) for b in s.buckets) == [("float16", 3), ("float32", 3)]


def test_a_thousand_parameters_plan_in_seconds():
    n = 1000
    facts = _facts([(37 * i) % 5000 * 64 + 1 for i in range(n)], [10**7 + (i % 7) * 10**8 for i in range(n)])
    for cost in (CostModel(bandwidth_gbps=1.0, latency_us=50.0), CostModel(bandwidth_gbps=100.0, latency_us=5.0)):
        start = time.process_time()  # the planner's own work: CPU time, whatever else the machine runs
        s = plan(facts, DDPConfig(bucket_cap_mb="auto", cost=cost), world_size=64)
        assert time.process_time() - start < 10.0
        assert sorted(x.output_index for b in s.buckets for x in b.slots) == list(range(n))


@pytest.mark.parametrize("options, words", [
    ({"bucket_cap_mb": "auto", "first_bucket_cap_mb": 1.0}, ["first_bucket_cap_mb", "auto"]),
    ({"bucket_cap_mb": "auto", "last_bucket_cap_mb": 1.0}, ["last_bucket_cap_mb"]),
    ({"bucket_cap_mb": "auto", "bucket_cap_mb_list": [1.0, 2.0]}, ["bucket_cap_mb_list"]),
    ({"bucket_cap_mb": 4.0, "cost": CostModel()}, ["cost", "bucket_cap_mb='auto'"]),
    ({"cost": CostModel(), "last_bucket_cap_mb": 1.0}, ["cost", "last_bucket_cap_mb=1.0"]),
    ({"bucket_cap_mb": "fast"}, ["bucket_cap_mb", "'auto'", "'fast'"]),
    ({"bucket_cap_mb": "auto", "cost": {"bandwidth_gbps": 1}}, ["cost", "CostModel"]),
])
def test_bad_auto_options_are_refused_by_name(options, words):
    with pytest.raises(ValueError) as e:
        DDPConfig.from_options("graphddp.compile", options)
    for word in words:
        assert word in str(e.value)


def test_auto_is_the_default_and_any_cap_option_turns_it_off():
    assert DDPConfig().auto and DDPConfig(cost=CostModel()).auto and DDPConfig(bucket_cap_mb="auto").auto
    for caps in ({"bucket_cap_mb": 25}, {"first_bucket_cap_mb": 1}, {"last_bucket_cap_mb": 1}, {"bucket_cap_mb_list": [1]}):
        assert not DDPConfig(**caps).auto, caps
    # caps unset with one of the others given: DDP's unset caps (25 MB after 1 MB), as before
    assert DDPConfig(last_bucket_cap_mb=1).bucket_size_limits == DDPConfig(**DDP_DEFAULT_CAPS).bucket_size_limits


def test_a_config_under_auto_has_no_caps_to_read():
    cfg = DDPConfig(bucket_cap_mb="auto")
    with pytest.raises(ValueError, match="no bucket cap"):
        cfg.effective_bucket_cap_mb


def test_an_auto_plan_made_inside_a_fake_mode_is_the_plan_made_outside():
    """A dynamic-shape graph's backward is compiled at once, inside the fake mode: the planner
    must plan there as it does outside (it raised DataDependentOutputException, which torch
    hid, compiling the backward again later)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    facts = _facts([1 << 16] * 16, [10**7] * 16)
    config = DDPConfig(bucket_cap_mb="auto", cost=CostModel(bandwidth_gbps=8.0, latency_us=50.0, collective_overhead_us=140.0))
    outside = plan(facts, config, world_size=2)
    with FakeTensorMode():
        inside = plan(facts, config, world_size=2)
    assert inside.fingerprint() == outside.fingerprint() and inside.num_buckets > 1


def test_a_gated_plan_prices_the_agreement_one_bucket_saves():
    """Gated, a plan of one CPU bucket carries the agreement in its all-reduce once steady
    (graphddp.runtime.steady), so more buckets must gain more than the agreement's own
    collective: a small backward whose ungated plan overlaps a first bucket becomes one bucket,
    and graphddp.simulate charges the two-bucket plan exactly that collective."""
    facts = _facts([1 << 16, 1 << 14], [10**7, 10**7])  # 256 KB ready half-way, then 64 KB
    cost = CostModel(bandwidth_gbps=10.0, latency_us=100.0, collective_overhead_us=50.0)
    config = DDPConfig(bucket_cap_mb="auto", cost=cost)
    with _scenarios(((1.0, 1.0),)), _exact():
        ungated = plan(facts, config, world_size=2)
        gated = plan(facts, config, world_size=2, gated=True)
    assert ungated.num_buckets == 2 and not ungated.gated, ungated.to_table()
    assert gated.num_buckets == 1 and gated.gated, gated.to_table()
    two_gated = dataclasses.replace(ungated, gated=True)
    extra = simulate(two_gated).step_seconds - simulate(ungated).step_seconds
    assert extra == pytest.approx(agreement_seconds(cost, 2), rel=1e-12) and extra > 0
    assert simulate(gated).step_seconds == pytest.approx(simulate(dataclasses.replace(gated, gated=False)).step_seconds)
    assert simulate(gated).step_seconds < simulate(two_gated).step_seconds
