"""The cost model ``bucket_cap_mb="auto"`` plans with, measured on the process group.

What must hold (graphddp/runtime/calibrate.py's docstring): every rank of a group ends up with the same
numbers even when the ranks measure different ones (else they would plan different buckets and
the in-band layout check would stop them), the numbers are the slowest rank's, a group is
measured once, a group of one rank sends nothing, and a fake group measures nothing. The
planner's use of the result is in test_autoplan.py and ranks/test_ddp_matrix.py ("auto_buckets"); ranks
that measure differently: ranks/test_calibrate_ranks.py.
"""
from __future__ import annotations

import torch.distributed as dist

from graphddp import CostModel
from graphddp.runtime import calibrate


def test_a_fake_group_measures_nothing_and_says_so(fake_world):
    fake_world(64)
    model = calibrate.calibrate(dist.group.WORLD)
    assert model.numbers == CostModel().numbers
    assert "fake process group of 64 ranks" in model.source


def test_two_significant_figures():
    assert [calibrate._round2(x) for x in (0.0, 1234.5, 0.012345, 9.96, float("inf"))] == [0.0, 1200.0, 0.012, 10.0, float("inf")]
