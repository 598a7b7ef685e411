"""graphddp against DDP(torch.compile) + the same torch.optim on one GPU: every mode, bf16 (and
fp16 + GradScaler) autocast, inductor, NCCL at world size 1 and two gloo ranks on the GPU.

The cases (``lane.CASES``) run as processes of their own, several at once (their compiles are
most of the time), from the moment the lane is collected (in a thread, beside the tests before
them: ``conftest.py``); each case is then its own test, waiting for the run. ``GRAPHDDP_GPU_LANE_JOBS`` caps the processes running at once (default 10);
``GRAPHDDP_GPU_LANE_ONLY`` (comma-separated case names) runs only those.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import lane  # beside this file (pytest puts its folder on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = float(os.environ.get("GRAPHDDP_GPU_LANE_TIMEOUT", "420"))
_RESULTS: dict[str, list[dict]] = {}


_STARTED: list[threading.Thread] = []


def start_in_background() -> None:
    """Run every case in a thread from now on (``conftest.py`` calls this once the lane is
    collected): the cases' compiles are most of ``make test-gpu``'s time, and they need the
    host's cores, not the GPU, so they overlap the tests that come before them."""
    if not _STARTED:
        _STARTED.append(threading.Thread(target=_run_all, name="gpu-lane", daemon=True))
        _STARTED[0].start()


def _run_all(device_args: list[str] | None = None) -> dict[str, list[dict]]:
    """Every case's per-rank reports, running ``GRAPHDDP_GPU_LANE_JOBS`` processes at once."""
    if _STARTED and threading.current_thread() is not _STARTED[0]:
        _STARTED[0].join()
    if _RESULTS:
        return _RESULTS
    tmp = tempfile.mkdtemp(prefix="graphddp-gpu-lane-")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "2")}
    jobs = []  # (case name, rank, result path, argv)
    only = [n for n in os.environ.get("GRAPHDDP_GPU_LANE_ONLY", "").split(",") if n]
    for case in lane.CASES:
        if only and lane.case_name(case) not in only:
            continue
        name = lane.case_name(case)
        world = lane.world_of(case[0])
        for rank in range(world):
            result = os.path.join(tmp, f"{name}-{rank}.json")
            argv = [sys.executable, os.path.join(HERE, "lane.py"), name, str(rank), str(world),
                    os.path.join(tmp, f"{name}.store"), result, *(device_args or [])]
            jobs.append((name, rank, result, argv))
    # One inductor cache per autocast dtype: before torch 2.12 AOTAutograd's cache key held whether
    # autocast was on, not its dtype (pytorch#181564), and the lane's GPU has torch 2.11. With one
    # cache for all cases, the fp16 + GradScaler CNN's reference, DDP(torch.compile(CNN)), could be
    # served the CNN graphs the bf16 cases compiled (the case failed four times in the lane, with
    # DDP's own gradients off, and passed every time alone with a cache of its own). With the caches
    # split it passed beside every other case (H100, 2026-11-27): it no longer runs alone.
    caches = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "inductor"))
    cache_of = {lane.case_name(case): os.path.join(caches, f"autocast-{lane.autocast_dtype(case[2])}".replace("torch.", ""))
                for case in lane.CASES}
    limit = int(os.environ.get("GRAPHDDP_GPU_LANE_JOBS", "10"))
    running: list[tuple[subprocess.Popen, float]] = []
    logs = {}
    deadline = time.time() + TIMEOUT
    queue = list(jobs)
    while queue or running:
        # The ranks of one case start together (a rank waits for its peer at the store).
        while queue and len(running) < limit:
            name = queue[0][0]
            group = [j for j in queue if j[0] == name]
            queue = [j for j in queue if j[0] != name]
            for _, rank, _, argv in group:
                log = open(os.path.join(tmp, f"{name}-{rank}.log"), "w")
                logs[(name, rank)] = log.name
                running.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                 env={**env, "TORCHINDUCTOR_CACHE_DIR": cache_of[name]}), time.time()))
        time.sleep(0.2)
        still = []
        for proc, started in running:
            if proc.poll() is None and time.time() > deadline:
                proc.kill()
            if proc.poll() is None:
                still.append((proc, started))
        running = still
    for name, rank, result, _ in jobs:
        if os.path.exists(result):
            with open(result) as f:
                report = json.load(f)
        else:
            with open(logs[(name, rank)]) as f:
                report = {"case": name, "rank": rank, "ok": False, "error": "no result; log:\n" + f.read()[-4000:]}
        _RESULTS.setdefault(name, []).append(report)
    out = os.environ.get("GRAPHDDP_GPU_OUT")
    if out:  # every case's reports, errors included, beside the benchmark's table
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "lane.json"), "w") as f:
            json.dump(_RESULTS, f, indent=1)
    return _RESULTS


NAMES = [lane.case_name(c) for c in lane.CASES]


@pytest.mark.parametrize("name", NAMES)
def test_trains_like_ddp(name):
    reports = _run_all().get(name)
    if reports is None:
        pytest.skip("not in GRAPHDDP_GPU_LANE_ONLY")
    failed = [r for r in reports if not r.get("ok")]
    assert not failed, "\n".join(f"rank {r['rank']}:\n{r.get('error')}" for r in failed)
    worst = max(r["max_param_diff"] for r in reports)
    print(f"{name}: parameters within {worst:.2g} of DDP's after {reports[0]['steps']} steps on {reports[0]['device']}")
