"""Hybrid sharding's plan in one process: the placement value, its cost, ``explain(device_mesh=)``
and the refusals of ``device_mesh=`` (the training itself: tests/ranks/test_hybrid.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import graphddp
from graphddp.models import MLP
from graphddp.values.collectives import kind
from graphddp.values.placement import Level, Placement
from graphddp.values.prediction import CostModel
from graphddp.values.schedule import Schedule

HYBRID = Placement(Level("s", 4), Level("r", 2))


def test_a_hybrid_reduce_costs_a_reduce_scatter_over_the_shard_group_and_an_all_reduce_of_a_part_over_the_replicas():
    cost, nbytes = CostModel(latency_us=10.0, bandwidth_gbps=10.0), 8 << 20
    expected = kind("reduce_scatter").seconds(cost, nbytes, 4) + kind("all_reduce").seconds(cost, nbytes // 4, 2)
    assert HYBRID.reduce_seconds(cost, nbytes) == pytest.approx(expected)
    assert HYBRID.world == 8 and HYBRID.shape() == (2, 4) and HYBRID.hybrid
    # The link between replicas carries 1/S of the bucket: less than a flat reduce-scatter over all 8 ranks.
    assert HYBRID.reduce_seconds(cost, nbytes) < kind("all_reduce").seconds(cost, nbytes, 8)
    assert Placement(Level("w", 8)).reduce_seconds(cost, nbytes) == pytest.approx(kind("reduce_scatter").seconds(cost, nbytes, 8))


def _explain(**options):
    """aot_eager: every check here reads the plan, which inductor's C++ would only wait for."""
    torch.manual_seed(0)
    return graphddp.explain(
        MLP(width=32, depth=4), torch.randn(8, 16), optimizer=torch.optim.AdamW, bucket_cap_mb=0.004, backend="aot_eager", **options
    )


def test_explain_with_a_mesh_plans_both_levels_and_ranks_agree_on_the_shape_not_the_group_names():
    (hybrid,) = _explain(device_mesh=(2, 4), sharding="optimizer")
    assert hybrid.world_size == 8 and hybrid.placement is not None and hybrid.placement.shape() == (2, 4)
    assert all(b.collective == "reduce_scatter" for b in hybrid.buckets)
    table = hybrid.to_table()
    assert "sharded over 4 ranks, replicated over 2" in table, table
    (flat,) = _explain(world_size=8, sharding="optimizer")
    assert flat.placement is not None and not flat.placement.hybrid and "replicated over" not in flat.to_table()
    assert hybrid.fingerprint() != flat.fingerprint()  # another placement is another plan
    renamed = Placement(Level("another", 4), Level("names", 2))
    assert dataclasses.replace(hybrid, placement=renamed).fingerprint() == hybrid.fingerprint()
    assert Schedule.from_json(hybrid.to_json()) == hybrid
    assert hybrid.wire_layout() != flat.wire_layout()


def test_explain_refuses_a_mesh_that_is_not_a_shape():
    with pytest.raises(ValueError, match="device_mesh= is a shape"):
        _explain(device_mesh=(2,), sharding="optimizer")


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "needs sharding='optimizer', 'full' or 'auto'"),
        ({"sharding": "optimizer", "process_group": "given"}, "not both"),
    ],
)
def test_a_two_dim_mesh_is_refused_by_name_where_it_means_nothing(fake_world, options, message):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    options = {**options}
    if options.get("process_group") == "given":
        options["process_group"] = dist.group.WORLD
    model = MLP(width=8, depth=2)
    with pytest.raises(ValueError, match=message):
        graphddp.compile(model, device_mesh=mesh, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **options)


def test_a_mesh_of_three_dims_is_refused(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 2, 2))
    model = MLP(width=8, depth=2)
    with pytest.raises(ValueError, match="1 or 2 dims"):
        graphddp.compile(model, device_mesh=mesh, sharding="optimizer", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_one_dim_mesh_is_its_group(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (4,))
    model = MLP(width=8, depth=2)
    gd = graphddp.compile(model, device_mesh=mesh, backend="aot_eager", bucket_cap_mb=25)
    assert gd.process_group is mesh.get_group()


def test_explain_full_sharding_with_a_mesh_says_both_levels():
    (hybrid,) = _explain(device_mesh=(2, 4), sharding="full")
    (flat,) = _explain(world_size=4, sharding="full")
    assert hybrid.world_size == 4 and hybrid.replicas == 2 and flat.replicas == 1
    assert "8 ranks: sharded over 4, each part's gradient all-reduced over its 2 replicas" in hybrid.to_table()
    assert hybrid.memory.parameters == flat.memory.parameters  # 1/S per rank, whatever the replicas
    assert hybrid.fingerprint() != flat.fingerprint() and hybrid.to_dict()["replicas"] == 2
