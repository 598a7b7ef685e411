"""The benchmark harness runs end to end: python -m tools.bench --tiny for 2 steps.

A smoke test of the harness, not a measurement: a tiny MLP, aot_eager for the compiled modes.
The every-mode run asks for an emulated link on a PATH without the tools that build one, so it
also checks the fallback to plain loopback (and that the report says so); a second, short run
uses a real emulated link where this machine can make network namespaces.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MB = 1024 * 1024

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
MODES = (
    "compute_only", "comm_only", "ideal_overlap", "no_overlap", "ddp_default", "ddp_same_buckets", "ddp_cap1", "ddp_cap4",
    "ddp_cap25", "ddp_best", "ddp_compiled", "ddp_compiled_samecap", "graphddp", "graphddp_tail_off", "compute_eager",
    "graphddp_optim", "ddp_compiled_autograd", "graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial",
    "graphddp_auto", "graphddp_cap1", "ddp_cap2", "best_swept",  # issue 12's sweep, a few of its caps
    "graphddp_sharded", "ddp_zero", "fsdp2",  # --modes sharded
)
# Rows that summarise others: not modes of --modes.
SUMMARY_ROWS = ("ddp_best", "best_swept")


def test_bench_tiny_runs_every_mode_and_falls_back_to_plain_loopback(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "tools.bench", "--tiny", "--steps", "2", "--warmup", "0",
        "--link-gbit", "2", "--ready-probe-runs", "1", "--out", str(out), "--timeout", "240",
        "--modes", ",".join(m for m in MODES if m not in SUMMARY_ROWS),  # PowerSGD and sweep modes: only when named
    ]
    # No unshare / ip / tc on PATH: the emulated link cannot be built.
    env = dict(os.environ, PATH=str(tmp_path))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200, env=env)
    log = proc.stdout[-5000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert "backend='aot_eager'" in proc.stdout, "the tiny run must say it is not using inductor"

    data = json.loads((out / "bench.json").read_text())
    assert not data["network"]["emulated"]
    assert "NOT emulated" in data["network"]["label"] and "missing" in data["network"]["label"]
    assert "NOT emulated" in (out / "bench.txt").read_text()
    assert data["config"]["backend"] == "aot_eager"
    for mode in MODES:
        rec = data["modes"][mode]
        assert rec["step_ms"] > 0, (mode, rec)
        assert len(rec["steps_ms"]) == 2 and all(t > 0 for t in rec["steps_ms"]), (mode, rec)
        assert rec["first_step_s"] > 0, (mode, rec)
    for mode in ("compute_only", "graphddp", "no_overlap"):
        assert all(data["modes"][mode][f"{p}_ms"] > 0 for p in ("fwd", "bwd", "opt")), mode
    # The sharded modes keep half the AdamW state of the replicated ones on each of 2 ranks.
    full = data["modes"]["graphddp_optim"]["state_mb"]
    for mode in ("graphddp_sharded", "fsdp2"):  # per-parameter halves, padding aside
        assert abs(data["modes"][mode]["state_mb"] - full / 2) < 0.02 * full, (mode, data["modes"][mode]["state_mb"], full)
    assert data["modes"]["ddp_zero"]["state_mb"] < 0.75 * full  # ZeRO partitions whole parameters, greedily
    assert "memory per rank" in (out / "bench.txt").read_text()
    assert data["modes"]["comm_only"]["comm_ms"] > 0
    assert data["modes"]["comm_only"]["machine_cpu_ms"] >= 0
    assert all(data["modes"][m]["minor_faults"] >= 0 for m in MODES)
    # DDP's reducer buckets hold every gradient for the model's lifetime: counted in its peak
    grad_mb = data["graphddp_grad_mb"]
    for mode in ("ddp_default", "ddp_cap1", "ddp_compiled"):
        rec = data["modes"][mode]
        assert abs(rec["persistent_comm_mb"] - grad_mb) < 1e-6 and rec["peak_mb"] > rec["peak_step_mb"], mode
    assert data["modes"]["graphddp"]["persistent_comm_mb"] == 0.0
    # Every mode's peak counts the gradients it keeps between steps; graphddp_optim keeps none.
    assert all(data["modes"][m]["peak_mb"] > 0 for m in MODES if m != "comm_only")
    assert abs(data["modes"]["ddp_default"]["held_grad_mb"] - grad_mb) < 1e-6
    optim = data["modes"]["graphddp_optim"]
    assert optim["held_grad_mb"] == 0.0 and optim["persistent_comm_mb"] == 0.0
    assert optim["opt_ms"] < optim["bwd_ms"]  # step() is a no-op: the update runs inside the backward
    assert data["bounds"]["ideal_overlap_ms"] == data["modes"]["ideal_overlap"]["step_ms"]
    assert len(data["modes"]["comm_only"]["bucket_ms"]) == data["graphddp_buckets"] >= 2

    assert data["bounds"]["release_time_ms"] > 0 and data["bounds"]["max_compute_comm_ms"] > 0
    for key in ("ddp_default", "ddp_compiled", "no_overlap", "best_eager_ddp", "release_time_bound"):
        assert data["ratios"][key] > 0, key
    assert data["ddp_compiled"]["graphs"] > 1  # DDPOptimizer really split the graph
    # Compiled autograd's DDP all-reduced and averaged once (the run checks it, and fails if not).
    errors = data["ddp_compiled_autograd"]["grad_error_vs_averaged_eager"]
    assert errors["averaged"] < 1e-3 and errors["summed"] > 0.5
    # The in-backward AdamW step is torch.optim's, and leaves no gradient behind.
    check = data["graphddp_optim"]["step_vs_torch"]
    assert check["moved_l2"] > 0 and check["relative"] < 1e-3 and check["grads_none"], check
    assert data["config"]["optimizer"].startswith("AdamW")
    assert {t["target"] for t in data["targets"]} >= {
        "graphddp / no_overlap", "graphddp / ddp_compiled", "graphddp_optim / best eager DDP",
        "graphddp_optim / ddp_compiled_autograd", "graphddp_optim peak / (DDP peak - grads)"}
    assert data["optim_ratios"]["ddp_compiled_autograd"] > 0 and data["memory_target"]["grad_mb"] == grad_mb
    # Issue 13: the PowerSGD modes time compressed steps only (stepped past start_powerSGD_iter
    # first, even with --warmup 0), and report the bytes each rank puts on the wire per step.
    ps = data["powersgd"]
    assert ps["settings"]["start_powerSGD_iter"] == 2 and ps["settings"]["matrix_approximation_rank"] == 1
    for mode in ("graphddp_powersgd", "ddp_powersgd", "ddp_powersgd_serial"):
        m = ps["modes"][mode]
        assert m["timed_steps_compressed"] and m["iter_before_rounds"] > m["start_powerSGD_iter"], (mode, m)
        assert m["iter_after_rounds"] == m["iter_before_rounds"] + 2, (mode, m)  # 0 warm-up + 2 timed rounds
        row = ps["rows"][mode]
        assert 0 < row["wire_mb"] < 0.1 * row["uncompressed_wire_mb"], (mode, row)
        assert abs(row["uncompressed_wire_mb"] - grad_mb) < 1e-6, (mode, row)
        [(how, nbytes)] = row["cross_check"].items()  # the graph / DDP's counters agree with the layout
        assert nbytes == row["wire_mb"] * MB, (mode, how, nbytes)
        assert data["modes"][mode]["wire_mb"] == row["wire_mb"]
    # One rule per tensor: graphddp's buckets and DDP's send the same bytes.
    assert ps["rows"]["graphddp_powersgd"]["wire_mb"] == ps["rows"]["ddp_powersgd"]["wire_mb"]
    assert ps["rows"]["ddp_powersgd"]["buckets"] == 1  # DDP's hook on gloo: one bucket, or it deadlocks
    assert ps["rows"]["ddp_powersgd_serial"]["buckets"] > 1
    assert ps["rows"]["graphddp"]["wire_fraction"] == 1.0 and ps["rows"]["ddp_default"]["wire_fraction"] == 1.0
    assert ps["rows"]["graphddp_powersgd"]["vs"] == "graphddp" and ps["rows"]["ddp_powersgd"]["vs"] == "ddp_default"
    assert "PowerSGD" in "".join(ps["graphddp_powersgd_schedules"])
    assert "PowerSGD (issue 13)" in (out / "bench.txt").read_text()
    assert (out / "bench.txt").exists()
    # Issue 12: bucket_cap_mb="auto" planned under the cost model calibrated on the run's group
    # (the bench's own calibration, cached: the same numbers), and every graphddp mode's and
    # eager DDP layout's backward predicted by it next to the measured one.
    cost = data["cost_model"]
    assert cost["source"].startswith("calibrated on") and cost["bandwidth_gbps"] > 0 and cost["calibrate_s"] > 0
    auto = data["graphddp_auto"]
    assert auto["same_cost_model_as_calibrated"] and auto["cost_model"]["source"] == cost["source"]
    assert sum(auto["bucket_mb"]) == pytest.approx(grad_mb) and data["modes"]["graphddp_auto"]["wire_mb"] == grad_mb
    predicted = data["predicted"]["modes"]
    for mode in ("graphddp", "graphddp_auto", "graphddp_cap1", "graphddp_optim", "graphddp_tail_off",
                 "graphddp_powersgd", "ddp_default", "ddp_cap1", "ddp_cap2", "ddp_cap25"):
        rec = data["modes"][mode]
        assert rec["pred_bwd_ms"] > 0 and rec["bwd_over_pred"] == rec["bwd_ms"] / rec["pred_bwd_ms"], mode
        assert predicted[mode]["compute_ms"] > 0 and predicted[mode]["exposed_ms"] >= 0, mode
    assert "pred_bwd_ms" not in data["modes"]["compute_only"] and "ddp_compiled" not in predicted
    # graphddp's model of DDP's layout at a cap is the layout DDP made, and graphddp's at that cap.
    assert predicted["ddp_cap1"]["same_layout_as"] == {"graphddp_cap1": True}
    assert predicted["ddp_cap1"]["same_buckets_as_ddp"] and predicted["ddp_default"]["same_buckets_as_ddp"]
    assert data["modes"]["best_swept"]["swept"] == ["graphddp_cap1", "ddp_cap1", "ddp_cap2", "ddp_cap4", "ddp_cap25"]
    targets = {t["target"]: t for t in data["targets"]}
    assert targets["graphddp_auto / best swept"]["ratio"] == pytest.approx(
        data["modes"]["graphddp_auto"]["step_ms"] / data["modes"]["best_swept"]["step_ms"])
    assert targets["graphddp_auto / ddp_default"]["limit"] == 0.90
    text = (out / "bench.txt").read_text()
    assert "pred bwd bwd/pred" in text and "cost model (pred bwd): calibrated on" in text


def _run_tiny(out, *extra):
    cmd = [sys.executable, "-m", "tools.bench", "--tiny", "--steps", "2", "--warmup", "0",
           "--ready-probe-runs", "1", "--out", str(out), "--timeout", "240",
           "--modes", "compute_only,comm_only", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return json.loads((out / "bench.json").read_text())


def _can_unshare_net() -> bool:
    import shutil

    if not all(shutil.which(t) for t in ("unshare", "ip", "tc")):
        return False
    cmd = ["unshare", "-n", "true"] if os.geteuid() == 0 else ["unshare", "-r", "-n", "true"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_net(), reason="no network namespaces here (needs root or user namespaces, iproute2)")
def test_bench_runs_on_the_emulated_link(tmp_path):
    data = _run_tiny(tmp_path / "bench", "--link-gbit", "1")
    net = data["network"]
    assert net["emulated"] and net["rate_gbit"] == 1.0
    assert "tbf" in net["qdisc"] and "1Gbit" in net["qdisc"]
    assert "Sent" in net["tc_stats_after"]  # the ranks' traffic went through the limited loopback
