"""The cost model ``bucket_cap_mb="auto"`` plans with, measured on the process group.

What must hold (graphddp/runtime/calibrate.py's docstring): every rank of a group ends up with the same
numbers even when the ranks measure different ones (else they would plan different buckets and
the in-band layout check would stop them), the numbers are the slowest rank's, a group is
measured once, a group of one rank sends nothing, and a fake group measures nothing. The
planner's use of the result is in test_autoplan.py and ranks/test_ddp_matrix.py ("auto_buckets"); ranks
that measure differently: ranks/test_calibrate_ranks.py.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from graphddp import CostModel
from graphddp.runtime import calibrate
from graphddp.testing import missing_torch_feature


def test_a_fake_group_measures_nothing_and_says_so(fake_world):
    fake_world(64)
    model = calibrate.calibrate(dist.group.WORLD)
    assert model.numbers == CostModel().numbers
    assert "fake process group of 64 ranks" in model.source


def test_two_significant_figures():
    assert [calibrate._round2(x) for x in (0.0, 1234.5, 0.012345, 9.96, float("inf"))] == [0.0, 1200.0, 0.012, 10.0, float("inf")]


@pytest.mark.skipif(bool(missing_torch_feature("caches")), reason=str(missing_torch_feature("caches")))
def test_a_calibration_kept_from_the_cache_says_where_and_how_to_measure_anew(fake_world, tmp_path, monkeypatch, caplog):
    """A run that plans with the numbers an earlier run stored logs the file and the switch that
    measures anew (GRAPHDDP_RECALIBRATE=1), which then replaces the stored numbers."""
    import dataclasses
    import logging
    import os

    from graphddp.runtime import calibration_store as store

    fake_world(1)  # one rank: the agreement on what is stored sends nothing
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(store.RECALIBRATE_ENV, raising=False)
    key = ("group", "gloo", 2, "cpu")
    first = CostModel(bandwidth_gbps=10.0, latency_us=20.0, source="calibrated on process group group (2 ranks, cpu)")
    noisy = dataclasses.replace(first, bandwidth_gbps=13.0, latency_us=0.0)
    with caplog.at_level(logging.INFO, logger="graphddp"):
        assert store.settle(first, key, dist.group.WORLD) is first  # nothing stored yet: stored now
        assert not caplog.records
        kept = store.settle(noisy, key, dist.group.WORLD)
    assert kept.numbers == first.numbers and "kept from an earlier run" in kept.source
    path = os.path.join(str(tmp_path), "graphddp", "calibration-group-gloo-2-cpu.json")
    (record,) = caplog.records
    assert record.levelno == logging.INFO and path in record.getMessage(), record.getMessage()
    assert "GRAPHDDP_RECALIBRATE=1" in record.getMessage() and "delete that file" in record.getMessage()
    monkeypatch.setenv(store.RECALIBRATE_ENV, "1")
    assert store.settle(noisy, key, dist.group.WORLD) is noisy  # measured anew, and stored
    monkeypatch.delenv(store.RECALIBRATE_ENV)
    assert store.settle(first, key, dist.group.WORLD).numbers == noisy.numbers


def test_a_link_fit_that_is_noise_is_measured_again_then_floored(fake_world, monkeypatch):
    """A busy machine's small all-reduce measured slow against the large ones puts the fitted
    latency at 0 us per ring step; a latency under its repeats' spread says as little. Such a fit
    is measured again; noise twice, the latency is the stated floor, and the source says so."""
    import torch

    from graphddp.plan.cost import LATENCY_FLOOR_US

    fake_world(2)
    cpu, group = torch.device("cpu"), dist.group.WORLD
    clean = [1.5e-3, 9.0e-3, 35.0e-3, 1e-5]  # all-reduces of calibrate.SIZES, then the first one's spread
    through_origin = [0.2e-3, 9.0e-3, 36.0e-3, 1e-5]  # the line's intercept below 0: latency 0
    spread_over = [1.5e-3, 9.0e-3, 35.0e-3, 5e-3]  # a fitted latency under the spread of its repeats
    again: list = []
    monkeypatch.setattr(calibrate, "_allreduce_times", lambda *a: again.pop(0))

    fitted, note = calibrate._fit_link(clean, 2, group, cpu, lambda: None)
    assert fitted.latency_us > 0 and note == ""
    for noisy in (through_origin, spread_over):
        again[:] = [clean]
        fitted, note = calibrate._fit_link(noisy, 2, group, cpu, lambda: None)
        assert not again and fitted.latency_us == calibrate._fit_link(clean, 2, group, cpu, lambda: None)[0].latency_us
        assert "measured twice" in note, note
        again[:] = [through_origin]
        fitted, note = calibrate._fit_link(noisy, 2, group, cpu, lambda: None)
        assert fitted.latency_us == LATENCY_FLOOR_US["cpu"] and f"latency floored at {LATENCY_FLOOR_US['cpu']:g} us" in note, note
