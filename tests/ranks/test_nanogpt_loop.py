"""nanoGPT's training loop (``examples/nanogpt_loop.py``) with graphddp in place of
DDP(torch.compile), loss for loss, on 2 gloo ranks (issue 37).

The loop keeps what a drop-in must survive: batches from torch's global generator, micro-steps
switched by ``require_backward_grad_sync``, ``GradScaler`` and ``clip_grad_norm_``, a cosine LR
written into ``param_groups``, two AdamW param groups, an evaluation on rank 0 only under
``no_grad``/``eval()``, a checkpoint and a resume. ``--compare`` trains DDP and graphddp in each
rank, one iteration each in turn, each on its own copy of the generator's state, so every loss
is compared with the one DDP had at the same iteration. The sharded modes run the same loop
(``--sharding``): its checkpoint through graphddp's whole-state calls, and with ``full`` every
rank evaluating.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
RTOL = 1e-5  # float32, aot_eager on both sides: the same kernels; what differs is the order of a few sums
CLIP = "0.05"  # --grad-clip where clipping is tested: it bites here (a run without clipping fails), nanoGPT's 1.0 does not


def _loop(rank: int, world: int, argv: list[str], out: str) -> None:
    sys.path.insert(0, EXAMPLES)
    import nanogpt_loop

    trainers = nanogpt_loop.run(nanogpt_loop.parse_args(argv))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({n: {"losses": t.losses, "eval": t.eval_losses, "iter": t.iter_num, "scale": t.scaler.get_scale(),
                           "fallbacks": [dict(r.fallbacks) for r in getattr(t.model, "records", [])]} for n, t in trainers.items()}, f)


def _run(tmp_path, name: str, *argv: str) -> dict:
    from graphddp.testing import spawn

    out = str(tmp_path / f"{name}.json")
    spawn(_loop, 2, ["--backend", "aot_eager", *argv], out)
    with open(out) as f:
        return json.load(f)


def _same(ours: list[float], theirs: list[float], what: str) -> None:
    assert len(ours) == len(theirs), (what, ours, theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= RTOL * abs(b), f"{what}, iteration {i}: graphddp {a!r}, DDP {b!r}\n{ours}\n{theirs}"


def test_the_float16_loop_trains_like_ddp_loss_for_loss(tmp_path):
    """Micro-steps by the attribute, clipping, LR schedule, evaluation on rank 0, with an enabled
    GradScaler (unscale_, clip, step, update) on CPU. float32: test_a_checkpoint_resumes_where_the_run_was."""
    got = _run(tmp_path, "float16", "--max-iters", "8", "--eval-interval", "4", "--dtype", "float16")
    _same(got["graphddp"]["losses"], got["ddp"]["losses"], "float16 training losses")
    _same(got["graphddp"]["eval"], got["ddp"]["eval"], "float16 evaluation losses")
    assert len(got["ddp"]["eval"]) == 1


def test_the_loop_with_the_optimizer_inside_trains_like_ddp(tmp_path):
    """``graphddp.compile(model, optimizer=..., max_grad_norm=grad_clip)``: AdamW (two param
    groups, the LR schedule) and clipping inside the backward of the step after the micro-steps,
    which carries their gradients into its buckets; the loop's ``scaler.step`` (a disabled
    scaler) and ``zero_grad`` are no-ops. Loss for loss against DDP + clip_grad_norm_ + step, at
    a clip that bites (nanoGPT's 1.0 never does on this small model: a run without clipping
    passed at 1.0)."""
    got = _run(tmp_path, "inside", "--max-iters", "8", "--eval-interval", "4", "--optimizer-inside", "--grad-clip", CLIP)
    _same(got["graphddp"]["losses"], got["ddp"]["losses"], "optimizer inside, training losses")
    _same(got["graphddp"]["eval"], got["ddp"]["eval"], "optimizer inside, evaluation losses")
    assert not any(got["graphddp"]["fallbacks"]), f"steps left to torch's step: {got['graphddp']['fallbacks']}"


def test_a_checkpoint_resumes_where_the_run_was(tmp_path):
    """The float32 loop (micro-steps by the attribute, clipping, LR schedule, evaluation on rank
    0) loss for loss against DDP, writing nanoGPT's checkpoint (raw model's and optimizer's state
    dicts) at its only save, iteration 4; resumed from it in fresh processes, the run continues
    loss for loss, DDP's too."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    whole = _run(tmp_path, "whole", "--max-iters", "8", "--eval-interval", "4", "--checkpoint-dir", str(ckpt))
    _same(whole["graphddp"]["losses"], whole["ddp"]["losses"], "float32 training losses")
    _same(whole["graphddp"]["eval"], whole["ddp"]["eval"], "float32 evaluation losses")
    assert len(whole["ddp"]["eval"]) == 1 and (ckpt / "ckpt-graphddp.pt").exists() and (ckpt / "ckpt-ddp.pt").exists()
    rest = _run(tmp_path, "rest", "--max-iters", "8", "--eval-interval", "4", "--checkpoint-dir", str(ckpt))
    for name in ("ddp", "graphddp"):
        assert rest[name]["iter"] == 8, (name, rest[name]["iter"])
        _same(rest[name]["losses"], whole[name]["losses"][4:], f"{name} resumed at iteration 4")


