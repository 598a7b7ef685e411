"""Where a mode's step goes on the GPU: a profiler trace of a few steady steps, read per step.

Full sharding took 30.8 ms a step on an H100 at world size 1 against 16.9 for
``sharding="optimizer"`` (docs/gpu.md), and the host's Python work was ruled out on CPU; what
the GPU spends the difference on needs a trace. ``python -m tools.bench --device cuda
--profile-steps N`` traces N steps of every mode after its timed rounds and reports, per step:
the GPU's busy and idle time (the span from the first kernel to the last, less the union of
kernel intervals), the kernels launched, and the kernels that took the most time, by name. CUDA
activity only: recording every CPU op slows the host enough to starve the GPU by itself.

With ``--simulate-on-cpu`` the same reading runs over CPU ops (a check of the reading, not a
figure). ``tests/gpu/test_gpu_host_gaps.py`` reads its traces with :func:`busy_idle_ms`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of GPU work
TOP = 12  # kernels listed per mode


def _spans(trace_path: str, kinds: tuple[str, ...]) -> list[tuple[float, float, str]]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "?")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in kinds)


def busy_idle_ms(trace_path: str, steps: int, kinds: tuple[str, ...] = DEVICE_KINDS) -> dict[str, float]:
    """From a chrome trace: the device's busy time, idle time and span per step, over ``steps``
    traced steps (busy: the union of the work's intervals; idle: the span less busy)."""
    return _busy_idle(_spans(trace_path, kinds), steps)


def _busy_idle(spans: list[tuple[float, float, str]], steps: int) -> dict[str, float]:
    if not spans:
        return {"idle_ms": 0.0, "busy_ms": 0.0, "span_ms": 0.0}
    busy, end = 0.0, None
    for s, e, _ in spans:
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = spans[-1][1] - spans[0][0]
    return {"idle_ms": (span - busy) / 1000 / steps, "busy_ms": busy / 1000 / steps, "span_ms": span / 1000 / steps}


def top_kernels(trace_path: str, steps: int, kinds: tuple[str, ...] = DEVICE_KINDS, top: int = TOP) -> dict[str, Any]:
    """Kernels launched per step, and the ``top`` names by time: [name, launches per step, ms per step]."""
    return _top_kernels(_spans(trace_path, kinds), steps, top)


def _top_kernels(spans: list[tuple[float, float, str]], steps: int, top: int = TOP) -> dict[str, Any]:
    by_name: dict[str, list[float]] = {}
    for s, e, name in spans:
        row = by_name.setdefault(name[:90], [0.0, 0.0])
        row[0] += 1
        row[1] += e - s
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"launches_per_step": len(spans) / steps,
            "top": [[name, n / steps, us / 1000 / steps] for name, (n, us) in rows]}


def profile_steps(step: Callable[[], None], steps: int, out: str, name: str, cuda: bool) -> dict[str, Any]:
    """Trace ``steps`` calls of ``step`` (warm already) and read them; the trace is kept in ``out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    path = os.path.join(out, f"profile-{name}.json")
    prof.export_chrome_trace(path)
    spans = _spans(path, DEVICE_KINDS if cuda else ("cpu_op",))  # read once: a trace is megabytes of JSON
    return {**_busy_idle(spans, steps), **_top_kernels(spans, steps), "trace": os.path.basename(path)}


def render(mode: str, figures: dict[str, Any]) -> str:
    """One mode's profile as text."""
    lines = [f"{mode}: per step {figures['busy_ms']:.2f} ms busy, {figures['idle_ms']:.2f} ms idle, "
             f"{figures['launches_per_step']:.0f} launches ({figures['trace']})",
             "| kernel | launches a step | ms a step |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {n:.0f} | {ms:.3f} |" for name, n, ms in figures["top"]]
    return "\n".join(lines)
