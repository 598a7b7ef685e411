"""The benchmark's arithmetic: ``summarize`` (per-mode medians, bounds, ratios, targets,
warnings) and the release-time link model, on synthetic per-rank measurements
(``synthetic_runs.py``) whose expected figures are worked out by hand below; the table renders
from the summary alone. The modes a run may add (the optimizer inside the backward, PowerSGD,
the bucket-cap sweep) and ``--modes`` are checked in ``test_mode_summaries.py``, the published
figures in ``test_published_figures.py``."""
from __future__ import annotations

import pytest
from synthetic_runs import CFG, _schedule, _synthetic_ranks

from graphddp.plan.cost import CostModel
from tools.bench.release import fit_link, release_timeline
from tools.bench.report import render_table
from tools.bench.summary import summarize
from tools.bench.workload import MB

# -- the release-time link model: graphddp.plan.cost.simulate over the run's buckets --------------------

# 0.008 Gbit/s and no latency: a 2-rank all-reduce of n bytes puts n on the wire, n microseconds.
SLOW = CostModel(bandwidth_gbps=0.008, latency_us=0.0)


def _spans(timeline):
    """(bucket, start ms, end ms) in link order, to the nanosecond (the simulation sums seconds)."""
    return [(t["bucket"], round(t["start_ms"], 6), round(t["end_ms"], 6)) for t in timeline]


def test_release_starts_each_bucket_when_ready_if_the_link_is_free():
    timeline = release_timeline([_schedule([20_000, 30_000, 10_000])], [10.0, 50.0, 100.0], SLOW)
    assert _spans(timeline) == [(0, 10.0, 30.0), (1, 50.0, 80.0), (2, 100.0, 110.0)]


def test_release_queues_buckets_behind_a_busy_link():
    timeline = release_timeline([_schedule([50_000, 50_000, 10_000])], [10.0, 50.0, 100.0], SLOW)
    assert _spans(timeline) == [(0, 10.0, 60.0), (1, 60.0, 110.0), (2, 110.0, 120.0)]


def test_release_serves_buckets_in_ready_order_whatever_their_index():
    timeline = release_timeline([_schedule([5_000, 5_000])], [100.0, 20.0], SLOW)
    assert _spans(timeline) == [(1, 20.0, 25.0), (0, 100.0, 105.0)]


def test_release_takes_the_buckets_of_every_graph():
    timeline = release_timeline([_schedule([5_000]), _schedule([5_000, 1_000])], [0.0, 1.0, 2.0], SLOW)
    assert _spans(timeline) == [(0, 0.0, 5.0), (1, 5.0, 10.0), (2, 10.0, 11.0)]


def test_fit_link_recovers_the_alpha_beta_line():
    # 2 ranks: a + b * n with a = 2 * 50 us and b = 8 / 4 Gbit/s: 2 ns per byte.
    true = CostModel(bandwidth_gbps=4.0, latency_us=50.0)
    sizes = [MB, 2 * MB, 4 * MB]
    fit = fit_link(sizes, [true.allreduce_seconds(n, 2) for n in sizes], 2)
    assert (fit.bandwidth_gbps, fit.latency_us) == (pytest.approx(4.0), pytest.approx(50.0))


def test_fit_link_keeps_latency_and_bandwidth_physical():
    # A line through these points would cross zero below 0 bytes: refitted through the origin.
    fit = fit_link([MB, 2 * MB], [0.001, 0.003], 2)
    assert fit.latency_us == 0.0 and fit.allreduce_seconds(MB, 2) == pytest.approx(0.0014)
    # Bigger buckets no slower: latency only, no bandwidth term.
    fit = fit_link([MB, 2 * MB], [0.003, 0.002], 2)
    assert fit.bandwidth_gbps == float("inf") and fit.allreduce_seconds(MB, 2) == pytest.approx(0.0025)
    # One size: nothing tells latency from bandwidth; the fit puts it all on the bandwidth.
    fit = fit_link([MB, MB], [0.002, 0.004], 2)
    assert fit.latency_us == 0.0 and fit.allreduce_seconds(MB, 2) == pytest.approx(0.003)