def test_the_loop_with_sharded_optimizer_state_trains_like_ddp(tmp_path):
    """``sharding="optimizer"``: each rank updates its part of every bucket inside the backward,
    clipped by the global norm (one all-reduce of the parts' squares) at a clip that bites; the
    evaluation stays on rank 0 (its forward needs no collective). With ``gather="forward"`` too,
    whose pending all-gathers rank 0's evaluation completes before its checkpoint (the
    ``state_dict()`` hook that would otherwise complete them is tested by
    test_sharded_forward.py): resumed at iteration 4 in fresh processes, the run goes on loss
    for loss."""
    sharded = ("--eval-interval", "4", "--sharding", "optimizer", "--grad-clip", CLIP)
    got = _run(tmp_path, "sharded", "--max-iters", "8", *sharded)
    _same(got["graphddp"]["losses"], got["ddp"]["losses"], "sharding='optimizer', training losses")
    _same(got["graphddp"]["eval"], got["ddp"]["eval"], "sharding='optimizer', evaluation losses")
    # graphddp alone from here (--wrapper graphddp): compared with the DDP losses above
    forward = (*sharded, "--gather", "forward", "--wrapper", "graphddp")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    whole = _run(tmp_path, "forward", "--max-iters", "8", *forward, "--checkpoint-dir", str(ckpt))  # saved at iteration 4
    _same(whole["graphddp"]["losses"], got["ddp"]["losses"], "gather='forward', training losses")
    _same(whole["graphddp"]["eval"], got["ddp"]["eval"], "gather='forward', evaluation losses")
    rest = _run(tmp_path, "rest", "--max-iters", "8", *forward, "--checkpoint-dir", str(ckpt))
    _same(rest["graphddp"]["losses"], whole["graphddp"]["losses"][4:], "gather='forward' resumed at iteration 4")


def test_the_loop_fully_sharded_trains_like_ddp_and_resumes(tmp_path):
    """``sharding="full"``: parameters, gradients and AdamW's state 1/N per rank, every rank
    evaluating (the others on a copy of their generator), the checkpoint gathered on every rank
    and saved by rank 0, resumed in fresh processes: loss for loss against DDP throughout."""
    full = ("--eval-interval", "4", "--sharding", "full")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    whole = _run(tmp_path, "whole", "--max-iters", "8", "--checkpoint-dir", str(ckpt), *full)  # saved at iteration 4
    _same(whole["graphddp"]["losses"], whole["ddp"]["losses"], "sharding='full', training losses")
    _same(whole["graphddp"]["eval"], whole["ddp"]["eval"], "sharding='full', evaluation losses")
    rest = _run(tmp_path, "rest", "--max-iters", "8", "--checkpoint-dir", str(ckpt), "--wrapper", "graphddp", *full)
    _same(rest["graphddp"]["losses"], whole["graphddp"]["losses"][4:], "sharding='full', resumed at iteration 4")


@pytest.mark.parametrize("sharding", ["none", "optimizer", "full"])
def test_the_float16_loop_with_the_optimizer_inside_steps_through_the_grad_scaler_like_ddp(tmp_path, sharding):
    """``--dtype float16``: an enabled GradScaler (``scaler.scale(loss).backward()`` per
    micro-step, ``scaler.step``, ``scaler.update``) with the optimizer inside, replicated or
    sharded, clipping by ``max_grad_norm`` at a clip that bites: every scaled step leaves its
    update to ``scaler.step``, which unscales, clips and steps (graphddp.optim.scaled_step); loss
    for loss against DDP + clip_grad_norm_ + the same scaler, and the same scale at the end. No
    step overflows here: skipped steps are test_grad_scaler_ranks.py's."""
    argv = ("--max-iters", "8", "--eval-interval", "4", "--dtype", "float16", "--grad-clip", CLIP)
    where = ("--optimizer-inside",) if sharding == "none" else ("--sharding", sharding)
    got = _run(tmp_path, f"fp16_{sharding}", *argv, *where)
    _same(got["graphddp"]["losses"], got["ddp"]["losses"], f"float16, sharding {sharding}, training losses")
    _same(got["graphddp"]["eval"], got["ddp"]["eval"], f"float16, sharding {sharding}, evaluation losses")
    assert got["graphddp"]["scale"] == got["ddp"]["scale"], "the scale moved as DDP's"
    if sharding != "full":
        assert all(set(f) == {"scaler"} for f in got["graphddp"]["fallbacks"] if f), got["graphddp"]["fallbacks"]
