"""The terminal table and the PNG chart, both drawn from the summary dict alone."""
from __future__ import annotations

from typing import Any

from tools.bench.workload import REPORTED


def render_table(s: dict[str, Any]) -> str:
    net = s["network"]
    cfg = s["config"]
    lines = [
        f"graphddp benchmark: model {cfg['model'] if not cfg['tiny'] else 'tiny mlp'}, "
        f"{s['graphddp_grad_mb']:.1f} MB of gradients in {s['graphddp_buckets']} graphddp buckets, "
        f"2 ranks x 1 thread, backend {cfg['backend']}, median of {cfg['steps']} steps after {cfg['warmup']} warm-up rounds",
        f"optimizer: {cfg.get('optimizer', 'SGD(lr=1e-3, momentum=0.9)')} in every mode (graphddp_optim: inside its backward)",
        f"compile s = first step - median step; inductor cache {'warm' if s['environment']['inductor_cache_was_warm'] else 'cold'} "
        f"({s['environment']['inductor_cache']})",
        f"network: {net['label']}",
    ]
    if cfg["backend"] != "inductor":
        lines.append(f"NOTE: compiled modes use backend={cfg['backend']!r}, not inductor (--tiny or --backend)")
    cm = s.get("cost_model")
    if cm:
        lines.append(f"cost model (pred bwd): {cm.get('source') or 'graphddp.runtime.calibrate.calibrate'}: "
                     f"{cm['bandwidth_gbps']:.3g} Gbit/s, {cm['latency_us']:.3g} us per ring step, "
                     f"{cm['compute_tflops']:.3g} TFLOP/s, {cm['memory_gbps']:.3g} GB/s, {cm['op_overhead_us']:.3g} us per op"
                     + (f", {cm['collective_overhead_us']:.3g} us per collective" if "collective_overhead_us" in cm else ""))
    head = (f"{'mode':<21} {'step ms':>9} {'fwd':>8} {'bwd':>8} {'pred bwd':>8} {'bwd/pred':>8} {'comm':>8} {'opt':>7} "
            f"{'compile s':>9} {'peak MB':>8} "
            f"{'cpu/wall':>8} {'rq ms':>6} {'cpu ms':>7} {'graphddp/x':>10} {'optim/x':>7}  note")
    lines += [head, "-" * len(head)]
    g = s["modes"].get("graphddp", {}).get("step_ms")
    o = s["modes"].get("graphddp_optim", {}).get("step_ms")
    for name in REPORTED:
        r = s["modes"].get(name)
        if not r:
            continue
        ratio = f"{g / r['step_ms']:.3f}" if g and name != "graphddp" else ""
        optim = f"{o / r['step_ms']:.3f}" if o and name != "graphddp_optim" else ""
        pred = f"{r['pred_bwd_ms']:.1f}" if r.get("pred_bwd_ms") is not None else ""
        over = f"{r['bwd_over_pred']:.2f}" if r.get("bwd_over_pred") is not None else ""
        lines.append(
            f"{name:<21} {r['step_ms']:>9.1f} {r['fwd_ms']:>8.1f} {r['bwd_ms']:>8.1f} {pred:>8} {over:>8} {r['comm_ms']:>8.1f} "
            f"{r['opt_ms']:>7.1f} {r['compile_s']:>9.2f} {r.get('peak_mb', r['peak_step_mb']):>8.1f} {r['cpu_per_wall']:>8.2f} "
            f"{r['rq_wait_ms']:>6.1f} {r.get('machine_cpu_ms', float('nan')):>7.0f} {ratio:>10} {optim:>7}  {r['note']}"
        )
    lines += _memory_lines(s)
    b = s["bounds"]
    if "max_compute_comm_ms" in b:  # needs compute_only and comm_only among the modes run
        lines.append("-" * len(head))
        lines.append(f"{'max(compute,comm)':<21} {b['max_compute_comm_ms']:>9.1f} {'':>95} {s['ratios']['max_compute_comm_bound']:>10.3f}  bound")
        lines.append(f"{'release-time':<21} {b['release_time_ms']:>9.1f} {'':>95} {s['ratios']['release_time_bound']:>10.3f}  "
                     f"bound (link tail after backward {b['tail_after_backward_ms']:.1f} ms; ready times from eager hooks)")
        if "link_model" in b:  # bench.json files written before the fit have none
            lm = b["link_model"]
            lines.append(f"{'':<21} release-time link: graphddp.plan.cost.simulate, CostModel fitted to comm_only's buckets: "
                         f"{lm['bandwidth_gbps']:.3g} Gbit/s, {lm['latency_us']:.0f} us per ring step")
        if "release_time_graphddp_issue_ms" in b:
            v = b["release_time_graphddp_issue_ms"]
            lines.append(f"{'release-time*':<21} {v:>9.1f} {'':>95} {s['modes']['graphddp']['step_ms'] / v:>10.3f}  "
                         "bound, ready times = graphddp's own issue times (profiled step)")
    if s["exposed_comm_ms"] is not None:
        lines.append(f"exposed communication (graphddp - compute_only): {s['exposed_comm_ms']:.1f} ms")
    k = s["modes"].get("comm_only")
    if k and k.get("machine_cpu_ms") is not None:
        lines.append(f"CPU cost of communication: while comm_only runs, the machine's cores are busy "
                     f"{k['machine_cpu_ms']:.0f} ms per step ({100 * k['machine_cpu_ms'] / (2 * k['step_ms']):.0f}% of "
                     f"2 cores x {k['step_ms']:.0f} ms; /proc/stat, kernel included): work that competes with compute when overlapped")
    if s.get("predicted"):
        lines.append(s["predicted"]["note"])
        lines += _prediction_lines(s)
    lines.append("cpu ms: busy CPU time of the whole machine per step (both ranks, all threads, kernel; /proc/stat "
                 "mean), out of 2 cores x step ms")
    lines.append("cpu/wall: main-thread CPU time / wall time; rq ms: time the main thread was runnable "
                 "but had no core (median per step, worst rank): > 0 means the 2 cores were oversubscribed")
    lines.append("peak MB: torch CPU-allocator peak during one step above its start (torch.profiler "
                 "profile_memory), plus the gradients alive at its start (kept between steps; none for "
                 "graphddp_optim) and, for DDP, its reducer's bucket buffers, which live as long as the model; "
                 "max over ranks; parameters and optimizer state left out")
    ov = s.get("graphddp_overlap")
    if ov:
        lines.append(f"graphddp all-reduces issued at {', '.join('%.0f%%' % (100 * f) for f in ov['issue_fraction'])} of its "
                     f"backward; waits {', '.join('%.1f' % w for w in ov['wait_ms'])} ms (profiled step)")
    lines.append("targets:")
    for t in s["targets"]:
        if t.get("kind") == "memory":
            lines.append(_memory_target_line(t))
            continue
        extra = ""
        if t["target"].startswith("graphddp_optim"):  # no bound models an update inside the backward
            extra = f"  needs a step <= {t['needs_ms']:.0f} ms"
        elif t["target"].startswith("graphddp_auto"):  # the bounds are of graphddp's buckets, not auto's
            extra = f"  needs a step <= {t['needs_ms']:.0f} ms"
            if t.get("best_of"):
                extra += f"; best swept: {t['best_of']}"
                extra += f" (not run: {', '.join(t['not_run'])})" if t.get("not_run") else " (of the whole sweep)"
        elif t.get("release_bound_ms") and not t["target"].endswith("bound"):
            extra = (f"  needs a step <= {t['needs_ms']:.0f} ms; release-time bound {t['release_bound_ms']:.0f} ms"
                     + (" (target below the bound)" if t["below_release_bound"] else ""))
            if t.get("ideal_overlap_ms"):
                extra += (f"; ideal_overlap {t['ideal_overlap_ms']:.0f} ms"
                          + (" (target below this measured floor)" if t["below_measured_floor"] else ""))
        lines.append(f"  {t['target']:<40} {t['ratio']:.3f}  (<= {t['limit']:.2f})  {'met' if t['met'] else 'MISSED'}{extra}")
    lines += _powersgd_lines(s)
    for name in ("ddp_compiled", "ddp_compiled_samecap"):
        dc = s.get(name)
        if dc:
            lines.append(f"{name}: DDPOptimizer split the model into {dc['graphs']} graphs (model alone: "
                         f"{dc['graphs_without_ddp']}), checked")
    ca = s.get("ddp_compiled_autograd")
    if ca and "grad_error_vs_averaged_eager" in ca:
        e = ca["grad_error_vs_averaged_eager"]
        lines.append(f"ddp_compiled_autograd: gradients = the ranks' average of eager gradients (relative max error "
                     f"{e['averaged']:.1e}; vs summed {e['summed']:.2f}, vs local {e['local']:.2f}), checked")
    check = (s.get("graphddp_optim") or {}).get("step_vs_torch")
    if check:
        lines.append(f"graphddp_optim: one step against torch.optim's on a copy (same state, the ranks' average of eager "
                     f"gradients): parameters differ by {check['relative']:.1e} of the step's move (L2); "
                     f"every p.grad None after it: {check['grads_none']}")
    sb = s.get("ddp_same_buckets")
    if sb and "ddp_bucket_mb" in sb:
        lines.append(f"ddp_same_buckets via {sb['method']}: DDP buckets {['%.2f' % x for x in sb['ddp_bucket_mb']]} MB, "
                     f"same sizes as graphddp: {sb['same_sizes']}, same parameters: {sb['same_params']}")
    for w in s.get("warnings", []):
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


