"""Predictions at scale: link presets, a two-level topology and how a ring is priced on it,
``explain(world_size=1024, cost=NAME)`` and the CLI's ``--cost``, and DDP's published ResNet-50
scaling table reproduced from its single-GPU step and the DGX-1 preset (tools/ddp_scaling.py)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import pytest

from graphddp.config import DDPConfig
from graphddp.frontend.cli import main
from graphddp.values import links
from graphddp.values.collectives import KINDS, kind
from graphddp.values.placement import Level, Placement
from graphddp.values.prediction import CostModel, Topology
from graphddp.values.schedule import Schedule
from tools import ddp_scaling

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1 << 20
DGX_H100 = links.preset("dgx-h100")


def test_a_ring_within_a_node_runs_on_its_link_and_one_across_nodes_on_the_slowest_hop():
    t = Topology(bandwidth_gbps=1000.0, latency_us=2.0, gpus_per_node=8, nics_per_node=4, inter_bandwidth_gbps=100.0,
                 inter_latency_us=10.0)
    inside = t.link(8)
    assert (inside.bandwidth_gbps, inside.latency_us) == (1000.0, 2.0) and type(inside) is CostModel
    # A flat ring over 2 nodes leaves each node through its 4 NICs (one ring per NIC); 1 of its 15 hops crosses.
    flat = t.link(16)
    assert flat.bandwidth_gbps == 400.0 and flat.latency_us == pytest.approx((14 * 2.0 + 10.0) / 15)
    # Replicate groups of one rank per node (ranks 8 apart): all 8 rings of a node share its NICs.
    assert t.link(4, stride=8).bandwidth_gbps == pytest.approx(50.0)
    # Ranks 2 apart: 4 of the group on a node, 2 such groups share the NICs.
    assert t.link(4, stride=2).bandwidth_gbps == 1000.0 and t.link(8, stride=2).bandwidth_gbps == pytest.approx(200.0)
    assert t.link(1024).bandwidth_gbps == 400.0 and t.link(1024).latency_us == pytest.approx((896 * 2.0 + 127 * 10.0) / 1023)
    # A fast NIC never makes the ring faster than the node's own link.
    assert dataclasses.replace(t, nics_per_node=8, inter_bandwidth_gbps=400.0).link(64).bandwidth_gbps == 1000.0
    # Every collective kind is priced on the level its ring crosses.
    for k in KINDS.values():
        assert k.seconds(t, 64 * MB, 16) == pytest.approx(k.seconds(flat, 64 * MB, 16))
        assert k.seconds(t, 64 * MB, 16) > k.seconds(t, 64 * MB, 8)


def test_a_single_link_cost_model_prices_every_group_as_before():
    cost = CostModel(bandwidth_gbps=10.0, latency_us=20.0)
    assert cost.link(1024, stride=8) is cost
    assert cost.allreduce_seconds(8 * MB, 4) == pytest.approx(6 * 20e-6 + 1.5 * 8 * MB * 8 / 10e9)
    assert kind("all_reduce").seconds(cost, 8 * MB, 4, stride=2) == kind("all_reduce").seconds(cost, 8 * MB, 4)
    assert cost.scaled(2.0, 4.0) == dataclasses.replace(cost, compute_tflops=0.1, memory_gbps=40.0, op_overhead_us=1.0,
                                                        bandwidth_gbps=40.0, latency_us=5.0)


def test_hybrid_sharding_prices_the_shard_group_inside_a_node_and_the_replicas_across_nodes():
    hybrid = Placement(Level("s", 8), Level("r", 16))  # 128 GPUs: shard within a node, replicate across 16 nodes
    nbytes = 256 * MB
    node, across = DGX_H100.link(8), DGX_H100.link(16, stride=8)
    assert node.bandwidth_gbps == 3600.0 and across.bandwidth_gbps == 400.0  # each rank has its own NDR NIC
    expected = kind("reduce_scatter").seconds(node, nbytes, 8) + kind("all_reduce").seconds(across, nbytes // 8, 16)
    assert hybrid.reduce_seconds(DGX_H100, nbytes) == pytest.approx(expected)
    flat = Placement(Level("w", 128))
    assert flat.reduce_seconds(DGX_H100, nbytes) == pytest.approx(kind("reduce_scatter").seconds(DGX_H100.link(128), nbytes, 128))
    # The scaled scenarios of an auto plan speed up both levels.
    assert DGX_H100.scaled(1.0, 2.0).link(16).bandwidth_gbps == 2 * DGX_H100.link(16).bandwidth_gbps


def test_every_preset_names_its_sources_and_survives_a_schedule_record():
    for name in links.names():
        t = links.preset(name)
        assert isinstance(t, Topology) and t.source == f"preset {name}"
    for figure in [*links.GPUS.values(), *links.NETWORKS.values(), *(n[-1] for n in links.NODES.values())]:
        source = figure if isinstance(figure, str) else figure.source
        assert source.startswith("https://"), figure
    assert links.preset("h100+ndr400x8").numbers == DGX_H100.numbers
    assert links.preset("a100+eth25").nics_per_node == 1 and links.preset("a100+eth25").inter_bandwidth_gbps == 25.0
    for bad in ("h100", "h100+ib", "tpu+eth25", "h100+eth25xfour", "h100+eth25x0"):
        with pytest.raises(ValueError):
            links.preset(bad)
    assert CostModel.from_dict(DGX_H100.to_dict()) == DGX_H100 and CostModel.from_dict(CostModel().to_dict()) == CostModel()
    assert DDPConfig(cost="dgx-a100").cost == links.preset("dgx-a100")
    with pytest.raises(ValueError, match="unknown link preset 'dgx-b200'"):
        DDPConfig(cost="dgx-b200")


def test_the_cli_plans_1024_ranks_on_a_preset(capsys):
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        start = time.perf_counter()
        assert main(["explain", "examples/factories.py:mlp", "--backend", "aot_eager", "--world-size", "1024",
                     "--cost", "dgx-h100", "--format", "json"]) == 0
        seconds = time.perf_counter() - start
    finally:
        os.chdir(here)
    schedules = [Schedule.from_dict(d) for d in json.loads(capsys.readouterr().out)]
    assert schedules and all(s.world_size == 1024 and s.cost_model == DGX_H100 for s in schedules)
    assert seconds < 60, seconds  # one compile and a plan; nothing grows with the ranks
    with pytest.raises(SystemExit) as bad:  # a usage error, before the model is loaded
        main(["explain", "examples/factories.py:mlp", "--cost", "dgx-b200"])
    assert bad.value.code == 2 and "unknown link preset 'dgx-b200'" in capsys.readouterr().err


def test_ddp_published_resnet50_scaling_is_reproduced_within_ten_percent():
    rows = ddp_scaling.table()
    assert [n for n, _, _ in rows] == [1, 2, 4, 8, 16]
    for n, measured, predicted in rows:
        assert abs(predicted / measured - 1) < 0.10, (n, measured, predicted)
    assert [p for _, _, p in rows] == sorted(p for _, _, p in rows)  # more ranks, never faster
    # The check can fail: the same machines on one 10 Gbit/s NIC each would miss 16 GPUs by far.
    slow = dataclasses.replace(links.preset("dgx-1"), nics_per_node=1, inter_bandwidth_gbps=10.0)
    (_, measured, predicted), = [r for r in ddp_scaling.table(slow) if r[0] == 16]
    assert predicted / measured > 1.5


def test_resnet50_as_written_has_torchvisions_parameters_and_flops():
    layers = ddp_scaling.resnet50()
    params = sum(math.prod(s) for _, shapes, _ in layers for s in shapes)
    assert params == 25_557_032  # torchvision.models.resnet50's num_params
    assert sum(f for *_, f in layers) / ddp_scaling.BATCH == pytest.approx(2 * 4.09e9, rel=0.01)  # 4.09 GMACs per image
