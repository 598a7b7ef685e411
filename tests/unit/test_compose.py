"""The compiler's pass lists (graphddp.compiler.compose): a pass added to a backend's forward or
backward list runs on every compiled graph, in order, on every compile path, and what a
backward pass returns is the plan the graph keeps."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import graphddp
from graphddp.models import GraphBreakMLP


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_added_passes_run_on_every_graph_forward_and_backward(fake_world, backend, monkeypatch):
    # Passes added after compile() are not in the compile cache's key: a warm hit would skip them.
    monkeypatch.setenv("GRAPHDDP_COMPILE_CACHE", "0")
    fake_world(2)
    model = graphddp.compile(GraphBreakMLP(), backend=backend)
    seen: list[tuple[str, int, object]] = []

    def on_forward(gm, plan, *, graph_index, shared, **_):
        assert shared.fw_values, "the built-in forward pass ran first"
        seen.append(("forward", graph_index, plan))

    def on_backward(gm, plan, *, graph_index, **_):
        assert any(n.meta.get("graphddp_bucket") is not None for n in gm.graph.nodes), "after the collectives"
        seen.append(("backward", graph_index, plan))
        return dataclasses.replace(plan, optimizer="marked by a pass")

    model._state.backend.forward_passes.append(on_forward)
    model._state.backend.backward_passes.append(on_backward)
    model(torch.randn(4, 16)).sum().backward()
    graphs = len(model.schedules)
    assert graphs == 2  # the graph break
    # A backward pass runs on every variant of a graph's backward: the synchronising one, and the
    # carrying one (the step after no_sync) where the graph has one.
    variants = [1 + (model.records[i].carrying is not None) for i in range(graphs)]
    assert sorted((kind, i) for kind, i, _ in seen) == sorted(
        [("forward", i) for i in range(graphs)] + [("backward", i) for i in range(graphs) for _ in range(variants[i])]
    )
    assert all(plan is None for kind, _, plan in seen if kind == "forward")  # first graphs of their frames: no plan yet
    assert all(s.optimizer == "marked by a pass" for s in model.schedules)