def _prediction_lines(s: dict[str, Any]) -> list[str]:
    """Issue 12: the auto plan's buckets, and whether each modelled DDP layout is DDP's own."""
    lines = []
    auto = s.get("graphddp_auto")
    if auto:
        mb = auto.get("bucket_mb", [])
        src = (auto.get("cost_model") or {}).get("source")
        lines.append(f"graphddp_auto: {len(mb)} buckets ({', '.join('%.2f' % b for b in mb)} MB), planned under "
                     f"{src or 'its cost model'}; the same cost model as the calibration above: "
                     f"{auto.get('same_cost_model_as_calibrated')}")
    cc = s["predicted"].get("compute_check")
    if cc:
        lines.append(f"the model's backward compute (graphddp's schedule, no communication): "
                     f"{cc['graphddp_pred_compute_ms']:.1f} ms; compute_only's measured bwd: {cc['compute_only_bwd_ms']:.1f} ms")
    checks = []
    for name, p in s["predicted"].get("modes", {}).items():
        if "same_buckets_as_ddp" in p:
            checks.append(f"{name} {'=' if p['same_buckets_as_ddp'] else '!='} DDP's buckets")
        for twin, same in p.get("same_layout_as", {}).items():
            checks.append(f"{name} {'=' if same else '!='} {twin}'s")
    if checks:
        lines.append("modelled DDP layouts (planner at DDP's caps) against the buckets that ran: " + "; ".join(checks))
    return lines


