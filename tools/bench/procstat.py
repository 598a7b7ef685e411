"""What the kernel says about CPU use: this thread's runqueue delay, the machine's busy time.

Both the per-step probes (``modes``) and the pre-run load check (``cli``) read them here.
"""
from __future__ import annotations

import os
import time
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def runqueue_wait() -> float:
    """Seconds this thread has spent runnable but not running (waiting for a core)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU-seconds of all cores since boot (user, system, irq, softirq...).

    Machine-wide on purpose: the kernel's share of loopback TCP (softirq) is charged to no
    thread of ours, yet it takes cores from the compute. Ticks of 1/CLK_TCK s: summed over many
    steps it is accurate, one step alone is not. (0, 0) where /proc/stat cannot be read.
    """
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    guest = sum(vals[8:10]) if len(vals) > 9 else 0  # already counted in user / nice
    total = sum(vals) - guest
    return (total - idle) / _CLK_TCK, total / _CLK_TCK


def machine_load(seconds: float = 1.0) -> dict[str, Any]:
    """Load average and the busy fraction of all cores over ``seconds`` (other processes' use)."""
    b0, t0 = cpu_seconds()
    time.sleep(seconds)
    b1, t1 = cpu_seconds()
    try:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
    except OSError:
        return {}
    return {"busy_fraction": (b1 - b0) / max(1e-9, t1 - t0), "loadavg": [float(x) for x in load]}
