"""The benchmark's summary of the modes a run may add, on the synthetic run of
``synthetic_runs.py`` with each mode's per-rank records added below, figures worked out by hand:
the optimizer inside the backward against eager DDP (issue 11), PowerSGD's step times and bytes
on the wire (issue 13), ``bucket_cap_mb="auto"`` against the swept caps with the predicted
backward next to the measured (issue 12); and the ``--modes`` presets."""
from __future__ import annotations

import dataclasses

import pytest
from synthetic_runs import CFG, _profile, _rec, _schedule, _synthetic_ranks

from graphddp.config import DDPConfig
from graphddp.plan.cost import CostModel
from tools.bench.report import render_table
from tools.bench.summary import summarize
from tools.bench.workload import MB


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
