"""The benchmark's arithmetic: ``summarize`` (per-mode medians, bounds, ratios, targets,
warnings) and the release-time link model, on synthetic per-rank measurements whose expected
figures are worked out by hand below; the table renders from the summary alone. The published
figures are checked in ``test_published_figures.py``."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from graphddp.config import DDPConfig
from graphddp.plan.cost import CostModel
from graphddp.values.schedule import Bucket, GradSlot, Schedule
from tools.bench.release import fit_link, release_timeline
from tools.bench.report import render_table
from tools.bench.summary import summarize
from tools.bench.workload import MB, BenchConfig

# -- the release-time link model: graphddp.plan.cost.simulate over the run's buckets --------------------


def _schedule(sizes):
    """A 2-rank schedule of one-gradient buckets of ``sizes`` bytes (fp32), in this order."""
    buckets = tuple(
        Bucket(index=i, slots=(GradSlot(output_index=i, param_name=f"p{i}", shape=(n // 4,), dtype="float32",
                                        device="cpu", numel=n // 4, nbytes=n, producer=f"g{i}", position=i),),
               dtype="float32", device="cpu", issue_after=f"g{i}", wait_before="output", overlap=())
        for i, n in enumerate(sizes))
    return Schedule(graph_index=0, world_size=2, group_name="0", bucket_cap_mb=4.0, first_bucket_cap_mb=1.0,
                    buckets=buckets)


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


# -- synthetic runs ---------------------------------------------------------------------------------------
#
# Two ranks, three timed steps per mode. Times in the records are seconds (as the ranks record
# them); the summary reports milliseconds. Powers of two where a figure is divided, so the
# hand-computed values are exact in floating point; pytest.approx elsewhere.


def _rec(step, fwd=0.0, bwd=0.0, comm=0.0, opt=0.0, *, cpu=None, rq_wait=0.0, other=0.0, machine=0.0, faults=0,
         buckets=None):
    cpu = step if cpu is None else cpu
    r = {"step": step, "fwd": fwd, "bwd": bwd, "comm": comm, "opt": opt, "cpu": cpu, "rq_wait": rq_wait,
         "proc_cpu": cpu + other, "machine_busy": machine, "minor_faults": faults}
    if buckets is not None:
        r["buckets"] = buckets
    return r


def _flat(step, fwd=0.0, bwd=0.0, opt=0.0, **kw):
    """The same record on both ranks, every step."""
    return [[_rec(step, fwd, bwd, 0.0, opt, **kw) for _ in range(3)] for _ in range(2)]


def _profile(peak_mb=4.0, retained_mb=0.0, backward=None, collectives=None):
    return {"peak_mb": peak_mb, "retained_mb": retained_mb, "collectives": collectives or [],
            "compiled_backward_ms": backward or []}


def _synthetic_ranks(modes=None):
    """Per-rank records of a run; ``modes`` keeps a subset (a run with --modes)."""
    records = [{}, {}]
    # graphddp: different on each rank, so the per-step max over ranks and the medians matter.
    steps = ([0.100, 0.120, 0.110], [0.105, 0.100, 0.130])  # per-step max 105, 120, 130 -> median 120 ms
    fwd = ([0.02, 0.03, 0.04], [0.01, 0.01, 0.05])          # medians 30 and 10 -> mean 20 ms
    bwd = (0.07, 0.08)                                       # -> 75 ms
    cpu_frac = (0.9, 0.8)                                    # cpu/wall 0.85
    rq = ([0.001, 0.002, 0.003], [0.004] * 3)                # medians 2 and 4 ms -> worst 4 ms
    other = (0.005, 0.015)                                   # other threads: 5 and 15 ms -> mean 10
    machine = ([0.2, 0.22, 0.24], [9.0] * 3)                 # rank 0's only: mean 220 ms
    faults = ([0, 0, 10], [5, 5, 5])                         # medians 0 and 5 -> worst 5
    for r in range(2):
        records[r]["graphddp"] = [
            _rec(steps[r][i], fwd[r][i], bwd[r], 0.0, 0.01, cpu=cpu_frac[r] * steps[r][i], rq_wait=rq[r][i],
                 other=other[r], machine=machine[r][i], faults=faults[r][i])
            for i in range(3)
        ]
    flat = {
        "compute_only": _flat(0.080, 0.02, 0.05, 0.01),
        "ideal_overlap": _flat(0.100, 0.02, 0.07, 0.01),
        "no_overlap": _flat(0.170, 0.02, 0.05, 0.01),
        "ddp_default": _flat(0.200, 0.03, 0.15, 0.02),
        "ddp_cap1": _flat(0.150, 0.03, 0.10, 0.02),
        "ddp_cap4": _flat(0.115, 0.03, 0.07, 0.015),
        "ddp_compiled": _flat(0.240, 0.03, 0.19, 0.02),
    }
    for name, per_rank in flat.items():
        for r in range(2):
            records[r][name] = per_rank[r]
    # comm_only: per-bucket times; each bucket's figure is the median over steps of the slower rank.
    # 15, 20, 30 ms for the 1, 2 and 4 MB buckets lie on one line, 10 ms + 5 ms per MB: the link
    # fitted to them (a 2-rank ring: latency 5 ms per step, 8 bits / 5 ns per byte) gives them back.
    bucket_times = ([0.010, 0.020, 0.030], [0.015, 0.020, 0.025])  # -> 15, 20, 30 ms
    for r in range(2):
        records[r]["comm_only"] = [_rec(0.065, 0.0, 0.0, 0.065, 0.0, buckets=list(bucket_times[r])) for _ in range(3)]

    graphddp_profile = _profile(
        peak_mb=10.0, retained_mb=1.0, backward=[[30.0, 60.0]],
        collectives=[  # issued 5, 30 and 40 ms into the backward; the first wait at 40: compute ends there
            {"name": "_c10d_functional::all_reduce_", "start_ms": 35.0, "dur_ms": 0.1},
            {"name": "_c10d_functional::all_reduce_", "start_ms": 60.0, "dur_ms": 0.1},
            {"name": "_c10d_functional::all_reduce_", "start_ms": 70.0, "dur_ms": 0.1},
            {"name": "_c10d_functional::wait_tensor", "start_ms": 70.0, "dur_ms": 4.0},
            {"name": "_c10d_functional::wait_tensor", "start_ms": 75.0, "dur_ms": 1.0},
        ])
    info = {
        "ready": {"fractions": [0.25, 0.5, 1.0], "runs": 5},
        "graphddp": {"buckets": [{"nbytes": MB}, {"nbytes": 2 * MB}, {"nbytes": 4 * MB}],
                     "schedule_dicts": [_schedule([MB, 2 * MB, 4 * MB]).to_dict()]},
        "ddp_buckets": {"ddp_cap4": [{"nbytes": MB, "params": ["a"]}, {"nbytes": MB // 2, "params": ["b"]}]},
        "ddp_compiled": {"graphs": 3, "graphs_without_ddp": 1, "bucket_cap_mb": "default"},
    }
    ranks = []
    for r in range(2):
        profiles = {name: _profile(peak_mb=8.0 + r, retained_mb=0.5) for name in records[r]}
        profiles["graphddp"] = copy.deepcopy(graphddp_profile) if r == 0 else _profile(peak_mb=12.0, retained_mb=0.25)
        first = {name: 1.0 for name in records[r]}
        first["graphddp"] = 2.0 + 0.5 * r  # compile included: worst rank 2.5 s
        ranks.append({"records": records[r], "first": first, "profiles": profiles, "info": copy.deepcopy(info)})
    if modes is not None:
        for rank in ranks:
            for key in ("records", "first", "profiles"):
                rank[key] = {n: v for n, v in rank[key].items() if n in modes}
    return ranks


CFG = BenchConfig(
    model="gpt", tiny=False, steps=3, warmup=1,
    graphddp=DDPConfig(backend="inductor", bucket_cap_mb=2.0, first_bucket_cap_mb=1.0, last_bucket_cap_mb=1.0), seed=0, out="unused", network={"label": "synthetic", "emulated": False},
    model_kwargs={}, batch=8, ready_probe_runs=5,
)


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


def _with_optimizer_modes(ranks):
    """Issue 11's modes added to a run: graphddp_optim (96 ms, AdamW inside its backward, no
    gradients kept) and ddp_compiled_autograd (128 ms); ddp_cap4 and the latter keep 7 MB of
    gradients between steps."""
    for rank in ranks:
        rank["records"]["graphddp_optim"] = [_rec(0.096, 0.02, 0.076, 0.0, 0.0) for _ in range(3)]
        rank["records"]["ddp_compiled_autograd"] = [_rec(0.128, 0.02, 0.09, 0.0, 0.018) for _ in range(3)]
        rank["first"].update(graphddp_optim=3.0, ddp_compiled_autograd=4.0)
        rank["profiles"]["graphddp_optim"] = _profile(peak_mb=5.25)
        rank["profiles"]["ddp_compiled_autograd"] = {**_profile(peak_mb=9.0), "held_grad_mb": 7.0}
        rank["profiles"]["ddp_cap4"]["held_grad_mb"] = 7.0
        rank["info"]["ddp_compiled_autograd"] = {"fuse_passes": ["fuse_ddp_with_coalesced_op"], "fuse_bucket_mb": 25}
    return ranks


def test_summary_targets_of_the_optimizer_in_the_backward():
    s = summarize(CFG, _with_optimizer_modes(_synthetic_ranks()), wall_s=12.0)
    o = s["modes"]["graphddp_optim"]
    assert o["step_ms"] == pytest.approx(96.0) and o["held_grad_mb"] == 0.0 and o["peak_mb"] == pytest.approx(5.25)
    # Held gradients count in the peak: ddp_cap4 peaks 9 MB above its start, holds 7 MB of
    # gradients between steps and 1.5 MB of reducer buckets.
    assert s["modes"]["ddp_cap4"]["peak_mb"] == pytest.approx(9.0 + 7.0 + 1.5)
    assert s["optim_ratios"]["best_eager_ddp"] == pytest.approx(96 / 115)
    assert s["optim_ratios"]["ddp_compiled_autograd"] == pytest.approx(0.75)
    assert s["optim_ratios"]["graphddp"] == pytest.approx(0.8)
    assert s["ratios"]["graphddp_optim"] == pytest.approx(1.25)  # graphddp / graphddp_optim
    targets = {t["target"]: t for t in s["targets"]}
    best = targets["graphddp_optim / best eager DDP"]
    assert best["met"] and best["needs_ms"] == pytest.approx(103.5)
    assert best["release_bound_ms"] is None  # the bounds model a separate optimizer step
    assert targets["graphddp_optim / ddp_compiled_autograd"]["ratio"] == pytest.approx(0.75)
    # 5.25 MB against the best eager DDP's (ddp_cap4) 17.5 MB less 7 MB of gradients.
    memory = targets["graphddp_optim peak / (DDP peak - grads)"]
    assert memory["ddp_mode"] == "ddp_cap4" and memory["needs_mb"] == pytest.approx(10.5)
    assert memory["ratio"] == pytest.approx(0.5) and memory["met"]
    table = render_table(s)
    assert "graphddp_optim / best eager DDP          0.835  (<= 0.90)  met  needs a step <= 104 ms" in table
    assert ("graphddp_optim peak / (DDP peak - grads) 0.500  (<= 1.00)  met  graphddp_optim peak 5.2 MB; "
            "needs <= 10.5 MB = ddp_cap4 peak 17.5 MB - 7.0 MB of gradients") in table
    rows = {line.split(" ")[0]: line for line in table.splitlines() if line and not line.startswith(" ")}
    assert f"{96 / 128:.3f}" in rows["ddp_compiled_autograd"]  # graphddp_optim / mode


def test_no_optimizer_targets_without_graphddp_optim():
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    assert s["optim_ratios"] == {} and s["memory_target"] is None
    assert not any(t["target"].startswith("graphddp_optim") for t in s["targets"])


def _with_powersgd_modes(ranks, *, ddp_counters=None):
    """Issue 13's modes added to a run: graphddp_powersgd (90 ms, against graphddp's 120) and
    ddp_powersgd / ddp_powersgd_serial (160 / 180 ms, against ddp_default's 200), 7 MB of
    gradients sent as 0.25 MB (graphddp: 4 buckets; DDP: 1 bucket, 2 serialised)."""
    grads, sent = 7 * MB, MB // 4
    counters = sent if ddp_counters is None else ddp_counters
    for rank in ranks:
        rank["records"]["graphddp_powersgd"] = [_rec(0.090, 0.02, 0.05, 0.0, 0.02) for _ in range(3)]
        rank["records"]["ddp_powersgd"] = [_rec(0.160, 0.03, 0.11, 0.0, 0.02) for _ in range(3)]
        rank["records"]["ddp_powersgd_serial"] = [_rec(0.180, 0.03, 0.13, 0.0, 0.02) for _ in range(3)]
        for name in ("graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial"):
            rank["first"][name] = 1.0
            rank["profiles"][name] = _profile()
        src = {"source": "synthetic", "uncompressed_bytes": grads}
        rank["info"]["wire"] = {
            "graphddp": {**src, "bytes": grads, "buckets": 3}, "ddp_default": {**src, "bytes": grads, "buckets": 2},
            "compute_only": {**src, "bytes": 0},
            "graphddp_powersgd": {**src, "bytes": sent, "bytes_by_layout": sent, "buckets": 4,
                                  "schedules": ["graph 0: ... PowerSGD"]},
            "ddp_powersgd": {**src, "bytes": sent, "bytes_by_counters": float(counters), "buckets": 1},
            "ddp_powersgd_serial": {**src, "bytes": sent, "bytes_by_counters": float(sent), "buckets": 2},
        }
        rank["info"]["powersgd"] = {
            "settings": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "use_error_feedback": True,
                         "warm_start": True},
            "modes": {"graphddp_powersgd": {"iter_before_rounds": 3, "iter_after_rounds": 7},
                      "ddp_powersgd": {"iter_before_rounds": 3, "iter_after_rounds": 7, "ddp_kwargs": {"bucket_cap_mb": 8}},
                      "ddp_powersgd_serial": {"iter_before_rounds": 3, "iter_after_rounds": 7, "ddp_kwargs": {}}},
        }
    return ranks


def test_summary_powersgd_rows_step_time_and_bytes_on_the_wire():
    s = summarize(CFG, _with_powersgd_modes(_synthetic_ranks()), wall_s=12.0)
    assert s["modes"]["graphddp_powersgd"]["wire_mb"] == 0.25
    assert s["modes"]["ddp_default"]["uncompressed_wire_mb"] == 7.0
    assert "wire_mb" not in s["modes"]["ddp_cap1"]  # no wire figure recorded for it
    ps = s["powersgd"]
    rows = ps["rows"]
    assert list(rows) == ["graphddp", "graphddp_powersgd", "ddp_default", "ddp_powersgd", "ddp_powersgd_serial"]
    assert rows["graphddp"]["wire_fraction"] == 1.0 and "vs" not in rows["graphddp"]
    assert rows["graphddp_powersgd"]["wire_fraction"] == 1 / 28
    assert rows["graphddp_powersgd"]["vs"] == "graphddp"
    assert rows["graphddp_powersgd"]["step_vs_uncompressed"] == pytest.approx(90 / 120)
    assert rows["ddp_powersgd"]["vs"] == "ddp_default"
    assert rows["ddp_powersgd"]["step_vs_uncompressed"] == pytest.approx(160 / 200)
    assert rows["ddp_powersgd_serial"]["step_vs_uncompressed"] == pytest.approx(180 / 200)
    assert ps["graphddp_powersgd / ddp_powersgd"] == pytest.approx(90 / 160)
    assert ps["graphddp_powersgd / ddp_powersgd_serial"] == pytest.approx(0.5)
    assert ps["graphddp_powersgd_schedules"] == ["graph 0: ... PowerSGD"]
    assert not any("disagree" in w for w in s["warnings"])
    # PowerSGD modes are no eager-DDP baseline: the best eager DDP stays ddp_cap4.
    assert s["ratios"]["best_eager_ddp"] == pytest.approx(120 / 115)
    table = render_table(s)
    assert "PowerSGD (issue 13): rank 1, start_powerSGD_iter 2" in table
    lines: dict[str, str] = {}
    for line in table.splitlines():  # the first indented line of each name: the section's rows
        if line.startswith("  ") and line.split():
            lines.setdefault(line.split()[0], line)
    assert lines["graphddp_powersgd"].split()[1:6] == ["90.0", "0.250", "7.000", "0.0357", "4"]
    assert lines["graphddp_powersgd"].endswith("0.750 of graphddp")
    assert lines["ddp_powersgd"].split()[1:6] == ["160.0", "0.250", "7.000", "0.0357", "1"]
    assert lines["ddp_powersgd"].endswith("0.800 of ddp_default")
    assert "graphddp_powersgd / ddp_powersgd         0.562" in table
    rows_ = {line.split(" ")[0]: line for line in table.splitlines() if line and not line.startswith(" ")}
    assert "ONE bucket (bucket_cap_mb=8)" in rows_["ddp_powersgd"]
    assert f"{120 / 90:.3f}" in rows_["graphddp_powersgd"]  # graphddp / mode in the main table


def test_summary_warns_when_the_wire_accounts_disagree():
    s = summarize(CFG, _with_powersgd_modes(_synthetic_ranks(), ddp_counters=MB), wall_s=12.0)
    assert any(w.startswith("ddp_powersgd: 262144 bytes on the wire") and "disagree" in w for w in s["warnings"])
    assert s["powersgd"]["rows"]["ddp_powersgd"]["cross_check"] == {"bytes_by_counters": float(MB)}


def test_no_powersgd_section_without_its_modes():
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    assert s["powersgd"] is None and "PowerSGD" not in render_table(s)


# -- issue 12: bucket_cap_mb="auto" against the swept caps, predicted against measured ---------------

CALIBRATED = {"bandwidth_gbps": 1.0, "latency_us": 50.0, "compute_tflops": 0.05, "memory_gbps": 20.0,
              "op_overhead_us": 2.0, "source": "calibrated on group 0 (2 ranks, cpu)", "calibrate_s": 0.5}


def _with_sweep_modes(ranks, modes=("graphddp_auto", "graphddp_cap1", "graphddp_cap4", "ddp_cap2")):
    """Issue 12's modes added to a run: graphddp_auto 100 ms (bwd 60), graphddp_cap1 130,
    graphddp_cap4 108 (the fastest swept), ddp_cap2 112; predicted backwards for graphddp_auto
    (50 ms), graphddp (64) and ddp_cap4 (56, graphddp's model of its layout)."""
    steps = {"graphddp_auto": (0.100, 0.060), "graphddp_cap1": (0.130, 0.090), "graphddp_cap4": (0.108, 0.068),
             "ddp_cap2": (0.112, 0.072)}
    for rank in ranks:
        for name in modes:
            step, bwd = steps[name]
            rank["records"][name] = [_rec(step, 0.02, bwd, 0.0, 0.02) for _ in range(3)]
            rank["first"][name] = 1.0
            rank["profiles"][name] = _profile()
        rank["info"]["cost_model"] = dict(CALIBRATED)
        pred = {"graphddp": {"bwd_ms": 64.0, "compute_ms": 40.0, "comm_ms": 30.0, "exposed_ms": 24.0, "buckets": 3},
                "ddp_cap4": {"bwd_ms": 56.0, "compute_ms": 40.0, "comm_ms": 20.0, "exposed_ms": 16.0, "buckets": 2,
                             "same_buckets_as_ddp": True, "same_layout_as": {"graphddp_cap4": True}}}
        if "graphddp_auto" in modes:
            pred["graphddp_auto"] = {"bwd_ms": 50.0, "compute_ms": 40.0, "comm_ms": 12.0, "exposed_ms": 10.0,
                                     "buckets": 2}
            rank["info"]["graphddp_auto"] = {"bucket_mb": [3.0, 4.0], "cost_model": dict(CALIBRATED),
                                             "same_cost_model_as_calibrated": True, "schedules": ["graph 0: auto"]}
        rank["info"]["predicted"] = pred
    return ranks


def test_summary_auto_against_the_best_swept_cap_and_ddp_defaults():
    s = summarize(CFG, _with_sweep_modes(_synthetic_ranks()), wall_s=12.0)
    best = s["modes"]["best_swept"]
    # Swept: graphddp_cap1 130, graphddp_cap4 108, ddp_cap1 150, ddp_cap2 112, ddp_cap4 115.
    assert best["best_of"] == "graphddp_cap4" and best["step_ms"] == pytest.approx(108.0)
    assert best["swept"] == ["graphddp_cap1", "graphddp_cap4", "ddp_cap1", "ddp_cap2", "ddp_cap4"]
    assert best["not_run"] == ["graphddp_cap2", "graphddp_cap8", "graphddp_cap25", "ddp_cap8", "ddp_cap25"]
    assert s["modes"]["ddp_best"]["best_of"] == "ddp_cap2"  # eager DDP's caps only
    assert s["auto_ratios"]["best_swept"] == pytest.approx(100 / 108)
    targets = {t["target"]: t for t in s["targets"]}
    swept = targets["graphddp_auto / best swept"]
    assert swept["met"] and swept["needs_ms"] == pytest.approx(0.97 * 108) and swept["best_of"] == "graphddp_cap4"
    assert swept["release_bound_ms"] is None  # the bounds are of graphddp's buckets, not auto's
    default = targets["graphddp_auto / ddp_default"]
    assert default["ratio"] == pytest.approx(0.5) and default["met"] and default["needs_ms"] == pytest.approx(180.0)
    table = render_table(s)
    assert ("graphddp_auto / best swept               0.926  (<= 0.97)  met  needs a step <= 105 ms; best swept: "
            "graphddp_cap4 (not run: graphddp_cap2, graphddp_cap8, graphddp_cap25, ddp_cap8, ddp_cap25)") in table
    assert "graphddp_auto / ddp_default              0.500  (<= 0.90)  met  needs a step <= 180 ms" in table
    rows = {line.split(" ")[0]: line for line in table.splitlines() if line and not line.startswith(" ")}
    assert "fastest of 5 swept: graphddp_cap4 (not run:" in rows["best_swept"]
    assert "bucket_cap_mb='auto': 2 buckets of 3.00, 4.00 MB" in rows["graphddp_auto"]


def test_summary_predicted_backward_next_to_the_measured():
    s = summarize(CFG, _with_sweep_modes(_synthetic_ranks()), wall_s=12.0)
    auto, g, d = s["modes"]["graphddp_auto"], s["modes"]["graphddp"], s["modes"]["ddp_cap4"]
    assert auto["pred_bwd_ms"] == 50.0 and auto["bwd_over_pred"] == pytest.approx(60 / 50)
    assert g["pred_bwd_ms"] == 64.0 and g["bwd_over_pred"] == pytest.approx(75 / 64)
    assert d["pred_bwd_ms"] == 56.0 and d["bwd_over_pred"] == pytest.approx(70 / 56)
    assert d["pred_exposed_ms"] == 16.0 and d["pred_compute_ms"] == 40.0
    assert "pred_bwd_ms" not in s["modes"]["ddp_cap1"] and "pred_bwd_ms" not in s["modes"]["compute_only"]
    assert s["cost_model"]["source"] == "calibrated on group 0 (2 ranks, cpu)"
    p = s["predicted"]
    assert p["modes"]["ddp_cap4"]["measured_bwd_ms"] == pytest.approx(70.0)
    assert p["compute_check"] == {"graphddp_pred_compute_ms": 40.0, "compute_only_bwd_ms": pytest.approx(50.0)}
    table = render_table(s)
    assert "cost model (pred bwd): calibrated on group 0 (2 ranks, cpu): 1 Gbit/s, 50 us per ring step" in table
    rows = {line.split(" ")[0]: line for line in table.splitlines() if line and not line.startswith(" ")}
    assert rows["graphddp_auto"].split()[1:6] == ["100.0", "20.0", "60.0", "50.0", "1.20"]
    assert rows["ddp_cap4"].split()[1:6] == ["115.0", "30.0", "70.0", "56.0", "1.25"]
    assert rows["ddp_cap1"].split()[1:5] == ["150.0", "30.0", "100.0", "0.0"]  # no prediction: blank
    assert "ddp_*: graphddp's model of that bucket layout" in table
    assert "ddp_cap4 = DDP's buckets; ddp_cap4 = graphddp_cap4's" in table
    assert "the same cost model as the calibration above: True" in table
    # The bounds' rows stay under the graphddp/x column.
    head = next(line for line in table.splitlines() if line.startswith("mode "))
    assert rows["release-time"].index(f"{120 / 110:.3f}") + 5 == head.index("graphddp/x") + len("graphddp/x")


def test_summary_without_graphddp_auto_has_no_auto_targets():
    s = summarize(CFG, _with_sweep_modes(_synthetic_ranks(), modes=("graphddp_cap4", "ddp_cap2")), wall_s=12.0)
    assert s["modes"]["best_swept"]["best_of"] == "graphddp_cap4"
    assert s["auto_ratios"] == {} and not any(t["target"].startswith("graphddp_auto") for t in s["targets"])
    # ...and none of it in a run without graphddp's sweep: no best_swept row.
    s = summarize(CFG, _synthetic_ranks(), wall_s=12.0)
    assert "best_swept" not in s["modes"] and s["predicted"] is None and s["cost_model"] is None


def test_only_the_auto_target_whose_modes_ran():
    ranks = _with_sweep_modes(_synthetic_ranks(("graphddp", "ddp_default")), modes=("graphddp_auto",))
    s = summarize(CFG, ranks, wall_s=12.0)
    assert [t["target"] for t in s["targets"] if t["target"].startswith("graphddp_auto")] == ["graphddp_auto / ddp_default"]


def test_predictions_sum_the_simulated_schedules_and_plan_ddp_layouts_with_graphddp_planner():
    from graphddp.plan.cost import simulate
    from graphddp.values.schedule import NodeFact
    from tools.bench.predict import planned_like, predictions

    # A backward of 4 compute nodes, each finalising one 0.75 MB gradient, then the output.
    nodes = tuple(NodeFact(name=f"g{i}", position=i, is_compute=True, flops=10**8, nbytes=10**6) for i in range(4))
    nodes += (NodeFact(name="output", position=4, is_compute=False),)
    sizes = [3 * MB // 4] * 4
    graph = dataclasses.replace(_schedule(sizes), nodes=nodes)
    cost = CostModel(bandwidth_gbps=1.0, latency_us=50.0)
    cap1 = planned_like([graph], DDPConfig(bucket_cap_mb=1))
    assert [len(b.slots) for s in cap1 for b in s.buckets] == [2, 2]  # closed once >= 1 MB
    two = [cap1[0], dataclasses.replace(cap1[0], graph_index=1)]  # two backward graphs: summed
    ddp_buckets = {"ddp_cap1": [{"nbytes": 3 * MB // 2, "params": ["p0", "p1"]}, {"nbytes": 3 * MB // 2, "params": ["p3", "p2"]}],
                   "ddp_default": [{"nbytes": 3 * MB, "params": ["p0", "p1", "p2", "p3"]}]}
    out = predictions(cost, {"graphddp_cap1": two, "graphddp": [graph]}, ["ddp_cap1", "ddp_default"],
                      ("graphddp", [graph]), ddp_buckets)
    one = simulate(cap1[0], cost)
    assert out["graphddp_cap1"]["bwd_ms"] == pytest.approx(2 * one.step_seconds * 1e3)
    assert out["graphddp_cap1"]["exposed_ms"] == pytest.approx(2 * one.exposed_seconds * 1e3)
    assert out["graphddp"]["bwd_ms"] == pytest.approx(simulate(graph, cost).step_seconds * 1e3)
    ddp1 = out["ddp_cap1"]
    assert ddp1["bwd_ms"] == pytest.approx(one.step_seconds * 1e3) and ddp1["buckets"] == 2
    assert ddp1["same_buckets_as_ddp"] and ddp1["facts_from"] == "graphddp"
    assert ddp1["same_layout_as"] == {"graphddp_cap1": False}  # cap1's layout, but graphddp_cap1 here is two graphs
    # DDP's defaults: a 1 MB first bucket (2 gradients), then 25 MB: 2 buckets, not DDP's one here.
    default = out["ddp_default"]
    assert default["bucket_mb"] == [1.5, 1.5] and not default["same_buckets_as_ddp"]
    assert "not eager DDP's compute" in default["model"]


# -- the published run --------------------------------------------------------------------------------


# -- --modes ------------------------------------------------------------------------------------------


def test_modes_presets_and_the_default_list():
    from tools.bench.cli import parse_args, resolve_modes
    from tools.bench.workload import DEFAULT_MODES, MODES, POWERSGD_MODES

    assert resolve_modes("sweep") == (
        "compute_only", "ddp_default", "ddp_cap1", "ddp_cap2", "ddp_cap4", "ddp_cap8", "ddp_cap25", "graphddp",
        "graphddp_auto", "graphddp_cap1", "graphddp_cap2", "graphddp_cap4", "graphddp_cap8", "graphddp_cap25")
    assert resolve_modes("ddp") == ("ddp_default", "graphddp")
    assert resolve_modes("sweep,no_overlap") == tuple(m for m in MODES if m in {*resolve_modes("sweep"), "no_overlap"})
    with pytest.raises(SystemExit, match="unknown modes \\['graphddp_cap3'\\]"):
        resolve_modes("graphddp_cap3")
    # make bench's default: the modes it ran before issue 12, and graphddp_auto; the sweep's
    # other caps and the PowerSGD modes only when named.
    assert parse_args([]).modes == ",".join(DEFAULT_MODES)
    assert "graphddp_auto" in DEFAULT_MODES and {"ddp_cap1", "ddp_cap4", "ddp_cap25"} <= set(DEFAULT_MODES)
    assert not {*POWERSGD_MODES, "graphddp_cap1", "graphddp_cap25", "ddp_cap2", "ddp_cap8"} & set(DEFAULT_MODES)
    assert len(DEFAULT_MODES) == 17  # 16 before issue 12