def test_summary_medians_per_mode_from_the_slower_rank():
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    g = s["modes"]["graphddp"]
    assert g["steps_ms"] == pytest.approx([105.0, 120.0, 130.0])  # per step, the slower rank
    assert g["step_ms"] == pytest.approx(120.0)
    assert (g["min_ms"], g["max_ms"]) == (pytest.approx(105.0), pytest.approx(130.0))
    assert g["fwd_ms"] == pytest.approx(20.0)   # mean over ranks of each rank's median
    assert g["bwd_ms"] == pytest.approx(75.0)
    assert g["opt_ms"] == pytest.approx(10.0)
    assert g["cpu_per_wall"] == pytest.approx(0.85)
    assert g["rq_wait_ms"] == pytest.approx(4.0)  # worst rank
    assert g["other_threads_cpu_ms"] == pytest.approx(10.0)
    assert g["machine_cpu_ms"] == pytest.approx(220.0)  # rank 0's reading
    assert g["minor_faults"] == 5
    assert g["first_step_s"] == pytest.approx(2.5)
    assert g["compile_s"] == pytest.approx(2.5 - 0.120)
    assert g["peak_step_mb"] == pytest.approx(12.0) and g["retained_mb"] == pytest.approx(1.0)
    assert g["persistent_comm_mb"] == 0.0 and g["peak_mb"] == pytest.approx(12.0)
    # DDP's reducer buckets (1 MB + 0.5 MB) count towards its peak; max over ranks of 8, 9 MB.
    d = s["modes"]["ddp_cap4"]
    assert d["persistent_comm_mb"] == pytest.approx(1.5) and d["peak_mb"] == pytest.approx(9.0 + 1.5)
    assert s["modes"]["comm_only"]["bucket_ms"] == pytest.approx([15.0, 20.0, 30.0])
    # The best eager DDP cap: 115 ms (cap 4) against 150 (cap 1).
    assert s["modes"]["ddp_best"]["best_of"] == "ddp_cap4"
    assert s["modes"]["ddp_best"]["step_ms"] == pytest.approx(115.0)
    assert s["graphddp_grad_mb"] == pytest.approx(7.0) and s["graphddp_buckets"] == 3
    assert s["exposed_comm_ms"] == pytest.approx(120.0 - 80.0)  # graphddp - compute_only
    assert s["warnings"] == []


def test_summary_bounds_by_hand():
    b = summarize(CFG, _synthetic_ranks(), wall_s=12.0)["bounds"]
    assert b["max_compute_comm_ms"] == pytest.approx(80.0)  # max(compute_only 80, comm_only 65)
    # compute_only's backward is 50 ms: buckets ready at 12.5, 25, 50 ms; they take 15, 20, 30.
    # b0 12.5 -> 27.5, b1 waits for the link 27.5 -> 47.5, b2 50 -> 80: 30 ms after the backward.
    assert [(t["start_ms"], t["end_ms"]) for t in b["release_timeline"]] == [
        pytest.approx((12.5, 27.5)), pytest.approx((27.5, 47.5)), pytest.approx((50.0, 80.0))]
    assert b["tail_after_backward_ms"] == pytest.approx(30.0)
    assert b["link_model"]["latency_us"] == pytest.approx(5000.0)
    assert b["link_model"]["bandwidth_gbps"] == pytest.approx(8 * MB / 5e6)
    assert b["link_model"]["bucket_ms"] == pytest.approx([15.0, 20.0, 30.0])
    assert b["release_time_ms"] == pytest.approx(20.0 + 80.0 + 10.0)  # fwd + max(bwd, link) + opt
    # With graphddp's own issue times: 5, 30, 40 ms of a 40 ms compute phase -> fractions
    # 1/8, 3/4, 1 -> ready 6.25, 37.5, 50: b0 6.25 -> 21.25, b1 37.5 -> 57.5, b2 57.5 -> 87.5.
    assert b["release_time_graphddp_issue_ms"] == pytest.approx(20.0 + 87.5 + 10.0)
    assert b["ideal_overlap_ms"] == pytest.approx(100.0)


def test_summary_overlap_from_the_profiled_step():
    ov = summarize(CFG, _synthetic_ranks(), wall_s=12.0)["graphddp_overlap"]
    assert ov["issue_ms"] == pytest.approx([5.0, 30.0, 40.0])
    assert ov["compute_fractions"] == pytest.approx([0.125, 0.75, 1.0])
    assert ov["issue_fraction"] == pytest.approx([5 / 60, 30 / 60, 40 / 60])  # of the 60 ms backward
    assert ov["first_wait_at_ms"] == pytest.approx(40.0)
    assert ov["wait_ms"] == pytest.approx([4.0, 1.0])


