"""The CUDA benchmark's parts that run without a GPU: its allocation-site reader on a snapshot
made by hand, the refusal where CUDA is absent, and its processes end to end on CPU
(``--simulate-on-cpu``: the same workers, turns and report, memory read as 0)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tools.bench import memsites

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MB = memsites.MB


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


USER = ("/work/x/train.py", 12, "step")
GRAPHDDP = ("/work/x/graphddp/optim/attached.py", 309, "update_args")
TORCH = ("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward")


def _snapshot() -> dict:
    return {"segments": [{"blocks": [
        {"address": 0, "size": 4 * MB, "state": "active_allocated", "frames": _frames(TORCH, USER)},
        {"address": 4 * MB, "size": 2 * MB, "state": "active_allocated", "frames": _frames(TORCH, GRAPHDDP, USER)},
        {"address": 6 * MB, "size": 1 * MB, "state": "inactive", "frames": _frames(USER)},
        {"address": 7 * MB, "size": 1 * MB, "state": "active_allocated"},
    ]}]}


def test_live_blocks_are_grouped_by_the_frame_that_names_them():
    rows = {site: (mb, n) for site, mb, n in memsites.live_sites(_snapshot())}
    assert rows == {"train.py:12 step": (4.0, 1), "graphddp/optim/attached.py:309 update_args": (2.0, 1),
                    memsites.BEFORE: (1.0, 1)}


def test_the_peak_is_found_from_the_blocks_before_and_the_trace():
    before = memsites.live_blocks(_snapshot())  # 7 MB
    trace = [
        {"action": "alloc", "addr": 100 * MB, "size": 3 * MB, "frames": _frames(USER)},  # 10
        {"action": "free_requested", "addr": 0},  # still counted until completed
        {"action": "alloc", "addr": 200 * MB, "size": 2 * MB, "frames": _frames(GRAPHDDP)},  # 12: the peak
        {"action": "free_completed", "addr": 0},  # 8
        {"action": "alloc", "addr": 300 * MB, "size": 3 * MB, "frames": _frames(USER)},  # 11
    ]
    peak, rows = memsites.peak_sites(before, trace)
    assert peak == 12.0
    assert dict((s, mb) for s, mb, _ in rows)["train.py:12 step"] == 7.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_without_cuda_it_says_so_and_runs_nothing(tmp_path, capsys):
    # what python -m tools.bench runs (its entry point: test_its_processes_take_turns_and_report_on_cpu)
    from tools.bench.cli import main

    assert main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "bench_cuda.json")


def test_the_cuda_graph_probe_without_cuda_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "cudagraphs.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench.cudagraphs", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "CUDA is not available" in done.stdout, done.stdout + done.stderr
    assert not out.exists()


def test_its_processes_take_turns_and_report_on_cpu(tmp_path):
    modes = "compile,graphddp_optim,graphddp_full"
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--device", "cuda", "--simulate-on-cpu", "--model", "cnn", "--backend",
         "aot_eager", "--modes", modes, "--rounds", "2", "--steps", "1", "--warmup", "1", "--profile-steps", "2",
         "--inductor-config", "combo_kernels=False", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.load(open(tmp_path / "bench_cuda.json"))["modes"]
    assert sorted(result) == sorted(modes.split(","))
    for mode, row in result.items():
        assert len(row["round_ms"]) == 2 and row["step_ms"] > 0, (mode, row)
        for figure in ("between", "step_peak", "timed_peak"):  # the GPU lane's bounds read these
            assert f"{figure}_mb" in row and f"{figure}_requested_mb" in row, (mode, sorted(row))
        assert row["params"] == sum(p.numel() for p in __import__("graphddp.models").models.CNN().parameters())
        profile = row["profile"]  # read over CPU ops here: the reading, not a figure
        assert profile["launches_per_step"] > 0 and profile["top"] and (tmp_path / profile["trace"]).exists(), profile
    text = open(tmp_path / "bench_cuda.txt").read()
    assert "| graphddp_optim |" in text and "graphddp_full: per step" in text and "inductor combo_kernels=False" in text


@pytest.mark.parametrize("pair", ["no_such_setting=True", "combo_kernels", "combo_kernels=yes please"])
def test_an_inductor_setting_it_cannot_apply_is_refused_by_name(pair):
    from tools.bench.cuda import inductor_settings  # what run() calls before any process starts

    with pytest.raises(SystemExit, match=f"--inductor-config {pair!r}"):
        inductor_settings([pair])
    assert inductor_settings(["combo_kernels=True", " max_autotune = False"]) == {"combo_kernels": True, "max_autotune": False}


def test_the_profile_reads_busy_and_idle_time_per_step(tmp_path):
    from tools.bench import gpu_profile

    events = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: busy 0-15
              {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 40, "dur": 20},  # idle 15-40
              {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 100}]  # not device work
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    figures = gpu_profile.busy_idle_ms(str(path), steps=1)
    assert figures == {"busy_ms": 0.035, "idle_ms": 0.025, "span_ms": 0.06}
    kernels = gpu_profile.top_kernels(str(path), steps=1)
    assert kernels["launches_per_step"] == 3 and kernels["top"][0] == ["c", 1, 0.02]
