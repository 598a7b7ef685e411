"""Every collective graphddp issues is waited: a user's script of every mode exits without c10d's
"unwaited collective calls" (the script: exit_without_unwaited.py, in a subprocess, since the
count is printed only when a process shuts down normally)."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_every_mode_exits_without_unwaited_collectives():
    from exit_without_unwaited import MODES

    run = subprocess.run(
        [sys.executable, os.path.join(HERE, "exit_without_unwaited.py")], cwd=ROOT, capture_output=True, text=True,
        timeout=900, env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    for name in MODES:  # every mode ran to its end on both ranks
        assert all(f"rank {r}: {name} done" in run.stdout for r in (0, 1)), run.stdout
    assert "unwaited collective" not in run.stderr, run.stderr[-4000:]