def _powersgd_lines(s: dict[str, Any]) -> list[str]:
    """Issue 13's rows: step time and bytes on the wire per rank per step, with and without PowerSGD."""
    ps = s.get("powersgd")
    if not ps or not ps.get("rows"):
        return []
    st = ps["settings"]
    lines = [f"PowerSGD (issue 13): rank {st['matrix_approximation_rank']}, start_powerSGD_iter {st['start_powerSGD_iter']}, "
             f"error feedback {st['use_error_feedback']}, warm start {st['warm_start']}; every timed step compressed "
             "(checked: each mode stepped past the start and its first compressed step before the rounds)",
             f"  {'mode':<21} {'step ms':>9} {'wire MB':>9} {'uncompr. MB':>11} {'wire/unc.':>9} {'buckets':>7}  step vs uncompressed"]
    for name, r in ps["rows"].items():
        frac = f"{r['wire_fraction']:.4f}" if r.get("wire_fraction") is not None else ""
        vs = f"{r['step_vs_uncompressed']:.3f} of {r['vs']}" if "vs" in r else ""
        lines.append(f"  {name:<21} {r['step_ms']:>9.1f} {r['wire_mb']:>9.3f} {r['uncompressed_wire_mb']:>11.3f} "
                     f"{frac:>9} {r.get('buckets') if r.get('buckets') is not None else '':>7}  {vs}")
    for key in ("graphddp_powersgd / ddp_powersgd", "graphddp_powersgd / ddp_powersgd_serial"):
        if key in ps:
            lines.append(f"  {key:<40} {ps[key]:.3f}")
    firsts = [f"{n} {m['first_compressed_step_s']:.2f}" for n, m in ps.get("modes", {}).items()
              if m.get("first_compressed_step_s") is not None]
    if firsts:
        lines.append(f"  first compressed step, s (graphddp compiles its PowerSGD variant then; not in 'compile s'): "
                     f"{', '.join(firsts)}")
    lines.append("  wire MB: what each rank puts into its all-reduces per step (graphddp: Bucket.wire_nbytes read from "
                 "the rewritten graph; DDP: its hook's rule over its buckets, checked against PowerSGDState's counters)")
    if "ddp_powersgd" in ps["rows"]:
        lines.append("  ddp_powersgd: DDP's powerSGD_hook as it is, on one bucket (with gloo it deadlocks with more than "
                     "one bucket in flight), so none of its communication overlaps the backward")
    if "ddp_powersgd_serial" in ps["rows"]:
        lines.append("  ddp_powersgd_serial: DDP's default caps, the hook waits for each bucket before returning "
                     "(DDP's math, no deadlock, no overlap)")
    return lines


