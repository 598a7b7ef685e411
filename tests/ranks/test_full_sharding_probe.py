"""What the full-sharding design (docs/design-full-sharding.md) stands on, kept true: parameters
held as 1/N parts and read through an all-gathering getter trace into one forward graph with an
all-gather per read, AOTAutograd puts a reduce-scatter per part in the backward, and the parts'
gradients equal DDP's (tools/full_sharding_probe.py)."""
import json

import pytest

from graphddp.testing import spawn
from tools.full_sharding_probe import probe


@pytest.mark.parametrize("world", [2, 3])
def test_parts_gathered_in_the_graph_get_ddps_gradients(tmp_path, world):
    out = tmp_path / "report.json"
    spawn(probe, world, "mlp", "record", 2, str(out))  # asserts every part's gradient on every rank
    report = json.loads(out.read_text())
    forward, backward = report["graphs"]
    assert report["graph_breaks"] == 0
    assert forward["collectives"]["_c10d_functional.all_gather_into_tensor.default"] == 4
    assert backward["collectives"]["_c10d_functional.reduce_scatter_tensor.default"] == 4
    assert "_c10d_functional.all_gather_into_tensor.default" not in backward["collectives"]
    # AOTAutograd keeps the gathered weight the backward needs: no resharding by default.
    assert forward["saved_from_a_gather"] >= 1
