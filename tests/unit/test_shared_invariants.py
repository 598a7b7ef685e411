"""The invariants every mode shares (``graphddp.graph.invariants``), each broken once per placement.

One mutation per shared invariant, run on the graph each placement compiles (replicated with
the optimizer attached, ``sharding="optimizer"``, ``sharding="full"``, and the hybrid ones of
a 2 x 4 mesh) and checked by that mode's verifier: the failure names the invariant's rule in
that mode. The mutations that need
one mode's structure (a sharded bucket's gather, a replicated bucket's layout) stay beside
that mode's tests.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.fx as fx

from graphddp.graph.capture import output_nodes
from graphddp.graph.verify import VerificationError, check_part_collectives, check_part_updates
from graphddp.optim.clip import CLIP_COEFFICIENT
from graphddp.optim.verify import verify_sharded, verify_updates
from graphddp.values.comm import ROLE_KEY

Check = Callable[[fx.GraphModule], None]


def _replicated(fake_world) -> tuple[fx.GraphModule, Check, int]:
    """The backward with AdamW's update after each all-reduce; the output of an updated parameter."""
    from test_optim import _compiled

    _, _, record = _compiled(fake_world)
    slot = next(s for b in record.schedule.buckets for s in b.slots if s.param_name in b.updates)
    return record.graph, lambda gm: verify_updates(gm, record.schedule), slot.output_index


def _sharded(fake_world) -> tuple[fx.GraphModule, Check, int]:
    from test_sharded_graph import _compiled

    *_, record = _compiled(fake_world)
    return record.graph, lambda gm: verify_sharded(gm, record.schedule), record.schedule.buckets[0].slots[0].output_index


def _full(fake_world) -> tuple[fx.GraphModule, Check, int]:
    from test_part_collectives import _updating

    fake_world(8)
    variant, updated = _updating()
    return variant, lambda gm: check_part_updates(gm, updated), min(updated)


PLACEMENTS = {"replicated": (_replicated, "U2"), "optimizer": (_sharded, "S4"), "full": (_full, "P4")}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_g_an_updated_tensor_whose_gradient_is_returned_too(fake_world, placement):
    """G: the gradient of a tensor the graph updates handed back as well (it would be stepped twice)."""
    build, rule = PLACEMENTS[placement]
    gm, check, index = build(fake_world)
    check(gm)  # as compiled
    gm = copy.deepcopy(gm)
    outs = output_nodes(gm)
    assert outs[index] is None
    outs[index] = next(iter(gm.graph.nodes))  # any value: a first input
    gm.graph.output_node().args = (tuple(outs),)
    with pytest.raises(VerificationError, match=rf"its gradient is still returned \({rule}\)"):
        check(gm)


@pytest.mark.parametrize("placement, rule", [("replicated", "U7"), ("optimizer", "S6")])
def test_c_a_clip_coefficient_without_max_grad_norm(fake_world, placement, rule):
    """C: a coefficient in a graph that clips nothing (the parameters would be scaled anyway)."""
    gm, check, _ = PLACEMENTS[placement][0](fake_world)
    gm = copy.deepcopy(gm)
    next(iter(gm.graph.nodes)).meta[ROLE_KEY] = CLIP_COEFFICIENT
    with pytest.raises(VerificationError, match=rf"a clip coefficient in a graph whose schedule has no max_grad_norm \({rule}\)"):
        check(gm)


def _clipped_replicated(fake_world) -> tuple[fx.GraphModule, Check]:
    from test_clip import _pair

    gd, *_ = _pair(fake_world)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return record.graph, lambda gm: verify_updates(gm, record.schedule)


def _clipped_sharded(fake_world) -> tuple[fx.GraphModule, Check]:
    from test_sharded_clip import _compiled

    record = _compiled(fake_world)
    return record.graph, lambda gm: verify_sharded(gm, record.schedule)


@pytest.mark.parametrize("build, rule", [(_clipped_replicated, "U7"), (_clipped_sharded, "S6")], ids=["replicated", "optimizer"])
def test_c_a_second_clip_coefficient(fake_world, build, rule):
    """C: two coefficients would clip the parameters by two norms."""
    gm, check = build(fake_world)
    check(gm)  # as compiled
    gm = copy.deepcopy(gm)
    (coef,) = [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == CLIP_COEFFICIENT]
    coef.prev.meta[ROLE_KEY] = CLIP_COEFFICIENT
    with pytest.raises(VerificationError, match=rf"2 clip coefficients, expected 1 \({rule}\)"):
        check(gm)


def _hybrid_sharded(fake_world) -> tuple[fx.GraphModule, Check]:
    from torch.distributed.device_mesh import init_device_mesh

    import graphddp
    from graphddp.models import MLP

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, sharding="optimizer", backend="aot_eager", bucket_cap_mb=0.005, device_mesh=mesh)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return record.graph, lambda gm: verify_sharded(gm, record.schedule)


def _hybrid_full(fake_world) -> tuple[fx.GraphModule, Check]:
    from test_part_collectives import _hybrid_backward

    fake_world(8)
    backward, placement = _hybrid_backward()
    parts = [f"primals_{k}" for k in range(1, 13)]
    return backward, lambda gm: check_part_collectives(gm, backward=True, parts=parts, placement=placement)


@pytest.mark.parametrize("build, rule", [(_hybrid_sharded, "S1"), (_hybrid_full, "P6")], ids=["optimizer", "full"])
@pytest.mark.parametrize("mutation", ["on the shard group", "of the local gradient"])
def test_h_a_part_not_averaged_over_its_replicas(fake_world, build, rule, mutation):
    """H: the part's all-reduce moved to the shard group (it averages over the wrong ranks), or
    fed what the reduce-scatter sends instead of the part it delivers (this rank's gradient)."""
    from graphddp.values.comm import BUCKET_KEY
    from graphddp.values.placement import REPLICATE

    gm, check = build(fake_world)
    check(gm)  # as compiled
    gm = copy.deepcopy(gm)
    replica = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == REPLICATE)
    scatter = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "reduce_scatter" and n.meta[BUCKET_KEY] == replica.meta[BUCKET_KEY])
    if mutation == "on the shard group":
        replica.args = (*replica.args[:2], scatter.args[-1])
        expected = rf"runs on group .*, not the replicate group .* \({rule}\)"
    else:
        replica.args = (scatter.args[0], *replica.args[1:])
        expected = rf"all-reduced over the replicate group by \[\], not once by its bucket's all-reduce \({rule}\)"
    with pytest.raises(VerificationError, match=expected):
        check(gm)