def _memory_lines(s: dict[str, Any]) -> list[str]:
    """--modes sharded: what each AdamW mode keeps on a rank, next to its step's peak."""
    names = [n for n in ("graphddp_full", "graphddp_full_keep", "graphddp_full_bf16", "graphddp_sharded", "graphddp_sharded_fwd",
                         "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "graphddp_optim", "ddp_zero", "fsdp2_reshard", "fsdp2_reshard_bf16", "fsdp2", "fsdp2_clip",
                         "ddp_cap1") if n in s["modes"]]
    if not {"graphddp_sharded", "graphddp_sharded_fwd", "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "graphddp_full", "graphddp_full_keep", "graphddp_full_bf16"} & set(names):
        return []
    out = [f"memory per rank, MB (max over ranks): {'step ms':>9} {'opt state':>9} {'params':>8} {'step peak':>9} {'resident':>9}"
           "   (resident = params + opt state + step peak)"]
    for name in names:
        r = s["modes"][name]
        peak = r.get("peak_mb", r["peak_step_mb"])
        out.append(f"  {name:<35} {r['step_ms']:>9.1f} {r.get('state_mb', 0.0):>9.1f} {r.get('param_mb', 0.0):>8.1f} "
                   f"{peak:>9.1f} {r.get('param_mb', 0.0) + r.get('state_mb', 0.0) + peak:>9.1f}")
    ddp = s["modes"].get("ddp_cap1")

    def resident(r: dict[str, Any]) -> float:
        return r.get("param_mb", 0.0) + r.get("state_mb", 0.0) + r.get("peak_mb", r["peak_step_mb"])

    world = 2
    for mode, other, limit in (("graphddp_full", "fsdp2_reshard", 0.70), ("graphddp_full", "graphddp_sharded", 1.10),
                               ("graphddp_full_keep", "fsdp2", 0.70), ("graphddp_full_bf16", "fsdp2_reshard_bf16", 0.70)):
        if mode in names and other in names:  # issue 35's step targets
            ratio = s["modes"][mode]["step_ms"] / s["modes"][other]["step_ms"]
            out.append(f"  target: {mode} / {other} step {ratio:.3f} (<= {limit:.2f}): {'met' if ratio <= limit else 'MISSED'}")
    for mode in (n for n in ("graphddp_sharded", "graphddp_sharded_fwd") if n in names and ddp):
        # the target: no gradients kept, and (1 - 1/N) of the state gone
        sharded = s["modes"][mode]
        allowed = resident(ddp) - s["graphddp_grad_mb"] - (1 - 1 / world) * ddp.get("state_mb", 0.0)
        ok = "met" if resident(sharded) <= allowed else "MISSED"
        out.append(f"  target: {mode} resident {resident(sharded):.1f} <= ddp_cap1 resident {resident(ddp):.1f} - "
                   f"gradients {s['graphddp_grad_mb']:.1f} - (1 - 1/{world}) x its state {ddp.get('state_mb', 0.0):.1f} "
                   f"= {allowed:.1f} MB: {ok}; optimizer state {sharded.get('state_mb', 0.0):.1f} vs DDP's "
                   f"{ddp.get('state_mb', 0.0):.1f} MB ({sharded.get('state_mb', 0.0) / max(ddp.get('state_mb', 0.0), 1e-9):.3f})")
    return out


def _memory_target_line(t: dict[str, Any]) -> str:
    return (f"  {t['target']:<40} {t['ratio']:.3f}  (<= {t['limit']:.2f})  {'met' if t['met'] else 'MISSED'}  "
            f"graphddp_optim peak {t['graphddp_optim_peak_mb']:.1f} MB; needs <= {t['needs_mb']:.1f} MB = "
            f"{t['ddp_mode']} peak {t['ddp_peak_mb']:.1f} MB - {t['grad_mb']:.1f} MB of gradients")


def plot(s: dict[str, Any], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    names = [n for n in REPORTED if n in s["modes"]]
    fig, ax = plt.subplots(figsize=(13, 5.5))
    bottoms = [0.0] * len(names)
    colors = {"fwd": "#4c72b0", "bwd": "#55a868", "comm": "#c44e52", "opt": "#8172b2"}
    for phase in ("fwd", "bwd", "comm", "opt"):
        vals = [s["modes"][n][f"{phase}_ms"] for n in names]
        ax.bar(names, vals, bottom=bottoms, color=colors[phase], label=phase)
        bottoms = [a + v for a, v in zip(bottoms, vals)]
    for i, n in enumerate(names):
        ax.text(i, s["modes"][n]["step_ms"], f"{s['modes'][n]['step_ms']:.0f}", ha="center", va="bottom", fontsize=8)
        ax.plot([i - 0.4, i + 0.4], [s["modes"][n]["step_ms"]] * 2, color="black", lw=1)
    b = s["bounds"]
    if "max_compute_comm_ms" in b:
        ax.axhline(b["max_compute_comm_ms"], ls=":", color="gray", label="max(compute, comm) bound")
        ax.axhline(b["release_time_ms"], ls="--", color="black", label="release-time bound")
        if "release_time_graphddp_issue_ms" in b:
            ax.axhline(b["release_time_graphddp_issue_ms"], ls="-.", color="gray", lw=0.8,
                       label="release-time bound (graphddp's issue times)")
    ax.set_ylabel("median step time (ms); bars: phase medians")
    g = s["modes"].get("graphddp", {}).get("step_ms")
    net = s["network"]
    short = (f"emulated {net['rate_gbit']:g} Gbit/s link (tbf, private netns loopback)" if net.get("emulated")
             else "plain loopback, no link emulation")
    ax.set_title(f"graphddp benchmark, {s['config']['model'] if not s['config']['tiny'] else 'tiny mlp'}, 2 ranks x 1 "
                 f"thread, {s['config']['backend']}: {short}; white: graphddp / mode", fontsize=9)
    if g:
        for i, n in enumerate(names):
            if n != "graphddp":
                ax.text(i, 2, f"{g / s['modes'][n]['step_ms']:.2f}x", ha="center", va="bottom", fontsize=7, color="white")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
