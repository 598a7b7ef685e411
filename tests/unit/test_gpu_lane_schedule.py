"""The GPU lane's scheduler (tests/gpu/test_gpu_lane.py), checked without a GPU: each case's
ranks start together, at most ``GRAPHDDP_GPU_LANE_JOBS`` processes run at once, and cases under
different autocast dtypes never share an inductor cache. The lane's cases are replaced by
processes that sleep and report when they ran; nothing here touches CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))

import lane  # noqa: E402
import test_gpu_lane  # noqa: E402

# argv of a lane process: python lane.py CASE RANK WORLD STORE RESULT
_FAKE = (
    "import json, os, sys, time\n"
    "start = time.time(); time.sleep(0.4)\n"
    "json.dump({'case': sys.argv[1], 'rank': int(sys.argv[2]), 'ok': True, 'start': start, 'end': time.time(),"
    " 'max_param_diff': 0.0, 'steps': 0, 'cache': os.environ.get('TORCHINDUCTOR_CACHE_DIR')},"
    " open(sys.argv[3], 'w'))\n"
)


@pytest.fixture
def fake_lane(monkeypatch):
    real = subprocess.Popen

    def popen(argv, **kwargs):
        name, rank, result = argv[2], argv[3], argv[6]
        return real([sys.executable, "-c", _FAKE, name, rank, result], **kwargs)

    monkeypatch.setattr(test_gpu_lane.subprocess, "Popen", popen)
    monkeypatch.setattr(test_gpu_lane, "_RESULTS", {})
    monkeypatch.setattr(test_gpu_lane, "_STARTED", [])
    monkeypatch.delenv("GRAPHDDP_GPU_OUT", raising=False)


def test_no_more_than_the_job_limit_run_at_once(fake_lane, monkeypatch):
    names = [lane.case_name(c) for c in lane.CASES if lane.case_name(c).startswith("nccl1")][:4]  # one process each
    monkeypatch.setenv("GRAPHDDP_GPU_LANE_ONLY", ",".join(names))
    monkeypatch.setenv("GRAPHDDP_GPU_LANE_JOBS", "2")
    results = test_gpu_lane._run_all()
    spans = sorted((r["start"], r["end"]) for n in names for r in results[n])
    at_once = [sum(1 for s, e in spans if s <= t < e) for t, _ in spans]
    assert max(at_once) <= 2, f"{max(at_once)} lane processes at once with GRAPHDDP_GPU_LANE_JOBS=2"
    assert max(at_once) == 2, "the cases ran one after another: their compiles would not overlap"
    json.dumps(results)  # what GRAPHDDP_GPU_OUT would get


def test_cases_under_other_autocast_dtypes_never_share_an_inductor_cache(fake_lane, monkeypatch):
    """torch 2.11 (the lane's GPU) keyed AOTAutograd's cache on whether autocast was on, not on
    its dtype: the fp16 case's DDP reference was served the bf16 cases' CNN graphs."""
    cnn = [lane.case_name(c) for c in lane.CASES if c[1] == "cnn"]
    monkeypatch.setenv("GRAPHDDP_GPU_LANE_ONLY", ",".join(cnn))
    results = test_gpu_lane._run_all()
    cache = {name: {r["cache"] for r in reports} for name, reports in results.items()}
    assert all(len(dirs) == 1 and None not in dirs for dirs in cache.values()), cache
    for a in cnn:
        for b in cnn:
            same = lane.autocast_dtype(a.split("-")[-1]) == lane.autocast_dtype(b.split("-")[-1])
            assert (cache[a] == cache[b]) == same, (a, b, cache)
    assert len({lane.autocast_dtype(n.split("-")[-1]) for n in cnn}) > 1  # the lane's CNN cases mix dtypes
