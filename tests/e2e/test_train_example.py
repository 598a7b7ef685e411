"""examples/train_gpt2.py end to end: 2 CPU ranks under torchrun, a tiny Hugging Face GPT-2.

One run trains 8 steps with gradient accumulation (``no_sync``), checkpoints every 4 and then
trains the same steps with DDP (``--compare-ddp``); a second run resumes from the step-4
checkpoint and must reproduce the first run's steps 5 to 8. Each launch takes about 25 s on
two cores (torchrun, imports, aot_eager compiles).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"
TINY = ["--backend", "aot_eager", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--grad-accum", "2", "--warmup", "2", "--log-every", "2"]


def _train(tmp: Path, *args: str) -> tuple[str, dict]:
    """Launch the example on 2 ranks in ``tmp``; returns its stdout and its JSON summary."""
    summary = tmp / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *TINY, "--checkpoint-dir", str(tmp / "ckpt"), "--summary", str(summary), "--plot", str(tmp / "loss.png"),
           *args]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout, json.loads(summary.read_text())


def test_train_checkpoint_resume_and_compare_with_ddp(tmp_path: Path) -> None:
    out, first = _train(tmp_path, "--steps", "8", "--checkpoint-every", "4", "--compare-ddp")
    steps, losses = zip(*first["graphddp"]["loss"])
    assert steps == tuple(range(1, 9))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert first["backward_graphs"] >= 1 and first["graphddp"]["tokens_per_s"] > 0
    assert "the all-reduce plan" in out and "issue after" in out and "transformer." in out  # the schedule table

    # DDP, same data from the same initial state, gives the same losses.
    assert [s for s, _ in first["ddp"]["loss"]] == list(steps)
    for (s, ours), (_, theirs) in zip(first["graphddp"]["loss"], first["ddp"]["loss"]):
        assert ours == pytest.approx(theirs, rel=1e-4), f"step {s}"
    assert first["max_rel_diff"] < 1e-4
    assert "largest |graphddp - DDP|" in out
    assert (tmp_path / "loss.png").stat().st_size > 0

    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000004.pt", "step_000008.pt"]

    # --resume takes the newest checkpoint: with step 8 gone, step 4, and continues the curve.
    (ckpt / "step_000008.pt").unlink()
    _, resumed = _train(tmp_path, "--steps", "8", "--checkpoint-every", "4", "--resume")
    assert resumed["start_step"] == 4
    assert [s for s, _ in resumed["graphddp"]["loss"]] == list(steps)
    assert resumed["graphddp"]["loss"][:4] == first["graphddp"]["loss"][:4]  # carried in the checkpoint
    for (s, again), (_, before) in zip(resumed["graphddp"]["loss"][4:], first["graphddp"]["loss"][4:]):
        assert again == pytest.approx(before, rel=1e-5), f"step {s} after resuming"
    assert (ckpt / "step_000008.pt").exists()
