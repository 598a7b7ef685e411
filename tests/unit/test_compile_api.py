"""The public entry point: argument errors, wrapper behaviour, re-planning per option."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphddp
from graphddp.graph.codeinspect import windows_in_generated_code
from graphddp.models import MLP
from graphddp.values.part_schedule import PartGraph


def test_requires_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        graphddp.compile(MLP())


def test_rejects_non_module(fake_world):
    fake_world(2)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        graphddp.compile(lambda x: x)


@pytest.mark.parametrize("option", ["bucket_cap_mb", "first_bucket_cap_mb"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "25", True])
def test_rejects_bad_caps(fake_world, option, value):
    fake_world(2)
    with pytest.raises(ValueError, match=option):
        graphddp.compile(MLP(), **{option: value})


def test_rejects_unknown_backend(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="backend"):
        graphddp.compile(MLP(), backend="tvm")


def test_rejects_parameters_on_several_devices(fake_world):
    fake_world(2)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"one device.*'0.weight' on cpu.*'1.weight' on meta"):
        graphddp.compile(model)


def test_wrapper_shares_parameters_and_state_dict_keys(fake_world):
    fake_world(4)
    inner = MLP()
    model = graphddp.compile(inner, backend="aot_eager")
    assert model.module is inner
    assert list(model.state_dict()) == list(inner.state_dict())
    assert [id(p) for p in model.parameters()] == [id(p) for p in inner.parameters()]
    plain = MLP()
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())


def test_caps_change_the_compiled_code_not_a_cached_copy(fake_world):
    """A cache hit must never reuse a graph rewritten for other options."""
    fake_world(2)
    counts = []
    for cap in (0.05, 100.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = graphddp.compile(MLP(width=128, depth=3), backend="inductor", bucket_cap_mb=cap, first_bucket_cap_mb=cap)
        model(torch.randn(8, 16)).sum().backward()
        (record,) = model.records
        assert len(windows_in_generated_code(record.generated_code)) == record.schedule.num_buckets
        counts.append(record.schedule.num_buckets)
    assert counts[0] > 1 and counts[1] == 1


@pytest.mark.parametrize("sharding,plan,variant", [
    (None, graphddp.Schedule, "carry"), ("optimizer", graphddp.Schedule, "carry"), ("full", PartGraph, "backward_update"),
])
def test_records_and_graphs_mean_the_same_in_every_mode(fake_world, sharding, plan, variant):
    """``model.records``: one per compiled backward with its plan and variants; ``model.graphs``:
    every compiled graph, each followed by its variants, the records' graphs among them."""
    fake_world(2)
    model = MLP(width=32, depth=2)
    options = {} if sharding is None else dict(sharding=sharding)
    ours = graphddp.compile(model, optimizer=torch.optim.AdamW(model.parameters()), backend="aot_eager", **options)
    ours(torch.randn(4, 16)).sum().backward()
    (record,) = ours.records
    assert (record.kind, record.index, type(record.schedule), list(record.variants)) == ("backward", 0, plan, [variant])
    assert [kind for kind, _ in ours.graphs] == ["forward", "backward", variant]
    assert ours.graphs[1][1] is record.graph and ours.graphs[2][1] is record.variants[variant].graph
    assert record.variants[variant].kind == variant
    assert len(ours.schedules) == 1


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)),
    lambda: nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4, sparse=True)}),
], ids=["embedding", "embedding_bag"])
def test_sparse_gradients_are_refused_at_wrap_time_by_name(fake_world, make):
    """DDP all-reduces sparse gradients apart; graphddp's buckets are dense, so it refuses them
    before anything compiles, naming the parameter and the option to change."""
    fake_world(2)
    with pytest.raises(ValueError, match=r"parameter '(0|bag)\.weight' gets sparse gradients .*sparse=False"):
        graphddp.compile(make())


def test_the_eager_backend_runs_the_rewritten_graphs_node_by_node(fake_world, monkeypatch):
    """backend="eager" interprets the graphs (for a debugger) and computes what aot_eager does."""
    fake_world(4)
    interpreted = []
    run = torch.fx.Interpreter.run
    monkeypatch.setattr(torch.fx.Interpreter, "run", lambda self, *a, **k: interpreted.append(self.module) or run(self, *a, **k))
    grads = {}
    for backend in ("aot_eager", "eager"):
        torch.manual_seed(0)
        model = MLP(width=32, depth=4)
        gd = graphddp.compile(model, backend=backend, bucket_cap_mb=0.005)
        interpreted.clear()
        gd(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads[backend] = [p.grad for p in model.parameters()]
        ran = {id(m) for m in interpreted}
        assert (id(gd.records[0].graph) in ran) == (backend == "eager"), backend
    for ours, theirs in zip(grads["eager"], grads["aot_eager"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
