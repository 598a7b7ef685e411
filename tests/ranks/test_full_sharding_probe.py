"""What the full-sharding design (docs/design-full-sharding.md) stands on, kept true: parameters
held as 1/N parts and read through an all-gathering getter trace into one forward graph with an
all-gather per read, AOTAutograd puts a reduce-scatter per part in the backward, the parts'
gradients equal DDP's, and a selective checkpoint that recomputes the gathers makes the backward
gather again instead of keeping full parameters (tools/full_sharding_probe.py)."""
import json

import pytest

from graphddp.testing import spawn
from tools.full_sharding_probe import probe

GATHER = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


def _report(tmp_path, world, reshard):
    out = tmp_path / "report.json"
    spawn(probe, world, "mlp", "record", 2, str(out), reshard)  # asserts every part's gradient on every rank
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 3])
def test_parts_gathered_in_the_graph_get_ddps_gradients(tmp_path, world):
    report = _report(tmp_path, world, reshard=False)
    forward, backward = report["graphs"]
    assert report["graph_breaks"] == 0
    assert forward["collectives"][GATHER] == 4
    assert backward["collectives"][REDUCE_SCATTER] == 4
    assert GATHER not in backward["collectives"]
    # AOTAutograd keeps the gathered weight the backward needs: no resharding by default.
    assert forward["saved_from_a_gather"] >= 1


def test_recomputed_gathers_reshard_after_the_forward(tmp_path):
    forward, backward = _report(tmp_path, 2, reshard=True)["graphs"]
    assert forward["saved_from_a_gather"] == 0
    # Only the second layer's weight is needed again (the input needs no gradient).
    assert backward["collectives"][GATHER] == 1
    assert backward["collectives"][REDUCE_SCATTER] == 4
