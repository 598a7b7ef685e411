"""``graphddp.explain(..., sharding="full")`` for 64 ranks in one process: every gather and
reduce-scatter of the compiled forward and backward, read back from the graphs, and what each
rank holds. (A 2-rank run makes the same schedule: tests/ranks/test_explain_matches_a_run.py.)"""
from __future__ import annotations

import json

import pytest
import torch

import graphddp
from graphddp import models
from graphddp.values.part_schedule import FullSchedule
from graphddp.values.shards import chunk

WORLD = 64
CAP_MB = 0.004  # a few parameters a bucket: many buckets on a small GPT


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _gpt(kind: type = models.TinyGPT) -> torch.nn.Module:
    torch.manual_seed(0)
    return kind(vocab=64, dim=32, heads=2, layers=2, seq=16)


def _explain(model: torch.nn.Module, reshard: bool = True) -> list:
    return graphddp.explain(
        model, _tokens(), world_size=WORLD, sharding="full", reshard_after_forward=reshard, optimizer=torch.optim.AdamW,
        backend="aot_eager", bucket_cap_mb=CAP_MB,
    )


def _names(buckets) -> list[str]:
    return [name for b in buckets for name in b.params]


def test_the_schedule_shows_every_gather_and_reduce_scatter_and_each_ranks_memory():
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]  # the tied head once, as its embedding
    numels = [p.numel() for p in model.parameters()]
    (s,) = _explain(model)
    assert s.world_size == WORLD and s.reshard_after_forward and s.forward is not None and s.backward is not None
    gathers = s.forward.of("gather")
    assert len(gathers) > 3 and not s.forward.of("reduce_scatter")
    assert sorted(_names(gathers)) == sorted(names)  # every part gathered once, the tied one too
    assert set(_names(s.backward.of("reduce_scatter"))) == set(names)
    assert s.backward.of("gather"), "reshard_after_forward=True: the backward gathers again"
    for b in s.forward.buckets + s.backward.buckets:
        assert b.whole_bytes == WORLD * b.part_bytes and b.dtype == "float32"
        assert b.issue_at < b.wait_at and b.waited_before and b.issued_after
    parts = sum(chunk(n, WORLD) for n in numels) * 4
    assert sum(b.part_bytes for b in gathers) == parts
    m = s.memory
    # AdamW updates every part inside the backward: no gradient is left to hold
    assert sorted(s.backward.updates) == sorted(names) and not s.forward.updates
    assert (m.parameters, m.whole_parameters, m.gradients) == (parts, sum(numels) * 4, 0)
    assert 2 * parts <= m.optimizer_state <= 2 * parts + 8 * len(names)  # exp_avg, exp_avg_sq, a step each
    sizes = [b.whole_bytes for b in gathers]
    assert m.gathered_in_flight >= max(a + b for a, b in zip(sizes, sizes[1:]))
    # the backward reads the tied head first: its gather, one bucket's cap or more, is kept, not gathered again
    assert m.kept_to_backward == s.forward.kept_bytes == 64 * 32 * 4 > CAP_MB * 2**20
    assert "tok.weight" not in _names(s.backward.of("gather")) and "ln.weight" in _names(s.backward.of("gather"))
    table = s.to_table()
    assert all(n in table for n in names) and "reshard_after_forward=True" in table and "gather 0" in table
    # read, shown and loaded as every mode's schedule: the table with predicted times, a JSON round trip
    assert s.predicted and graphddp.render.table(s) != table and graphddp.render.table(s).startswith(table.splitlines()[0])
    again = FullSchedule.from_json(json.dumps(json.loads(s.to_json())))
    assert again.to_dict() == s.to_dict() and again.fingerprint() == s.fingerprint() and again.to_table() == table
    assert graphddp.render.table(again) == graphddp.render.table(s)


