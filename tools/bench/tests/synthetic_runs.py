"""The synthetic runs of the benchmark's arithmetic tests (``test_bounds.py``,
``test_mode_summaries.py``): per-rank records, profiles and run info of two ranks, three timed
steps per mode, whose figures those tests work out by hand; ``_schedule`` builds the schedules
of one-gradient buckets they carry, ``CFG`` is the run's configuration."""
from __future__ import annotations

import copy

from graphddp.config import DDPConfig
from graphddp.values.schedule import Bucket, GradSlot, Schedule
from tools.bench.workload import MB, BenchConfig


def _schedule(sizes):
    """A 2-rank schedule of one-gradient buckets of ``sizes`` bytes (fp32), in this order."""
    buckets = tuple(
        Bucket(index=i, slots=(GradSlot(output_index=i, param_name=f"p{i}", shape=(n // 4,), dtype="float32",
                                        device="cpu", numel=n // 4, nbytes=n, producer=f"g{i}", position=i),),
               dtype="float32", device="cpu", issue_after=f"g{i}", wait_before="output", overlap=())
        for i, n in enumerate(sizes))
    return Schedule(graph_index=0, world_size=2, group_name="0", bucket_cap_mb=4.0, first_bucket_cap_mb=1.0,
                    buckets=buckets)


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
