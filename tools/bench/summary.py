"""Rank records -> per-mode medians, the two bounds, the ratios and the targets."""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

import torch

from graphddp.values.schedule import Schedule
from tools.bench.release import fit_link, release_timeline
from tools.bench.workload import DDP_CAP_MODES, DDP_CAPS, GRAPHDDP_CAP_MODES, MAX_GRAD_NORM, MB, MEMORY_TARGET, OPTIMIZER, POWERSGD_MODES, POWERSGD_SETTINGS, SWEEP_CAPS, TARGETS, WIRE_ROWS, BenchConfig


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(cfg: BenchConfig, ranks: list[dict], wall_s: float) -> dict[str, Any]:
    info = ranks[0]["info"]
    modes: dict[str, dict] = {}
    for name in ranks[0]["records"]:
        per_rank = [r["records"][name] for r in ranks]
        n = min(len(x) for x in per_rank)
        steps = [max(per_rank[k][i]["step"] for k in range(len(ranks))) for i in range(n)]
        step = _median(steps)
        rec: dict[str, Any] = {
            "step_ms": step * 1e3,
            "steps_ms": [s * 1e3 for s in steps],
            "min_ms": min(steps) * 1e3,
            "max_ms": max(steps) * 1e3,
            "first_step_s": max(r["first"][name] for r in ranks),
        }
        for phase in ("fwd", "bwd", "comm", "opt"):
            rec[f"{phase}_ms"] = statistics.fmean(_median([x[phase] for x in pr]) for pr in per_rank) * 1e3
        # CPU time of the rank's main thread over wall time: < 1 where it waited (communication)
        # or was descheduled (another process on the core: contention).
        rec["cpu_per_wall"] = statistics.fmean(_median([x["cpu"] / x["step"] for x in pr]) for pr in per_rank)
        # Time the main thread was runnable but had no core, per step (median, worst rank).
        rec["rq_wait_ms"] = max(_median([x["rq_wait"] for x in pr]) for pr in per_rank) * 1e3
        # CPU time of the rank's other threads (gloo's workers: copies, reductions, sockets).
        rec["other_threads_cpu_ms"] = statistics.fmean(
            _median([x["proc_cpu"] - x["cpu"] for x in pr]) for pr in per_rank) * 1e3
        # Machine-wide busy CPU per step (both ranks, their threads and the kernel's network
        # work), rank 0's reading, mean over steps (tick resolution); of 2 cores x step time.
        rec["machine_cpu_ms"] = statistics.fmean(x["machine_busy"] for x in per_rank[0]) * 1e3
        # Pages the rank's process touched for the first time in the step (fresh allocations the
        # kernel had to map and zero: CPU taken from the compute), median per step, worst rank.
        rec["minor_faults"] = max(_median([x.get("minor_faults", 0) for x in pr]) for pr in per_rank)
        rec["compile_s"] = rec["first_step_s"] - step
        rec["peak_step_mb"] = max(r["profiles"][name]["peak_mb"] for r in ranks)
        rec["retained_mb"] = max(r["profiles"][name]["retained_mb"] for r in ranks)
        # The previous step's gradients, alive at the step's start and freed by its zero_grad:
        # memory the mode holds between steps, which the peak above the start leaves out.
        rec["held_grad_mb"] = max(r["profiles"][name].get("held_grad_mb", 0.0) for r in ranks)
        # DDP's reducer keeps one flat buffer per bucket for the model's lifetime; graphddp and
        # no_overlap allocate theirs inside the step, so the step's peak already holds them.
        ddp_buckets = info.get("ddp_buckets", {}).get(name)
        rec["persistent_comm_mb"] = sum(b["nbytes"] for b in ddp_buckets) / MB if ddp_buckets else 0.0
        rec["peak_mb"] = rec["peak_step_mb"] + rec["held_grad_mb"] + rec["persistent_comm_mb"]
        # What the mode keeps between steps on a rank: optimizer state, parameters (max over ranks).
        rec["state_mb"] = max(r["info"].get("state_mb", {}).get(name, 0.0) for r in ranks)
        rec["param_mb"] = max(r["info"].get("param_mb", {}).get(name, 0.0) for r in ranks)
        if name == "comm_only":
            nb = len(per_rank[0][0]["buckets"])
            rec["bucket_ms"] = [
                _median([max(pr[i]["buckets"][j] for pr in per_rank) for i in range(n)]) * 1e3 for j in range(nb)
            ]
        pred = info.get("predicted", {}).get(name)
        if pred is not None:  # issue 12: graphddp's cost model of this mode's backward (predict.py)
            rec["pred_bwd_ms"] = pred["bwd_ms"]
            rec["pred_compute_ms"] = pred["compute_ms"]
            rec["pred_exposed_ms"] = pred["exposed_ms"]
            rec["bwd_over_pred"] = rec["bwd_ms"] / pred["bwd_ms"] if pred["bwd_ms"] > 0 else None
        wire = info.get("wire", {}).get(name)
        if wire is not None:  # bytes each rank puts on the wire per step (ranks._wire, powersgd.py)
            rec["wire_mb"] = wire["bytes"] / MB
            rec["uncompressed_wire_mb"] = wire["uncompressed_bytes"] / MB
        modes[name] = rec
    g = cfg.graphddp
    notes = {
        "compute_only": f"torch.compile({g.backend}), no communication",
        "compute_eager": "eager model, no communication (what eager DDP computes)",
        "comm_only": "graphddp's buckets, all-reduced one at a time",
        "no_overlap": f"torch.compile({g.backend}) + 1 flat all-reduce after backward",
        "graphddp_tail_off": "graphddp, same caps, last_bucket_cap_mb off (DDP's rule: the tail is the remainder)",
        "ideal_overlap": f"torch.compile({g.backend}) + graphddp's buckets all issued at backward start "
                         "(no data dependency): the measured floor",
        "ddp_default": "DDP eager, default caps (25 MB, first 1 MB)",
        "ddp_same_buckets": "DDP eager, " + info.get("ddp_same_buckets", {}).get("method", "?") + " = graphddp's buckets",
        "ddp_compiled": "DDP(torch.compile) + DDPOptimizer, "
                        f"{info.get('ddp_compiled', {}).get('graphs', '?')} graphs, DDP's default caps",
        "ddp_compiled_samecap": "DDP(torch.compile) + DDPOptimizer, "
                                f"{info.get('ddp_compiled_samecap', {}).get('graphs', '?')} graphs, "
                                f"cap {info.get('ddp_compiled_samecap', {}).get('bucket_cap_mb', float('nan')):g} MB "
                                f"(graphddp's{', its largest auto bucket' if g.auto else ''})",
        "ddp_compiled_autograd": _compiled_autograd_note(g.backend, info.get("ddp_compiled_autograd", {})),
        "graphddp": f"graphddp.compile({g.backend}), " + (
            "bucket_cap_mb='auto'" if g.auto else
            f"caps {g.effective_bucket_cap_mb:g} MB, first {g.effective_first_bucket_cap_mb:g}, last "
            f"{g.last_bucket_cap_mb if g.last_bucket_cap_mb is not None else 'off'}") + ", separate optimizer",
        "graphddp_optim": "graphddp, same caps, optimizer inside the backward (its update is in bwd)",
        "graphddp_optim_clip": f"graphddp_optim with max_grad_norm={MAX_GRAD_NORM:g}: norms after each wait, every update after the last",
        "graphddp_clip": f"graphddp, same caps, clip_grad_norm_(params, {MAX_GRAD_NORM:g}) after the backward (in comm), separate optimizer",
        "graphddp_sharded": "graphddp, same caps, sharding='optimizer': reduce-scatter, 1/N of AdamW in the backward, all-gather",
        "graphddp_sharded_fwd": "graphddp_sharded with gather='forward': each all-gather waited for in the next forward",
        "graphddp_sharded_clip": f"graphddp_sharded with max_grad_norm={MAX_GRAD_NORM:g}: parts normed as they arrive, one all-reduce "
                                 "of their squares, every update and all-gather after it",
        "graphddp_sharded_fwd_clip": "graphddp_sharded_clip with gather='forward': each all-gather waited for in the next forward",
        "fsdp2_clip": f"fsdp2 + clip_grad_norm_(params, {MAX_GRAD_NORM:g}) on the sharded gradients after the backward (in comm)",
        "ddp_zero": "DDP eager (cap 1 MB) + ZeroRedundancyOptimizer(AdamW): 1/N of the state, params broadcast after the step",
        "fsdp2": "fully_shard per block and root, reshard_after_forward=False (ZeRO-2 shape), eager, AdamW on the shards",
        "fsdp2_reshard": "fully_shard per block and root, reshard_after_forward=True (FSDP2's default), eager, AdamW on the shards",
        "graphddp_full": "graphddp, sharding='full': each parameter gathered where read and again in the backward, "
                         "reduce-scattered; AdamW on each part inside the backward",
        "graphddp_full_keep": "graphddp_full with reshard_after_forward=False: gathered parameters kept to the backward",
        "graphddp_full_bf16": "graphddp_full with mp_policy=MixedPrecisionPolicy(bf16 params, fp32 reduce), FSDP2's policy",
        "fsdp2_reshard_bf16": "fsdp2_reshard with mp_policy=MixedPrecisionPolicy(bf16 params, fp32 reduce)",
        "graphddp_auto": _auto_note(info.get("graphddp_auto")),
        **_powersgd_notes(cfg, info),
    }
    for c in DDP_CAPS:
        notes[f"ddp_cap{c}"] = f"DDP eager, bucket_cap_mb={c}"
    for c in SWEEP_CAPS:
        notes[f"graphddp_cap{c}"] = f"graphddp, bucket_cap_mb={c} (first too, no last cap: DDP's semantics), separate optimizer"
    for name, rec in modes.items():
        rec["note"] = notes.get(name, "")
    caps = [f"ddp_cap{c}" for c in DDP_CAPS if f"ddp_cap{c}" in modes]
    if caps:
        best = min(caps, key=lambda n: modes[n]["step_ms"])
        modes["ddp_best"] = {**modes[best], "best_of": best, "note": f"fastest of {', '.join(caps)}: {best}"}
    # Issue 12: the best of both cap sweeps, graphddp_auto's yardstick; in runs with graphddp's sweep or auto.
    swept = [n for n in (*GRAPHDDP_CAP_MODES, *DDP_CAP_MODES) if n in modes]
    if swept and any(n in modes for n in ("graphddp_auto", *GRAPHDDP_CAP_MODES)):
        best = min(swept, key=lambda n: modes[n]["step_ms"])
        missing = [n for n in (*GRAPHDDP_CAP_MODES, *DDP_CAP_MODES) if n not in modes]
        modes["best_swept"] = {**modes[best], "best_of": best, "swept": swept, "not_run": missing,
                               "note": f"fastest of {len(swept)} swept: {best}"
                                       + (f" (not run: {', '.join(missing)})" if missing else " (the whole sweep)")}

    bounds: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    g = modes.get("graphddp", {}).get("step_ms")
    c, k = modes.get("compute_only"), modes.get("comm_only")
    overlap = _graphddp_overlap(ranks[0]["profiles"].get("graphddp"))
    if c and k:
        bounds["max_compute_comm_ms"] = max(c["step_ms"], k["step_ms"])
        fr = info["ready"]["fractions"]
        schedules = [Schedule.from_dict(d) for d in info["graphddp"]["schedule_dicts"]]
        wire = [b.wire_nbytes for s in schedules for b in s.buckets]
        link_model = fit_link(wire, [ms / 1e3 for ms in k["bucket_ms"]], schedules[0].world_size)

        def link_end(fractions: list[float]) -> tuple[float, list[dict]]:
            timeline = release_timeline(schedules, [f * c["bwd_ms"] for f in fractions], link_model)
            return max(t["end_ms"] for t in timeline), timeline

        link, timeline = link_end(fr)
        bounds["release_time_ms"] = c["fwd_ms"] + max(c["bwd_ms"], link) + c["opt_ms"]
        bounds["release_timeline"] = timeline
        bounds["ready_fractions"] = fr
        bounds["ready_source"] = ("post-accumulate-grad hooks on the eager backward (median of "
                                  f"{info['ready']['runs']} runs), scaled to compute_only's backward")
        bounds["bucket_comm_ms"] = k["bucket_ms"]
        bounds["link_model"] = {
            "bandwidth_gbps": link_model.bandwidth_gbps, "latency_us": link_model.latency_us,
            "bucket_ms": [link_model.allreduce_seconds(n, schedules[0].world_size) * 1e3 for n in wire],
            "source": "graphddp.plan.cost.CostModel fitted (least squares) to comm_only's per-bucket medians; "
                      "the timeline is graphddp.plan.cost.simulate",
        }
        bounds["tail_after_backward_ms"] = max(0.0, link - c["bwd_ms"])
        if overlap and overlap.get("compute_fractions") and len(overlap["compute_fractions"]) == len(fr):
            # The same bound with the ready times graphddp's compiled backward showed (its issue times).
            link2, _ = link_end(overlap["compute_fractions"])
            bounds["release_time_graphddp_issue_ms"] = c["fwd_ms"] + max(c["bwd_ms"], link2) + c["opt_ms"]
    if "ideal_overlap" in modes:
        # Measured, not modelled: the link and the CPU cost of communication, with every
        # bucket released at once. No gradient-dependent schedule can beat it.
        bounds["ideal_overlap_ms"] = modes["ideal_overlap"]["step_ms"]
    eager_ddp = [n for n in ("ddp_default", "ddp_same_buckets", *caps) if n in modes]
    best_eager = min(eager_ddp, key=lambda n: modes[n]["step_ms"]) if eager_ddp else None
    denominators = {n: modes[n]["step_ms"] for n in modes}
    if best_eager:
        denominators["best_eager_ddp"] = modes[best_eager]["step_ms"]
    if "max_compute_comm_ms" in bounds:
        denominators["max_compute_comm_bound"] = bounds["max_compute_comm_ms"]
        denominators["release_time_bound"] = bounds["release_time_ms"]
        if "release_time_graphddp_issue_ms" in bounds:
            denominators["release_time_graphddp_issue_bound"] = bounds["release_time_graphddp_issue_ms"]
    by_mode = {n: _ratios(modes, n, denominators) for n in ("graphddp", "graphddp_optim", "graphddp_auto", "graphddp_sharded", "graphddp_sharded_fwd")}
    ratios, optim_ratios = by_mode["graphddp"], by_mode["graphddp_optim"]
    # The bounds are of graphddp's buckets with a separate optimizer step: graphddp's targets only.
    targets = [_step_target(label, by_mode[num][key], limit, denominators[key], bounds if num == "graphddp" else {},
                            bound_itself=key == "release_time_bound")
               for label, num, key, limit in TARGETS if key in by_mode[num]]
    for t in targets:
        if t["target"].endswith("best swept"):
            t["best_of"], t["not_run"] = modes["best_swept"]["best_of"], modes["best_swept"]["not_run"]
    memory = _memory_target(modes, best_eager, sum(b["nbytes"] for b in info["graphddp"]["buckets"]) / MB)
    if memory:
        targets.append(memory)
    exposed = (g - c["step_ms"]) if (g and c) else None
    warnings = []
    waited = sum(x["rq_wait"] for r in ranks for recs in r["records"].values() for x in recs)
    stepped = sum(x["step"] for r in ranks for recs in r["records"].values() for x in recs)
    contention = waited / stepped if stepped else 0.0
    if c and c["cpu_per_wall"] < 0.9:
        warnings.append(f"compute_only's main thread got {c['cpu_per_wall']:.2f} s of CPU per wall second: "
                        "other processes competed for the 2 cores, so times are noisy/inflated")
    check = (info.get("graphddp_optim") or {}).get("step_vs_torch")
    if check and not (check["relative"] < 1e-3 and check["grads_none"]):
        warnings.append(f"graphddp_optim's in-backward step differs from torch.optim's by {check['relative']:.2g} of the "
                        f"step's move (L2), grads None after it: {check['grads_none']}: its update does not match torch's")
    powersgd = _powersgd_summary(cfg, modes, info, warnings)
    if contention > 0.05:
        warnings.append(f"the ranks' main threads waited for a core {100 * contention:.0f}% of the timed steps "
                        "(runqueue delay, /proc/thread-self/schedstat): the cores were shared")
    return {
        # graphddp's options flattened in, as bench.json has always had them (backend, caps).
        "config": {**{k_: v for k_, v in dataclasses.asdict(cfg).items() if k_ not in ("network", "graphddp")},
                   **cfg.graphddp.as_options(), "optimizer": OPTIMIZER},
        "environment": {
            "torch": torch.__version__, "python": sys.version.split()[0], "world_size": 2,
            "threads_per_rank": 1, "cpu_count": os.cpu_count(), "wall_s": wall_s,
            "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "inductor_cache_was_warm": os.environ.get("GRAPHDDP_BENCH_CACHE_WARM") == "1",
        },
        "network": cfg.network,
        "memory_note": ("peak_step_mb: peak of torch CPU-allocator bytes during one extra step above the "
                        "bytes live at its start (torch.profiler profile_memory; the step frees the old "
                        "grads with zero_grad(set_to_none) first). held_grad_mb: those old grads, alive "
                        "between steps (none for graphddp_optim, whose gradients die with their bucket). "
                        "persistent_comm_mb: DDP's reducer bucket buffers, alive for the model's lifetime "
                        "(the Python reducer's DDP allocates them too). peak_mb = peak_step_mb + held_grad_mb + "
                        "persistent_comm_mb: the memory a mode needs beyond parameters, optimizer state and "
                        "gloo's own buffers. retained_mb: allocator bytes still live after the step minus at "
                        "its start. Max over ranks. Before held_grad_mb (runs published before issue 11), "
                        "peak_mb left the held grads out."),
        "modes": modes,
        "bounds": bounds,
        "ratios": ratios,
        "optim_ratios": optim_ratios,
        "auto_ratios": by_mode["graphddp_auto"],
        "cost_model": info.get("cost_model"),
        "predicted": _predicted_summary(modes, info),
        "targets": targets,
        "memory_target": memory,
        "exposed_comm_ms": exposed,
        "graphddp_overlap": overlap,
        "warnings": warnings,
        "runqueue_wait_fraction": contention,
        "graphddp": info.get("graphddp"),
        "graphddp_grad_mb": sum(b["nbytes"] for b in info["graphddp"]["buckets"]) / MB,
        "graphddp_buckets": len(info["graphddp"]["buckets"]),
        "graphddp_profile": ranks[0]["profiles"].get("graphddp"),
        "ddp_compiled": info.get("ddp_compiled"),
        "ddp_compiled_samecap": info.get("ddp_compiled_samecap"),
        "ddp_compiled_autograd": info.get("ddp_compiled_autograd"),
        "graphddp_optim": info.get("graphddp_optim"),
        "graphddp_auto": info.get("graphddp_auto"),
        "powersgd": powersgd,
        "ddp_same_buckets": info.get("ddp_same_buckets"),
        "ddp_buckets_mb": {n: [b["nbytes"] / MB for b in v] for n, v in info.get("ddp_buckets", {}).items()},
        "ddp_same_buckets_params": [b["params"] for b in info.get("ddp_buckets", {}).get("ddp_same_buckets", [])],
    }