def test_every_renderer_draws_the_forward_and_the_backward_as_predicted(tmp_path):
    """A placed graph's timeline (graphddp.plan.cost.simulate_full): per graph, a compute lane with
    every compute node and each collective's issue, a link lane with every bucket one at a time,
    each starting no earlier than its issue; the trace, the dot and the plot draw both graphs."""
    (s,) = _explain(_gpt())
    timelines = graphddp.plan.cost.simulate_full(s)
    assert len(timelines) == 2
    for graph, t in zip(s.graphs, timelines):
        assert len(t.buckets) == len(graph.buckets) and all(b.ready <= b.start < b.end for b in t.buckets)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(t.buckets, t.buckets[1:])), "one bucket on the link at a time"
        assert t.step_seconds >= max(t.compute_seconds, t.buckets[-1].end - 1e-12) and t.exposed_seconds > 0
        computed = {sp.name for sp in t.compute}
        assert {graph.facts[b.issue_at].name for b in graph.buckets} <= computed, "an issue takes the host's time"
        assert not {graph.facts[b.wait_at].name for b in graph.buckets} & computed, "a wait computes nothing"
    table = graphddp.render.table(s)
    assert table.count("predicted (10 Gbit/s, 20 us): forward compute") == 1 and "predicted (10 Gbit/s, 20 us): backward" in table
    trace = graphddp.render.chrome_trace(s)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"graphddp forward graph 0", "graphddp backward graph 0"}
    comm = [e for e in trace["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"]
    assert len(comm) == len(s.forward.buckets) + len(s.backward.buckets)
    assert {e["cat"] for e in comm} == {"gather", "reduce_scatter"} and set(trace["otherData"]["graphs"]) == names
    dot = graphddp.render.dot(s)
    assert dot.count("digraph") == 2 and dot.count("shape=box") == len(comm) == dot.count("shape=octagon")
    graphddp.render.plot(s, str(tmp_path / "full.png"))
    assert (tmp_path / "full.png").stat().st_size > 0
    unplaced = FullSchedule.from_dict({**s.to_dict(), "forward": {**s.to_dict()["forward"], "facts": []}})
    assert not unplaced.predicted and graphddp.render.table(unplaced) == s.to_table()
    with pytest.raises(ValueError, match=r"graphddp\.render\.dot: this schedule has no predicted timeline"):
        graphddp.render.dot(unplaced)


def test_kept_to_the_backward_the_backward_only_reduce_scatters():
    (s,) = _explain(_gpt(), reshard=False)
    assert not s.backward.of("gather") and s.backward.of("reduce_scatter")
    # every gathered parameter the backward reads (a bias's gradient reads none), read off the forward's outputs
    weights = sum(b.whole_bytes for b in s.forward.of("gather"))
    assert s.memory.kept_to_backward == s.forward.kept_bytes and 0.9 * weights < s.memory.kept_to_backward <= weights
    (resharded,) = _explain(_gpt())
    assert resharded.fingerprint() != s.fingerprint()


def test_a_graph_break_gives_a_schedule_per_graph_and_the_tied_weight_is_gathered_in_both():
    model = _gpt(models.BreakGPT)
    first, second = _explain(model)
    assert (first.graph_index, second.graph_index) == (0, 1)
    assert "tok.weight" in _names(first.forward.of("gather")) and "tok.weight" in _names(second.forward.of("gather"))
    assert set(_names(first.forward.of("gather"))) | set(_names(second.forward.of("gather"))) == {n for n, _ in model.named_parameters()}
    assert "blocks.1.mlp.0.weight" not in _names(first.forward.of("gather"))


def test_explain_names_a_bad_optimizer():
    with pytest.raises(ValueError, match="optimizer= makes the optimizer from parameters"):
        graphddp.explain(models.MLP(), torch.randn(2, 16), optimizer="adamw")
    with pytest.raises(ValueError, match="optimizer= must make a torch.optim.Optimizer from parameters, it made list"):
        graphddp.explain(models.MLP(), torch.randn(2, 16), optimizer=list)


def test_the_table_says_how_far_ahead_gathers_are_issued_not_a_count_of_buckets():
    """One gather bucket in the listing: the head line names the prefetch depth as a depth, and the
    count of gather buckets only where the listing counts them."""
    from graphddp.plan.parts import PREFETCH

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    (s,) = graphddp.explain(mlp, torch.randn(4, 8), world_size=WORLD, sharding="full", optimizer=torch.optim.AdamW,
                            backend="aot_eager")
    assert len(s.forward.of("gather")) == 1 and PREFETCH == 2
    head = s.to_table().splitlines()[0]
    assert head.endswith(f"gathers issued up to {PREFETCH} bucket(s) ahead of the one being read"), head
    assert "gather bucket(s)" not in head


def test_a_placed_graph_waits_for_its_gather_only_where_the_compute_has_not_hidden_it():
    """By hand: a gather issued at node 0 and waited at node 3 behind two compute nodes; its link
    time either hides behind them (the graph takes the compute's time) or the compute stops at the wait."""
    from graphddp.plan.cost import simulate_full
    from graphddp.values.part_schedule import PartBucket, PartGraph, RankMemory
    from graphddp.values.prediction import CostModel
    from graphddp.values.schedule import NodeFact

    facts = (
        NodeFact("gather", 0, False), NodeFact("mm_1", 1, True, flops=10**9), NodeFact("mm_2", 2, True, flops=10**9),
        NodeFact("wait", 3, False), NodeFact("mm_3", 4, True, flops=10**9),
    )
    gather = PartBucket("gather", 0, (0,), ("w",), "float32", whole_bytes=8 * 2**20, part_bytes=2**20, issue_at=0, wait_at=3)
    memory = RankMemory(0, 0, 0, 0, 0, 0)
    schedule = FullSchedule(0, 8, False, 2, PartGraph("forward", (gather,), facts=facts), None, memory)
    for gbps, stalls in ((1000.0, False), (1.0, True)):
        cost = CostModel(compute_tflops=1.0, bandwidth_gbps=gbps, latency_us=0.0, op_overhead_us=0.0, collective_overhead_us=0.0,
                         collective_host_share=0.0)
        (t,) = simulate_full(schedule, cost)
        link = 7 / 8 * 8 * 2**20 * 8 / (gbps * 1e9)  # a ring all-gather: (p-1)/p of the whole bytes
        (b,) = t.buckets
        assert (b.ready, b.start) == (0.0, 0.0) and b.end == pytest.approx(link)
        assert t.compute_seconds == pytest.approx(3e-3)
        assert [s.name for s in t.compute] == ["mm_1", "mm_2", "mm_3"]
        third = t.compute[-1]
        assert third.start == pytest.approx(max(2e-3, link)) and stalls == (link > 2e-3)
        assert t.step_seconds == pytest.approx(third.end)
