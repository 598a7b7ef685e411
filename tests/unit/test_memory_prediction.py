"""Memory predicted per placement (graphddp.plan.memory): values from hand-made facts, the liveness of a
hand-built graph, and the facts one trace of a small model gives. Measured against gloo ranks in
tests/ranks/test_memory_measured.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

import graphddp
from graphddp.graph.liveness import liveness, saved_storages
from graphddp.models import MLP
from graphddp.plan.memory import PLACEMENTS, GraphMemory, MemoryFacts, ParamFact, StateRule, predict, table

ADAM = StateRule("float32", per_element=8, fixed=4)


def _facts(**graph: int) -> MemoryFacts:
    """Two float32 parameters (10 and 7 elements, 68 bytes) and a frozen one, in one graph."""
    params = (ParamFact("a", 10, 4, True, "float32"), ParamFact("b", 7, 4, True, "float32"), ParamFact("c", 3, 4, False, "float32"))
    g = GraphMemory(**{"param_bytes": 80, "forward_peak": 100, "saved": 90, "gradients": 68, "backward_peak": 200,
                       "backward_peak_held": 250, **graph})
    return MemoryFacts(params, buffer_bytes=16, state=(ADAM,), graphs=(g,), recomputed=(g,), step_workspace=2.0, update_workspace=5.0)


def test_between_steps_counts_what_each_placement_keeps():
    facts = _facts()
    at = {p: predict(facts, p, 3).breakdown for p in PLACEMENTS}
    adam = lambda n: 8 * n + 4  # noqa: E731
    assert at["replicated"] == {"parameters": 80, "buffers": 16, "optimizer_state": adam(10) + adam(7), "bucket_buffers": 68 + 32}
    assert at["optimizer_inside"] == {**at["replicated"], "bucket_buffers": 0}
    # rank 0's parts: ceil(10 / 3) = 4 and ceil(7 / 3) = 3 elements; the frozen parameter has no state
    assert at["optimizer"] == {"parameters": 80, "buffers": 16, "optimizer_state": adam(4) + adam(3), "bucket_buffers": 0}
    assert at["optimizer_forward"] == {**at["optimizer"], "pending_gathers": 4 * (10 + 7)}  # gathered, not yet read
    assert at["full"] == at["full_no_reshard"] == {**at["optimizer"], "parameters": 4 * (4 + 3 + 1)}
    hybrid = predict(facts, "full", 6, shard_size=3)
    assert hybrid.breakdown == at["full"] and (hybrid.world_size, hybrid.shard_size) == (6, 3)
    assert predict(facts, "replicated", 1).breakdown["bucket_buffers"] == 0  # a group of one keeps no send buffer


def test_peak_is_the_fullest_phase():
    facts = _facts()
    replicated = predict(facts, "replicated", 2)
    # the backward graph with its saved activations held (250) beats its end with the flat copy (90 + 68 + 68)
    assert (replicated.phase, replicated.at_peak) == ("backward 0", {"activations": 0, "gradients": 0, "graph": 250})
    assert replicated.peak == replicated.between_steps + 250
    late = predict(_facts(backward_peak_held=100), "replicated", 2)
    assert late.phase == "bucket 0" and late.peak - late.between_steps == 90 + 68 + 68
    inside = predict(_facts(backward_peak_held=100), "optimizer_inside", 2)
    assert inside.phase == "update 0" and inside.peak - inside.between_steps == 90 + 68 + 5 * 40  # the largest parameter's update
    full = predict(facts, "full", 2)
    assert full.phase == "backward 0" and full.at_peak == {"activations": 0, "graph": 200, "gathered": 80}
    step = predict(_facts(backward_peak_held=10, saved=0, gradients=68), "replicated", 2)
    assert step.phase == "optimizer step" and step.at_peak == {"gradients": 68, "workspace": 80}


def test_parameters_held_whole_keep_their_bytes_and_state_and_are_not_gathered():
    facts = _facts(params=("a", "b", "c"))
    full = predict(facts, "full", 3)
    mixed = predict(facts, "full", 3, whole_below=30)  # b (28 bytes) and c (12) whole, a (40) sharded
    adam = lambda n: 8 * n + 4  # noqa: E731
    assert mixed.breakdown == {**full.breakdown, "parameters": 4 * (4 + 7 + 3), "optimizer_state": adam(4) + adam(7)}
    assert mixed.at_peak["gathered"] == 80 - 28 - 12 and full.at_peak["gathered"] == 80
    assert predict(facts, "full", 3, whole_below=0) == full
    assert predict(facts, "optimizer", 3, whole_below=30) == predict(facts, "optimizer", 3)  # full sharding's option only


def test_under_a_mixed_precision_policy_gradients_are_reduced_wider_and_whole_parameters_cast():
    # the graphs traced in bf16 (2 bytes an element), the gradients reduced in fp32 (4)
    policy = {"compute_itemsize": 2, "reduce_itemsize": 4}
    wide = dict(gradients=200, backward_peak=10, forward_peak=10)  # the bucket's phase the fullest
    plain, mixed = predict(_facts(**wide), "full", 2), predict(dataclasses.replace(_facts(**wide), **policy), "full", 2)
    assert mixed.breakdown == plain.breakdown  # parts and state in their own dtype
    assert plain.at_peak == {"activations": 0, "gradients": 200, "in_flight": 200}
    assert (mixed.phase, mixed.at_peak) == ("bucket 0", {"activations": 0, "gradients": 400, "in_flight": 400})
    held = _facts(params=("a", "b", "c"))  # b and c held whole: without a policy read as they are, with one cast
    assert predict(held, "full", 3, whole_below=30).at_peak["gathered"] == 80 - 28 - 12
    assert predict(dataclasses.replace(held, **policy), "full", 3, whole_below=30).at_peak["gathered"] == 80
    with pytest.raises(ValueError, match="mixed-precision policy predict full sharding only"):
        predict(dataclasses.replace(_facts(), **policy), "optimizer", 2)


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="placement must be one of"):
        predict(_facts(), "zero3", 2)
    with pytest.raises(ValueError, match="shard_size must divide world_size"):
        predict(_facts(), "full", 4, shard_size=3)
    with pytest.raises(ValueError, match="shards nothing"):
        predict(_facts(), "replicated", 4, shard_size=2)


def test_liveness_of_a_hand_built_backward():
    """saved (16 floats) and a tangent (4); the saved input dies after its last reader, and so does
    a temporary (16, read through a view that costs nothing); the gradient (16) lives to the end."""
    g = fx.Graph()
    saved, tangent = g.placeholder("saved"), g.placeholder("tangents_1")
    saved.meta["val"], tangent.meta["val"] = torch.empty(16), torch.empty(4)
    tmp = g.call_function(torch.ops.aten.mul.Tensor, (saved, 2.0))
    view = g.call_function(torch.ops.aten.view.default, (tmp, [4, 4]))
    grad = g.call_function(torch.ops.aten.add.Tensor, (view, tangent))
    g.output((grad,))
    for node, val in ((tmp, torch.empty(16)), (view, torch.empty(4, 4)), (grad, torch.empty(4, 4))):
        node.meta["val"] = val
    live = liveness(fx.GraphModule({}, g), ["saved", "tangents_1"])
    assert (live.saved, live.outputs) == (80, 64)
    assert live.peak_outputs_kept == 64 + 16 + 64  # saved and tangent and temporary, then tangent, temporary, gradient
    assert live.peak_inputs_held == 64 + 16 + 64 + 64  # the saved input held to the end: all four at once
    assert liveness(fx.GraphModule({}, g), ["tangents_1"]).saved == 16  # saved left out: a parameter's


def test_saved_storages_name_views_of_inputs_and_of_each_other():
    g = fx.Graph()
    w, x = g.placeholder("primals_1"), g.placeholder("primals_2")
    t = g.call_function(torch.ops.aten.t.default, (w,))
    relu = g.call_function(torch.ops.aten.relu.default, (x,))
    detach = g.call_function(torch.ops.aten.detach.default, (relu,))
    g.output((relu, t, detach))
    assert saved_storages(fx.GraphModule({}, g)) == {t.name: "primals_1", detach.name: relu.name}


@pytest.fixture(scope="module")
def mlp_predictions():
    torch.manual_seed(0)
    return graphddp.predict_memory(MLP(width=32), torch.randn(8, 16), world_size=2, optimizer=torch.optim.AdamW)


def test_one_trace_gives_every_placement(mlp_predictions):
    by = {p.placement: p for p in mlp_predictions}
    assert list(by) == list(PLACEMENTS)
    whole = sum(p.numel() * 4 for p in MLP(width=32).parameters())
    state = 2 * whole + 4 * 8  # AdamW's moments, and a float32 step per parameter: read off a probe, not assumed
    assert by["optimizer_inside"].breakdown == {"parameters": whole, "buffers": 0, "optimizer_state": state, "bucket_buffers": 0}
    assert by["full"].between_steps < by["optimizer"].between_steps < by["optimizer_inside"].between_steps < by["replicated"].between_steps
    assert all(p.peak > p.between_steps for p in mlp_predictions)
    text = table(mlp_predictions)
    assert text.count("\n") == len(PLACEMENTS) and "full_no_reshard" in text
    assert by["full"].to_dict()["breakdown"]["parameters"] == by["full"].breakdown["parameters"]