PREDICTION_NOTE = (
    "pred bwd: graphddp's cost model of the mode's backward, graphddp.plan.cost.simulate(schedule, cost).step_seconds "
    "summed over its backward graphs: compute (graphddp's per-node estimates at the cost model's rates) plus the "
    "all-reduces left exposed after it, one bucket on the link at a time; cost = graphddp.runtime.calibrate.calibrate on "
    "this run's process group (what bucket_cap_mb='auto' minimises). ddp_*: graphddp's model of that bucket layout "
    "(graphddp.plan.planner.plan with DDP's caps on graphddp's backward graph), not of eager DDP's own compute. "
    "bwd/pred: measured bwd over predicted")


def _predicted_summary(modes: dict[str, dict], info: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 12: per mode, the predicted backward and its parts next to the measured one."""
    pred = info.get("predicted")
    if not pred:
        return None
    rows = {}
    for name, p in pred.items():
        if name not in modes:
            continue
        rows[name] = {**p, "measured_bwd_ms": modes[name]["bwd_ms"], "bwd_over_pred": modes[name].get("bwd_over_pred")}
    out = {"note": PREDICTION_NOTE, "cost_model": info.get("cost_model"), "modes": rows}
    c = modes.get("compute_only")
    if c and "graphddp" in rows:  # where a misprediction sits: the compute, or the communication
        out["compute_check"] = {"graphddp_pred_compute_ms": rows["graphddp"]["compute_ms"],
                                "compute_only_bwd_ms": c["bwd_ms"]}
    return out


def _auto_note(auto: dict[str, Any] | None) -> str:
    if not auto:
        return "graphddp, bucket_cap_mb='auto' (calibrated cost model), separate optimizer"
    mb = auto.get("bucket_mb", [])
    return (f"graphddp, bucket_cap_mb='auto': {len(mb)} buckets of {', '.join('%.2f' % b for b in mb[:8])}"
            f"{', ...' if len(mb) > 8 else ''} MB, separate optimizer")


def _graphddp_overlap(profile: dict | None) -> dict[str, Any] | None:
    """From graphddp's profiled step: when each all-reduce was issued inside the backward."""
    if not profile or not profile["compiled_backward_ms"]:
        return None
    start, dur = profile["compiled_backward_ms"][0]
    issues = [c["start_ms"] - start for c in profile["collectives"] if c["name"].endswith("all_reduce_")]
    waits = [c for c in profile["collectives"] if c["name"].endswith("wait_tensor")]
    compute_end = (waits[0]["start_ms"] - start) if waits else dur  # the waits sit after the last kernel
    return {
        "compute_fractions": [min(1.0, t / compute_end) for t in issues],
        "backward_ms": dur,
        "issue_ms": issues,
        "issue_fraction": [t / dur for t in issues],
        "first_wait_at_ms": (waits[0]["start_ms"] - start) if waits else None,
        "wait_ms": [w["dur_ms"] for w in waits],
        "note": "one extra graphddp step under torch.profiler, rank 0; times from the start of the compiled backward",
    }


def _ratios(modes: dict[str, dict], numerator: str, denominators: dict[str, float]) -> dict[str, float]:
    """``numerator``'s step over every other figure; empty when that mode did not run."""
    step = modes.get(numerator, {}).get("step_ms")
    if not step:
        return {}
    return {k: step / v for k, v in denominators.items() if v and k != numerator}


def _step_target(label: str, ratio: float, limit: float, denominator_ms: float, bounds: dict[str, Any], *,
                 bound_itself: bool) -> dict[str, Any]:
    """One step-time target, with the step it asks for next to the bounds.

    A target below the release-time bound cannot be met by any schedule of these buckets on
    this link. The bounds model a separate optimizer step after the backward, so only
    graphddp's targets get them (``bounds`` is empty for graphddp_optim's).
    """
    needs = limit * denominator_ms
    known = [bounds[k] for k in ("release_time_ms", "release_time_graphddp_issue_ms") if k in bounds]
    floor = min(known) if known else None
    return {"target": label, "kind": "step", "ratio": ratio, "limit": limit, "met": ratio <= limit,
            "needs_ms": needs, "release_bound_ms": floor,
            "below_release_bound": floor is not None and not bound_itself and needs < floor,
            "ideal_overlap_ms": bounds.get("ideal_overlap_ms"),
            "below_measured_floor": "ideal_overlap_ms" in bounds and needs < bounds["ideal_overlap_ms"]}


def _memory_target(modes: dict[str, dict], ddp: str | None, grad_mb: float) -> dict[str, Any] | None:
    """graphddp_optim's peak against ``ddp``'s (the best eager DDP) less the gradient bytes.

    DDP holds every gradient until its optimizer step (and its reducer's buckets for the
    model's lifetime); with the update inside the backward no gradient outlives its bucket,
    so the issue asks for at least the gradients' worth of memory back.
    """
    optim = modes.get("graphddp_optim")
    if not optim or not ddp:
        return None
    label, limit = MEMORY_TARGET
    allowed = modes[ddp]["peak_mb"] - grad_mb
    ratio = optim["peak_mb"] / allowed if allowed > 0 else float("inf")
    return {"target": label, "kind": "memory", "ratio": ratio, "limit": limit, "met": ratio <= limit,
            "graphddp_optim_peak_mb": optim["peak_mb"], "ddp_mode": ddp, "ddp_peak_mb": modes[ddp]["peak_mb"],
            "grad_mb": grad_mb, "needs_mb": limit * allowed}


def _compiled_autograd_note(backend: str, info: dict[str, Any]) -> str:
    if backend != "inductor":  # the fusion passes are inductor's: one all-reduce per parameter
        return f"torch.compile(DDP, python_reducer) + compiled autograd ({backend}: all-reduces not fused)"
    return (f"torch.compile(DDP, python_reducer) + compiled autograd, inductor fusion "
            f"{'+'.join(info.get('fuse_passes', ['?']))}, cap {info.get('fuse_bucket_mb', '?')} MB")


# Each PowerSGD mode against the mode that sends the same gradients uncompressed.
POWERSGD_BASELINE = {"graphddp_powersgd": "graphddp", "ddp_powersgd": "ddp_default", "ddp_powersgd_serial": "ddp_default"}


def _powersgd_notes(cfg: BenchConfig, info: dict[str, Any]) -> dict[str, str]:
    ps = (info.get("powersgd") or {}).get("modes", {})
    rank = f"rank {cfg.powersgd_rank}, start_powerSGD_iter {POWERSGD_SETTINGS['start_powerSGD_iter']}"
    cap = (ps.get("ddp_powersgd", {}).get("ddp_kwargs") or {}).get("bucket_cap_mb", "?")
    return {
        "graphddp_powersgd": f"graphddp, same caps, comm_hook=graphddp.hooks.PowerSGD({rank}) in the graph",
        "ddp_powersgd": f"DDP eager + powerSGD_hook ({rank}), ONE bucket (bucket_cap_mb={cap}): gloo deadlocks "
                        "with > 1 in flight; no overlap",
        "ddp_powersgd_serial": f"DDP eager, default caps + powerSGD_hook ({rank}) waited per bucket in the hook "
                               "(no deadlock, no overlap)",
    }


def _powersgd_summary(cfg: BenchConfig, modes: dict[str, dict], info: dict[str, Any],
                      warnings: list[str]) -> dict[str, Any] | None:
    """Issue 13's rows: step time and bytes on the wire, each PowerSGD mode against the same
    gradients sent uncompressed; the wire figures' cross-checks become warnings if they differ."""
    ps = info.get("powersgd")
    if not ps or not any(n in modes for n in POWERSGD_MODES):
        return None
    rows: dict[str, dict] = {}
    for name in WIRE_ROWS:
        rec, wire = modes.get(name), info.get("wire", {}).get(name)
        if rec is None or wire is None:
            continue
        row = {"step_ms": rec["step_ms"], "wire_mb": wire["bytes"] / MB,
               "uncompressed_wire_mb": wire["uncompressed_bytes"] / MB,
               "wire_fraction": wire["bytes"] / wire["uncompressed_bytes"] if wire["uncompressed_bytes"] else None,
               "buckets": wire.get("buckets"), "source": wire["source"]}
        base = POWERSGD_BASELINE.get(name)
        if base in modes:
            row["vs"] = base
            row["step_vs_uncompressed"] = rec["step_ms"] / modes[base]["step_ms"]
        rows[name] = row
        cross = {"graphddp_powersgd": "bytes_by_layout", "ddp_powersgd": "bytes_by_counters",
                 "ddp_powersgd_serial": "bytes_by_counters"}.get(name)
        if cross and wire.get(cross) is not None:
            row["cross_check"] = {cross: wire[cross]}
        if cross and wire.get(cross) is not None and abs(wire[cross] - wire["bytes"]) > 0.5:
            warnings.append(f"{name}: {wire['bytes']} bytes on the wire per step by its schedule/shapes, "
                            f"{wire[cross]:.0f} by {cross}: the two accounts disagree")
    out: dict[str, Any] = {"settings": ps["settings"], "modes": ps["modes"], "rows": rows}
    graphddp_wire = info.get("wire", {}).get("graphddp_powersgd") or {}
    if "schedules" in graphddp_wire:  # its plans, with each bucket's hook and wire MB
        out["graphddp_powersgd_schedules"] = graphddp_wire["schedules"]
    if "graphddp_powersgd" in modes:
        for ddp in ("ddp_powersgd", "ddp_powersgd_serial"):
            if ddp in modes:
                out[f"graphddp_powersgd / {ddp}"] = modes["graphddp_powersgd"]["step_ms"] / modes[ddp]["step_ms"]
    return out