def test_summary_ratios_and_targets_by_hand():
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    expected = {  # graphddp (120 ms) / each figure
        "compute_only": 120 / 80, "comm_only": 120 / 65, "ideal_overlap": 120 / 100, "no_overlap": 120 / 170,
        "ddp_default": 120 / 200, "ddp_cap1": 120 / 150, "ddp_cap4": 120 / 115, "ddp_best": 120 / 115,
        "ddp_compiled": 120 / 240, "best_eager_ddp": 120 / 115, "max_compute_comm_bound": 120 / 80,
        "release_time_bound": 120 / 110, "release_time_graphddp_issue_bound": 120 / 117.5,
    }
    assert s["ratios"] == pytest.approx(expected)
    targets = {t["target"]: t for t in s["targets"]}
    best = targets["graphddp / best eager DDP"]
    # 1.043 > 0.90: missed; it needs a step <= 0.9 * 115 = 103.5 ms, below the release-time
    # bound (min of 110 and 117.5) but not below the measured floor (ideal_overlap, 100 ms).
    assert best["ratio"] == pytest.approx(120 / 115) and not best["met"]
    assert best["needs_ms"] == pytest.approx(103.5)
    assert best["release_bound_ms"] == pytest.approx(110.0)
    assert best["below_release_bound"] and not best["below_measured_floor"]
    compiled = targets["graphddp / ddp_compiled"]
    assert compiled["met"] and compiled["needs_ms"] == pytest.approx(192.0) and not compiled["below_release_bound"]
    assert targets["graphddp / no_overlap"]["met"]  # 0.706 <= 0.75
    bound = targets["graphddp / release-time bound"]
    assert bound["met"] and bound["needs_ms"] == pytest.approx(126.5)
    assert not bound["below_release_bound"]  # never flagged against itself


def test_summary_warns_of_shared_cores():
    ranks = _synthetic_ranks()
    for rank in ranks:
        for name, recs in rank["records"].items():
            for rec in recs:
                rec["rq_wait"] = 0.10 * rec["step"]  # every main thread waited 10% of its steps
                if name == "compute_only":
                    rec["cpu"] = 0.5 * rec["step"]
    s = summarize(CFG, ranks, wall_s=12.0)
    assert s["runqueue_wait_fraction"] == pytest.approx(0.10)
    assert len(s["warnings"]) == 2
    assert "0.50 s of CPU per wall second" in s["warnings"][0]
    assert "10% of the timed steps" in s["warnings"][1]
    assert "WARNING: compute_only's main thread got 0.50" in render_table(s)


def test_summary_table_rows_and_targets():
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    table = render_table(s)
    rows = {line.split(" ")[0]: line for line in table.splitlines() if line and not line.startswith(" ")}
    for mode in ("graphddp", "compute_only", "comm_only", "ideal_overlap", "no_overlap", "ddp_best", "ddp_compiled"):
        assert mode in rows, mode
    assert f"{120 / 115:.3f}" in rows["ddp_cap4"]  # graphddp / mode
    assert f"{120 / 110:.3f}" in rows["release-time"]
    assert f"{120 / 117.5:.3f}" in rows["release-time*"]
    targets = {line.split("  ")[1].strip(): line for line in table.splitlines() if line.startswith("  graphddp / ")}
    assert "1.043  (<= 0.90)  MISSED  needs a step <= 104 ms; release-time bound 110 ms (target below the bound); " \
           "ideal_overlap 100 ms" in targets["graphddp / best eager DDP"]
    assert "0.706  (<= 0.75)  met" in targets["graphddp / no_overlap"]
    assert "0.500  (<= 0.80)  met" in targets["graphddp / ddp_compiled"]


def test_a_run_of_some_modes_has_no_bounds_it_did_not_measure():
    # --modes without comm_only: no max(compute, comm) or release-time bound, no ratio to them.
    modes = ("graphddp", "compute_only", "ideal_overlap", "ddp_cap1", "no_overlap")
    s = summarize(CFG, _synthetic_ranks(modes), wall_s=12.0)
    assert set(s["modes"]) == {*modes, "ddp_best"}
    assert s["bounds"] == {"ideal_overlap_ms": pytest.approx(100.0)}
    assert s["ratios"] == pytest.approx({
        "compute_only": 120 / 80, "ideal_overlap": 120 / 100, "ddp_cap1": 120 / 150, "ddp_best": 120 / 150,
        "no_overlap": 120 / 170, "best_eager_ddp": 120 / 150,
    })
    assert [t["target"] for t in s["targets"]] == ["graphddp / best eager DDP", "graphddp / no_overlap"]
    assert all(t["release_bound_ms"] is None and not t["below_release_bound"] for t in s["targets"])
    table = render_table(s)
    rows = [line.split(" ")[0] for line in table.splitlines()]
    assert "graphddp" in rows and "comm_only" not in rows
    assert "release-time" not in rows and "max(compute,comm)" not in rows
