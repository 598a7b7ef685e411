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
    # read, shown and loaded as every mode's schedule: one table renderer (no predicted times), a JSON round trip
    assert graphddp.render.table(s) == table and not s.predicted
    with pytest.raises(ValueError, match="sharding='full' has no predicted timeline"):
        s.to_table(timeline=object())
    for draw in (graphddp.render.chrome_trace, graphddp.render.dot, lambda s: graphddp.render.plot(s, "x.png")):
        with pytest.raises(ValueError, match=r"graphddp\.render\.\w+: this schedule has no predicted timeline"):
            draw(s)
    again = FullSchedule.from_json(json.dumps(json.loads(s.to_json())))
    assert again.to_dict() == s.to_dict() and again.fingerprint() == s.fingerprint() and again.to_table() == table


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
