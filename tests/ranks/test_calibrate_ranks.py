"""Calibration on spawned gloo ranks: ranks that measure differently agree; a restart keeps a stored model only when every rank measures close to it."""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist

from graphddp import CostModel
from graphddp.config import DDPConfig
from graphddp.runtime import calibrate
from graphddp.testing import spawn

SLOW = 10.0  # rank 1 measures its compute this many times slower


@contextlib.contextmanager
def _cache_dir(path: str):
    """Point the inductor cache, where calibrate stores its numbers, at ``path`` for a while.

    The test ranks share one inductor cache across the suite, so without this a model stored
    by an earlier test on the same group name would be kept instead of measured.
    """
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        calibrate.CALIBRATIONS.clear()
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def _agree_on_the_slowest(rank: int, world: int, cache: str) -> None:
    with _cache_dir(cache):
        _check_agreement(rank, world)


def _check_agreement(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))  # a group no earlier test has calibrated
    measure = calibrate._compute_times
    seen: list[list[float]] = []

    def compute_times(*args):
        times = measure(*args)
        if rank == 1:
            times = [t * SLOW for t in times]
        seen.append(times)
        return times

    calibrate._compute_times = compute_times
    try:
        model = calibrate.calibrate(group)
    finally:
        calibrate._compute_times = measure
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (model, seen[0]))
    models = [m for m, _ in everyone]
    assert all(m == model for m in models), models
    assert model.source.startswith("calibrated on process group") and f"({world} ranks, cpu)" in model.source
    # MAX over ranks: the matmul rate is the slow rank's (two significant figures).
    slowest_matmul = max(times[0] for _, times in everyone)
    expected = calibrate._round2(2 * calibrate._MATMUL_N["cpu"] ** 3 / slowest_matmul / 1e12)
    assert model.compute_tflops == pytest.approx(expected, rel=0.06), (model, expected)
    for name in ("bandwidth_gbps", "latency_us", "collective_overhead_us", "compute_tflops", "memory_gbps", "op_overhead_us"):
        value = getattr(model, name)
        assert math.isfinite(value) and value >= 0, (name, value)
    assert model.bandwidth_gbps > 0 and model.compute_tflops > 0 and model.memory_gbps > 0

    # A collective's time is one number for the group (each repeat's slowest rank), whatever
    # each rank saw of it.
    took = calibrate._collective_seconds(1 << 16, group, torch.device("cpu"), lambda: None)
    seen_by: list = [None] * world
    dist.all_gather_object(seen_by, took)
    assert len(set(seen_by)) == 1 and took[0] > 0 and took[1] >= 0, seen_by

    # Measured once per group: the second call talks to nobody and times nothing.
    def refuse(*args):
        raise AssertionError("calibrated twice")

    calibrate._compute_times, link = refuse, calibrate._link_times
    calibrate._link_times = refuse
    try:
        assert calibrate.calibrate(group) is model
    finally:
        calibrate._compute_times, calibrate._link_times = measure, link

    # A group of one rank: compute measured, nothing sent, the link left at its defaults.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    calibrate._link_times = refuse
    try:
        solo = calibrate.calibrate(alone)
    finally:
        calibrate._link_times = link
    assert "of one rank" in solo.source and solo.compute_tflops > 0
    assert (solo.bandwidth_gbps, solo.latency_us) == (CostModel().bandwidth_gbps, CostModel().latency_us)

    # resolve_cost: only "auto" without a given cost is calibrated.
    assert calibrate.resolve_cost(DDPConfig(bucket_cap_mb=4.0), group, None).cost is None
    given = CostModel(bandwidth_gbps=3.0)
    assert calibrate.resolve_cost(DDPConfig(cost=given), group, None).cost is given
    assert calibrate.resolve_cost(DDPConfig(), group, None).cost is model  # the default is "auto"


def test_ranks_that_measure_differently_agree_on_the_slowest_rank(tmp_path):
    spawn(_agree_on_the_slowest, 2, str(tmp_path))


COMPUTE_S = [2.4e-3, 1.0e-3, 3.0e-6]  # matmul, copy, one-element add


LINK_S = [2.0e-5, 1.5e-3, 9.0e-3, 35.0e-3, 1.0e-5]  # issue; all-reduces of calibrate.SIZES; the first one's spread


def _calibrate_world(compute_scale: float, link_scale: float) -> CostModel:
    """A fresh calibration of WORLD (the in-memory cache cleared: a restart) on fixed times."""
    measure, link, share = calibrate._compute_times, calibrate._link_times, calibrate._host_share
    calibrate._compute_times = lambda *a: [t * compute_scale for t in COMPUTE_S]
    calibrate._link_times = lambda *a: [t * link_scale for t in LINK_S]
    calibrate._host_share = lambda *a: 0.1
    calibrate.CALIBRATIONS.clear()
    try:
        return calibrate.calibrate(dist.group.WORLD)
    finally:
        calibrate._compute_times, calibrate._link_times, calibrate._host_share = measure, link, share


