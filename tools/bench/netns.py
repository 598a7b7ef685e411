"""The emulated link: a private network namespace whose loopback is rate-limited by tbf.

Only the loopback of a namespace this process created is touched; ``setup_netns_link``
refuses to run where any other device is visible.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

NETNS_ENV = "GRAPHDDP_BENCH_IN_NETNS"
NETNS_SETUP_FAILED = 86  # exit code of the re-executed child when the namespace could not be set up


def _tc_args(rate_gbit: float) -> list[str]:
    rate_bytes = rate_gbit * 1e9 / 8
    burst = max(256 * 1024, int(rate_bytes * 0.001))  # >= 4 lo MTUs (64 KiB), ~1 ms of traffic
    return ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_gbit}gbit",
            "burst", str(burst), "latency", "200ms"]


def setup_netns_link(rate_gbit: float) -> dict[str, Any]:
    """Inside the fresh namespace: bring lo up and rate-limit it. Raises on failure."""
    links = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    devices = [line.split(":")[1].strip() for line in links.splitlines() if line.strip()]
    if devices != ["lo"]:
        raise RuntimeError(f"not a private network namespace (devices {devices}); refusing to touch them")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, text=True)
    args = _tc_args(rate_gbit)
    subprocess.run(args, check=True, capture_output=True, text=True)
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True, capture_output=True, text=True).stdout.strip()
    return {"tc": " ".join(args), "qdisc": shown}


def _tc_stats() -> str:
    try:
        return subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def reexec_in_netns(argv: list[str], module: str = "tools.bench", env_flag: str = NETNS_ENV) -> tuple[int | None, str]:
    """Run ``python -m module argv`` again in a new network namespace, with ``env_flag`` set;
    (exit code, reason) or (None, reason)."""
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if missing:
        hint = "apt-get install -y iproute2 util-linux" if os.geteuid() == 0 else "ask for iproute2 / util-linux"
        return None, f"missing {', '.join(missing)} ({hint})"
    cmd = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]
    probe = subprocess.run(cmd + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"'{' '.join(cmd)}' failed: {probe.stderr.strip() or probe.returncode}"
    # The child runs -m <module> as well: the repository root goes on its path, whatever the cwd.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, **{env_flag: "1", "PYTHONPATH": path})
    rc = subprocess.call(cmd + [sys.executable, "-m", module, *argv], env=env)
    if rc == NETNS_SETUP_FAILED:
        return None, "could not rate-limit the namespace's loopback (see message above)"
    return rc, ""


def enter_emulated_link(argv: list[str], module: str, env_flag: str, link_gbit: float) -> int | None:
    """For a probe run as ``python -m module``: outside a namespace, run it again inside one
    (:func:`reexec_in_netns`) and return its exit code; inside, rate-limit the loopback to
    ``link_gbit`` and return None, for the probe to go on. Failures say why, on stderr."""
    if os.environ.get(env_flag) != "1":
        rc, reason = reexec_in_netns(argv, module=module, env_flag=env_flag)
        if rc is None:
            print(f"no emulated link: {reason}", file=sys.stderr)
            return 1
        return rc
    try:
        setup_netns_link(link_gbit)
    except Exception as e:  # noqa: BLE001 - any failure to shape the link ends the probe
        print(f"could not rate-limit the loopback: {e}", file=sys.stderr)
        return NETNS_SETUP_FAILED
    return None
