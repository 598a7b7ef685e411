"""sharding="auto"'s pieces that need no ranks: the planning trace, each placement's predicted step
(graphddp.plan.step) and the choice (graphddp.plan.choose), as values."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from graphddp.compiler.model_trace import time_example, trace_model
from graphddp.compiler.optimizer_probe import update_seconds_per_byte
from graphddp.models import TinyGPT
from graphddp.plan.choose import PLACEMENTS, TIE, choose, placements, whole_below_splits
from graphddp.plan.cost import host_seconds
from graphddp.plan.step import _backward_lane, _Bucket, compute_scale, predict_step
from graphddp.values.choice import PlacementChoice
from graphddp.values.placement import Level, Placement
from graphddp.values.prediction import CostModel


@pytest.fixture(scope="module")
def gpt_facts():
    torch.manual_seed(0)
    model = TinyGPT()
    trace = trace_model(model, (torch.randint(0, 64, (4, 16)),), torch.optim.AdamW(model.parameters()), min_cut=True)
    return model, trace.steps


def test_the_planning_trace_reads_every_gradient_and_runs_no_backward(gpt_facts):
    model, facts = gpt_facts
    (graph,) = facts
    names = {s.param_name for s in graph.backward.slots}
    assert names == {n for n, _ in model.named_parameters()}
    assert sum(n.is_compute for n in graph.forward) > 10
    assert all(p.grad is None for p in model.parameters())


def _step(facts, bandwidth=10.0, world=8, **kw):
    return predict_step(facts, CostModel(bandwidth_gbps=bandwidth), world, state_entries=2, **kw)


def test_each_placement_moves_what_it_should(gpt_facts):
    _, facts = gpt_facts
    replicated = _step(facts)
    sharded = _step(facts, sharding="optimizer")
    assert sharded.update == pytest.approx(replicated.update / 8, rel=0.01)  # each rank updates its parts
    deferred = _step(facts, sharding="optimizer", gather="forward")
    assert deferred.backward < sharded.backward  # the all-gathers left the backward
    assert deferred.forward > replicated.forward  # for the next forward
    keep, reshard = _step(facts, sharding="full", reshard_after_forward=False), _step(facts, sharding="full")
    assert keep.backward < reshard.backward and keep.collectives < reshard.collectives
    assert reshard.forward > replicated.forward  # the forward waits for gathers


def test_measured_compute_and_update_scale_what_they_measured(gpt_facts):
    _, facts = gpt_facts
    cost = CostModel(bandwidth_gbps=1e6, latency_us=0.0, collective_overhead_us=0.0)  # the step is compute and update
    estimated = compute_scale(facts, cost, (1.0, 1.0))
    forward, backward = (1.0 / f for f in estimated)  # the seconds the estimates give
    factors = compute_scale(facts, cost, (2 * forward, 3 * backward))
    assert factors == (2.0, 3.0)
    base, scaled = (predict_step(facts, cost, 8, state_entries=2, compute=c) for c in ((1.0, 1.0), factors))
    assert scaled.forward == pytest.approx(2 * base.forward, rel=0.05)
    assert scaled.backward - scaled.update == pytest.approx(3 * (base.backward - base.update), rel=0.05)
    params = sum(s.nbytes for s in facts[0].backward.slots)
    assert _step(facts, 1e6, update_per_byte=1e-9).update == pytest.approx(params * 1e-9)


def test_a_collectives_host_share_lengthens_the_compute_it_overlaps(gpt_facts):
    _, facts = gpt_facts
    cost = CostModel(bandwidth_gbps=50.0)
    free, shared = (predict_step(facts, dataclasses.replace(cost, collective_host_share=s), 8) for s in (0.0, 0.5))
    assert shared.backward > free.backward
    assert host_seconds(dataclasses.replace(cost, collective_host_share=0.5), 0.01) == pytest.approx(0.005 + 20e-6)


def test_a_sharded_bucket_waits_for_its_reduce_scatter_one_bucket_later():
    """Replicated buckets are waited for at the backward's end, sharded ones a bucket later: the
    compute after that wait stalls behind a slow reduce (one second of compute, a reduce of two
    issued after each of two; then three seconds of compute)."""
    free = CostModel(collective_overhead_us=0.0)
    buckets = [_Bucket(reduce=2.0, gather=0.0, update=0.0)] * 2
    assert _backward_lane([1.0, 1.0, 3.0], buckets, free, lag=None) == 5.0  # the waits at the end: the link's 5
    assert _backward_lane([1.0, 1.0, 3.0], buckets, free, lag=1) == 6.0  # waited at 2 for the 3: 3 + 3
    gathered = [_Bucket(reduce=2.0, gather=1.0, update=0.5)] * 2  # an update, then the all-gather on the link
    assert _backward_lane([1.0, 1.0, 3.0], gathered, free, lag=1) == 3.0 + 0.5 + 3.0 + 0.5 + 1.0  # the last gather exposed


def test_deferred_gathers_make_the_forward_wait_for_the_first_bucket_it_reads(gpt_facts):
    _, facts = gpt_facts
    step = _step(facts, 0.05, sharding="optimizer", gather="forward")
    first = Placement(Level("", 8)).gather_seconds(CostModel(bandwidth_gbps=0.05), max(s.nbytes for s in facts[0].backward.slots))
    compute = _step(facts, 1e6).forward
    assert step.forward > compute + first * 0.9


def test_full_sharding_pays_more_as_the_link_slows(gpt_facts):
    _, facts = gpt_facts
    ratios = [_step(facts, bw, sharding="full").seconds / _step(facts, bw).seconds for bw in (1000.0, 10.0, 0.1)]
    assert ratios[0] < ratios[1] < ratios[2]


def test_hybrid_prices_the_replicate_all_reduce(gpt_facts):
    _, facts = gpt_facts
    hybrid = Placement(Level("s", 4), Level("r", 2))
    flat4 = _step(facts, world=8, sharding="full", placement=Placement(Level("s", 4)))
    assert _step(facts, world=8, sharding="full", placement=hybrid).seconds > flat4.seconds


def _fixed(table):
    return lambda options: table[tuple(sorted(options.items(), key=str))]


def _table(steps, peaks):
    return {tuple(sorted(opts, key=str)): (s, p, p // 2) for (_, opts), s, p in zip(PLACEMENTS, steps, peaks)}


def test_the_fastest_that_fits_wins_and_a_near_tie_goes_to_the_simpler():
    peaks = [500, 300, 300, 200, 100]
    choice = choose(PLACEMENTS, _fixed(_table([1.0, 0.9, 0.95, 1.2, 1.5], peaks)), None)
    assert choice.chosen == "sharding='optimizer'" and choice.winner.verdict.startswith("chosen")
    tie = choose(PLACEMENTS, _fixed(_table([1.0, 1.0 - TIE / 2, 1.1, 1.2, 1.5], peaks)), None)
    assert tie.chosen == "replicated" and "simpler" in tie.winner.verdict
    tight = choose(PLACEMENTS, _fixed(_table([1.0, 0.9, 0.95, 1.2, 1.5], peaks)), 150)
    assert tight.chosen == "sharding='full'"
    assert all(c.verdict.startswith("does not fit") for c in tight.candidates if c.name != tight.chosen)
    assert tight.options() == {"sharding": "full", "reshard_after_forward": True}


def test_an_earlier_runs_choice_is_kept_only_while_it_fits_and_is_in_the_band():
    peaks = [500, 300, 300, 200, 100]
    steps = [1.0, 1.0 - TIE / 2, 1.1, 1.0 - TIE / 3, 1.5]  # replicated, optimizer and full (no reshard) in the band
    near = "sharding='full', reshard_after_forward=False"
    kept = choose(PLACEMENTS, _fixed(_table(steps, peaks)), None, earlier=near)
    assert kept.chosen == near and "earlier run" in kept.winner.verdict
    assert all(f"an earlier run chose {near}" in c.verdict for c in kept.candidates if c.name in ("replicated", "sharding='optimizer'"))
    for earlier in ("sharding='full'", "sharding='optimizer', gather='forward'", "no such placement", None):  # out of the band
        assert choose(PLACEMENTS, _fixed(_table(steps, peaks)), None, earlier=earlier).chosen == "replicated"
    assert choose(PLACEMENTS, _fixed(_table(steps, peaks)), 250, earlier="replicated").chosen == near  # no longer fits


def test_a_budget_nothing_fits_names_the_smallest_peak():
    with pytest.raises(ValueError, match=r"memory_budget=99 bytes.*smallest predicted peak is sharding='full''s, 100 bytes"):
        choose(PLACEMENTS, _fixed(_table([1.0] * 5, [500, 300, 300, 200, 100])), 99)


def test_without_an_optimizer_only_replicated_is_weighed():
    assert [n for n, _ in placements(False)] == ["replicated"]


def test_full_sharding_weighs_holding_the_smaller_parameters_whole():
    MB = 2**20
    # a GPT-2 small's sizes: a 147 MB embedding, 3 MB of positions, blocks of 2.25-9 MB weights, LayerNorms and biases
    gpt = [768 * 4] * 100 + [50257 * 768 * 4, 1024 * 768 * 4] + [768 * 2304 * 4, 768 * 768 * 4, 768 * 3072 * 4, 3072 * 768 * 4, 2304 * 4, 3072 * 4] * 12
    splits = whole_below_splits(gpt)
    assert splits == (4, 7, 10)  # each a round number of MB between two sizes, the blocks whole at 10
    for mb in splits:
        below = int(mb * MB)
        assert not any(below - 1 <= n < below + 1 for n in gpt)  # between sizes, never at one
    assert max(gpt) >= int(max(splits) * MB)  # the embedding is always sharded
    assert whole_below_splits([4096] * 8) == ()  # one size: nothing to split
    assert whole_below_splits([10 * MB, 16]) == ()  # a split holding almost nothing whole is full sharding
    names = [n for n, _ in placements(True, gpt)]
    assert names[:5] == [n for n, _ in PLACEMENTS]
    assert names[5:7] == ["sharding='full', reshard_after_forward=False, replicate_below_mb=10", "sharding='full', replicate_below_mb=10"]
    assert dict(placements(True, gpt)[6][1]) == {"sharding": "full", "reshard_after_forward": True, "replicate_below_mb": 10}


def test_with_a_mixed_precision_policy_only_full_sharding_is_weighed():
    names = [n for n, _ in placements(True, [10 * 2**20, 2**20, 2**20], mixed_precision=True)]
    assert names[:2] == ["sharding='full', reshard_after_forward=False", "sharding='full'"] and len(names) > 2
    assert all(n.startswith("sharding='full'") for n in names)
    assert placements(False, mixed_precision=True) == ()  # full sharding needs the optimizer


def test_a_policy_sends_gathers_narrow_and_reduces_wide(gpt_facts):
    _, facts = gpt_facts  # traced in fp32: as if traced in bf16, the parameters twice the bytes the graphs compute
    full = _step(facts, sharding="full", bandwidth=0.1)
    wide = _step(facts, sharding="full", bandwidth=0.1, precision=(2.0, 2.0))
    assert wide.update == pytest.approx(2 * full.update)  # the parts updated in their own dtype
    assert wide.backward > full.backward and wide.forward == full.forward  # reduces twice the bytes, gathers the same
    everything = max(s.nbytes for g in facts for s in g.backward.slots) + 1
    assert _step(facts, sharding="full", whole_below=2 * everything, precision=(2.0, 1.0)).collectives == \
        _step(facts, sharding="full", whole_below=everything).collectives  # the option counts the parameter's own bytes


def test_parameters_held_whole_are_never_gathered_and_send_one_collective_per_bucket(gpt_facts):
    _, facts = gpt_facts
    full = _step(facts, sharding="full")
    (graph,) = facts
    everything = max(s.nbytes for s in graph.backward.slots) + 1
    whole = _step(facts, sharding="full", whole_below=everything)
    assert whole.collectives < full.collectives and whole.forward < full.forward  # no gather left to wait for
    assert whole.update == pytest.approx(_step(facts).update, rel=0.01)  # every parameter updated whole
    assert _step(facts, sharding="full", whole_below=0) == full
    assert _step(facts, sharding="optimizer", whole_below=everything) == _step(facts, sharding="optimizer")


def test_a_choice_round_trips_and_its_fingerprint_is_its_content():
    choice = choose(PLACEMENTS, _fixed(_table([1.0, 0.9, 0.95, 1.2, 1.5], [5, 3, 3, 2, 1])), None)
    back = PlacementChoice.from_dict(json.loads(json.dumps(choice.to_dict())))
    assert back == choice and back.fingerprint() == choice.fingerprint()
    other = dataclasses.replace(choice, chosen="replicated")
    assert other.fingerprint() != choice.fingerprint()
    assert "sharding='auto' chose sharding='optimizer'" in choice.to_table()


def test_the_timed_example_writes_no_gradient_and_leaves_buffers_and_random_streams():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(16, 4)
    state = torch.get_rng_state()
    forward, backward = time_example(model, x, model)
    assert forward > 0 and backward > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), state)
    class Namespaced(torch.nn.Linear):  # a loss inside a namespace is found; an output with no gradient times no backward
        def forward(self, x):
            return types.SimpleNamespace(loss=super().forward(x).sum(), label=torch.zeros(2, dtype=torch.long))

    model = Namespaced(4, 4)
    assert time_example(model, x, model)[1] > 0
    assert time_example(lambda x: model(x).label, x, model)[1] == 0.0
    assert update_seconds_per_byte(torch.optim.AdamW(model.parameters()), torch.device("cpu")) > 0
    assert update_seconds_per_byte(torch.optim.LBFGS(model.parameters()), torch.device("cpu")) is None


def test_the_planning_trace_leaves_buffers_and_random_streams_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(16, 4)
    state = torch.get_rng_state()
    trace_model(model, x, None, min_cut=False)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), state)


def test_explain_chooses_as_a_run_would_and_its_schedules_carry_the_choice(capsys):
    import graphddp
    from graphddp.frontend.cli import main
    from graphddp.values.part_schedule import FullSchedule

    torch.manual_seed(0)
    model, x = TinyGPT(), torch.randint(0, 64, (4, 16))
    plans = graphddp.explain(model, x, world_size=8, backend="aot_eager", sharding="auto", optimizer=torch.optim.AdamW)
    choice = plans[0].choice
    names = [c.name for c in choice.candidates]
    assert names == [n for n, _ in placements(True, [p.numel() * p.element_size() for p in model.parameters()])]
    assert names[:5] == [n for n, _ in PLACEMENTS] and len(names) > 5  # and full sharding holding the smaller parameters whole
    assert type(plans[0]).from_json(plans[0].to_json()).choice == choice
    least = min(c.peak_bytes for c in choice.candidates)
    tight = graphddp.explain(model, x, world_size=8, backend="aot_eager", sharding="auto", optimizer=torch.optim.AdamW,
                             memory_budget=least)
    assert isinstance(tight[0], FullSchedule) and tight[0].choice.winner.peak_bytes == least
    with pytest.raises(ValueError, match="memory_budget=1 bytes"):
        graphddp.explain(model, x, world_size=8, backend="aot_eager", sharding="auto", optimizer=torch.optim.AdamW, memory_budget=1)
    unsharded = graphddp.explain(model, x, world_size=8, backend="aot_eager", sharding="auto")
    assert [c.name for c in unsharded[0].choice.candidates] == ["replicated"]  # sharding needs optimizer=
    assert main(["explain", "examples/factories.py:mlp", "--sharding", "auto", "--optimizer", "AdamW", "--backend", "aot_eager",
                 "--world-size", "4"]) == 0
    assert "sharding='auto' chose" in capsys.readouterr().out


def test_auto_weighs_a_hugging_face_model_from_its_keyword_batch():
    import graphddp
    from graphddp.models import tiny_hf_gpt2, tiny_hf_gpt2_batch

    model, batch = tiny_hf_gpt2(), tiny_hf_gpt2_batch(0, 0)
    model.config.use_cache = True  # as GPT2Config leaves it: the traced code makes a constant (its cache)
    opt = torch.optim.AdamW(model.parameters())
    trace = trace_model(model, batch, opt, min_cut=True)
    assert {s.param_name for g in trace.steps for s in g.backward.slots} == {n for n, _ in model.named_parameters()}
    # under a bf16 policy the graphs compute in bf16: half the activations and gradients, the parameters' facts their own
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = trace_model(model, batch, opt, min_cut=True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)).memory
    assert (bf16.compute_itemsize, bf16.reduce_itemsize, bf16.params) == (2, 2, trace.memory.params)
    total = lambda facts, what: sum(getattr(g, what) for g in facts.recomputed)  # noqa: E731
    assert total(trace.memory, "gradients") == 2 * total(bf16, "gradients")
    assert total(bf16, "saved") < 0.75 * total(trace.memory, "saved")  # the loss's graph upcasts its logits to fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    plans = graphddp.explain(model, batch["input_ids"], world_size=4, backend="aot_eager", sharding="auto", optimizer=torch.optim.AdamW)
    peaks = {c.name: c.peak_bytes for c in plans[0].choice.candidates}
    assert peaks["sharding='full'"] < peaks["sharding='optimizer'"] < peaks["replicated"]