def _restarts(rank: int, world: int, dirs: list[str], empty: str) -> None:
    with _cache_dir(dirs[rank]):
        first = _calibrate_world(1.0, 1.0)
        assert "kept" not in first.source
        again = _calibrate_world(1.5, 0.7)  # noise within KEEP_WITHIN: the stored numbers, said so
        assert again.numbers == first.numbers and "kept from an earlier run" in again.source, again
        # One outlying measurement: this run plans with it, the stored numbers stay for the next.
        outlier = _calibrate_world(1.0, 3.0)
        assert "kept" not in outlier.source and outlier.numbers != first.numbers
        assert _calibrate_world(1.0, 1.0).numbers == first.numbers
        _calibrate_world(1.0, 3.0)  # another, later: the first one was forgotten when the next run kept
        assert _calibrate_world(1.0, 1.0).numbers == first.numbers
        # The machine changed: measured on its first run, stored on its second.
        slower = _calibrate_world(3.0, 1.0)
        assert slower.compute_tflops == pytest.approx(first.compute_tflops / 3, rel=0.06) and "kept" not in slower.source
        still = _calibrate_world(3.0, 1.1)
        assert "kept" not in still.source
        assert _calibrate_world(3.0, 1.0).numbers == still.numbers
        # One rank restarts on an empty cache directory: the ranks cannot agree to keep, so
        # both use the measurement (the same on both), never one stored and one measured.
        if rank == 1:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = empty
        mixed = _calibrate_world(3.1, 1.1)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mixed)
        assert all(m == mixed for m in everyone), everyone
        assert "kept" not in mixed.source and mixed.numbers != slower.numbers
        # One rank with graphddp's caches off: it keeps nothing, but agrees (no hang), so neither keeps.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = dirs[rank]
        assert _calibrate_world(3.0, 1.0).numbers == still.numbers  # both keep again
        if rank == 1:
            os.environ["GRAPHDDP_COMPILE_CACHE"] = "0"
        try:
            off = _calibrate_world(3.1, 1.1)
        finally:
            os.environ.pop("GRAPHDDP_COMPILE_CACHE", None)
        assert "kept" not in off.source and off.numbers == mixed.numbers, off


def test_a_restart_keeps_the_stored_model_only_when_every_rank_measures_close_to_it(tmp_path):
    spawn(_restarts, 2, [str(tmp_path / "rank0"), str(tmp_path / "rank1")], str(tmp_path / "empty"))


BURN_S = 1e-3  # what each collective below takes from the compute lane


def _collectives_that_take_the_core(rank: int, world: int) -> None:
    """Each asynchronous all-reduce of the measurement costs the rank's own thread BURN_S of
    busy work when waited (as gloo's threads take a rank's core where the ranks take them all),
    while issuing it stays cheap: the calibrated cost per collective is the burn, not the issue;
    a large one's host share is its burn over its time on the link."""
    import time

    real = dist.all_reduce
    burn_s = [BURN_S]

    class Burning:
        def __init__(self, work):
            self.work = work

        def wait(self):
            end = time.perf_counter() + burn_s[0]
            while time.perf_counter() < end:
                pass
            return self.work.wait()

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        work = real(tensor, *args, async_op=async_op, **kwargs)
        return Burning(work) if async_op else work

    group = dist.new_group(list(range(world)))  # a group no earlier test has calibrated
    dist.all_reduce = all_reduce
    try:
        issue_s = calibrate._collective_overhead_seconds(group, torch.device("cpu"), lambda: None, 1e-4)
    finally:
        dist.all_reduce = real
    assert 0.9 * BURN_S <= issue_s <= 5 * BURN_S, issue_s

    # The host share: an all-reduce said to take 20 ms on the link whose wait burns 10 ms of the
    # rank's thread (and sends nothing: only what it takes from the compute is measured) costs
    # half its time; one that burns nothing, none.
    class Sent:
        def wait(self):
            end = time.perf_counter() + burn_s[0]
            while time.perf_counter() < end:
                pass

    dist.all_reduce = lambda *args, **kwargs: Sent()
    try:
        burn_s[0] = 0.0
        plain = calibrate._host_share(group, lambda: None, 20e-3)
        burn_s[0] = 10e-3
        burning = calibrate._host_share(group, lambda: None, 20e-3)
        burn_s[0] = 10e-3 if rank == 0 else 0.0  # the average over ranks, not the largest: each rank pays its own
        one_rank = calibrate._host_share(group, lambda: None, 20e-3)
    finally:
        dist.all_reduce = real
    assert plain <= 0.15 and 0.35 <= burning <= 0.7 and 0.1 <= one_rank <= 0.35, (plain, burning, one_rank)
    assert abs(burning / calibrate.HOST_SHARE_STEP - round(burning / calibrate.HOST_SHARE_STEP)) < 1e-9  # in steps


def test_a_collective_costs_what_it_takes_from_the_compute_beside_it():
    spawn(_collectives_that_take_the_core, 2)
