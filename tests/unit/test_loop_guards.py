"""Loops written for DDP that clip ``p.grad`` or scale the loss with the optimizer attached
(:mod:`graphddp.optim.guards`): clipping is an error naming graphddp and what to do instead; an
enabled ``GradScaler`` steps the attached optimizer after the backward
(:mod:`graphddp.optim.scaled_step`), and is refused by name where it cannot; a disabled one
(nanoGPT's with bf16) and other models' clipping and scaling keep working."""
from __future__ import annotations

import warnings

import pytest
import torch
from test_clip import WORLD, _assert_same, _pair, _reference_step

import graphddp
from graphddp.models import MLP


def test_clipping_p_grad_of_attached_parameters_is_an_error_naming_max_grad_norm(fake_world) -> None:
    gd, opt, ref, _ = _pair(fake_world)
    gd(torch.randn(8, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"graphddp: torch.nn.utils.clip_grad_norm_ .* pass max_grad_norm=1.0 to graphddp.compile"):
        torch.nn.utils.clip_grad_norm_(gd.parameters(), 1.0)  # nanoGPT's call, looked up now
    from torch.nn.utils.clip_grad import clip_grad_norm_, clip_grad_value_

    with pytest.raises(RuntimeError, match="graphddp: torch.nn.utils.clip_grad_norm_"):
        clip_grad_norm_(list(gd.module.parameters())[:1], max_norm=1.0)
    with pytest.raises(RuntimeError, match="graphddp: torch.nn.utils.clip_grad_value_ .*clipping by value has no in-graph form"):
        clip_grad_value_(gd.parameters(), 0.1)
    ref(torch.randn(8, 16)).sum().backward()  # another model's gradients clip as ever, a generator too
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), expected)


def test_clipping_what_max_grad_norm_clips_already_says_so_and_by_which_norm(fake_world) -> None:
    """A loop that passed ``max_grad_norm=`` and kept its own clip call (torchvision's reference
    does both) is told the gradients are clipped already, by which norm, and to drop the call; a
    call asking another bound or norm is told the options that give it."""
    gd, *_ = _pair(fake_world, grad_norm_type=float("inf"))
    gd(torch.randn(8, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"so this would clip nothing\. They are clipped already: with max_grad_norm=0\.05 "
                                           r"given, graphddp clips the averaged gradients by their global Linf norm before "
                                           r"the update\. Drop this call$"):
        torch.nn.utils.clip_grad_norm_(gd.parameters(), 0.05, norm_type="inf")
    with pytest.raises(RuntimeError, match=r"clipped already: .* Linf norm .* Drop this call, and pass grad_norm_type=1 to "
                                           r"graphddp.compile for what it asks$"):
        torch.nn.utils.clip_grad_norm_(gd.parameters(), max_norm=0.05, norm_type=1)
    with pytest.raises(RuntimeError, match=r"Drop this call, and pass max_grad_norm=1\.0 to graphddp"):
        torch.nn.utils.clip_grad_norm_(gd.parameters(), 1.0, float("inf"))
    model = MLP(width=8, depth=2)
    ours = graphddp.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), backend="aot_eager")
    ours(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"Instead, pass max_grad_norm=1\.0, grad_norm_type=1 to graphddp\.compile .* "
                                           r"global L1 norm before the update$"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)


def test_an_enabled_grad_scaler_steps_the_attached_optimizer_after_the_backward(fake_world) -> None:
    """``scaler.scale(loss)`` on the attached model's loss: the backward leaves the (averaged)
    gradients in ``p.grad``, scaled, instead of updating; ``scaler.step`` unscales them, clips
    (``max_grad_norm``) and steps; then no gradient is kept and the next unscaled step updates
    inside the backward again."""
    gd, opt, ref, ref_opt = _pair(fake_world)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(8, 16)
    scaler.scale(gd(x).sum()).backward()
    assert all(p.grad is not None for p in gd.module.parameters()), "the gradients wait for the scaler"
    assert [tuple(r.fallbacks) for r in gd.records] == [("scaler",)]
    scaler.step(opt)
    scaler.update()
    assert all(p.grad is None for p in gd.module.parameters())
    _reference_step(ref, ref_opt, ref(x).sum(), 0.05, WORLD)
    _assert_same(gd, opt, ref, ref_opt, "a scaled step")
    ref_opt.zero_grad()
    gd(x).sum().backward()  # unscaled: inside the backward
    _reference_step(ref, ref_opt, ref(x).sum(), 0.05, WORLD)
    _assert_same(gd, opt, ref, ref_opt, "the unscaled step after it")
    assert all(p.grad is None for p in gd.module.parameters())


def test_an_enabled_grad_scaler_without_a_scaled_loss_or_with_a_fused_optimizer_is_refused(fake_world) -> None:
    gd, opt, ref, ref_opt = _pair(fake_world)
    scaler = torch.amp.GradScaler("cpu")
    gd(torch.randn(8, 16)).sum().backward()  # not scaled: updated inside the backward
    with pytest.raises(RuntimeError, match=r"GradScaler.unscale_\(optimizer\) .*scale\(loss\) was not seen"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.step\(optimizer\) .*scale\(loss\) was not seen"):
        scaler.step(opt)
    # An unrelated model's enabled scaler works while a graphddp forward is pending.
    pending = gd(torch.randn(8, 16)).sum()
    ref_loss = scaler.scale(ref(torch.randn(8, 16)).sum())
    ref_loss.backward()
    scaler.step(ref_opt)
    scaler.update()
    pending.backward()

    model = MLP(width=32, depth=4)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fused_gd = graphddp.compile(model, optimizer=fused, backend="aot_eager")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"GradScaler.scale\(loss\) .*AdamW\(fused=True\).*fused=False"):
        torch.amp.GradScaler("cpu").scale(fused_gd(torch.randn(8, 16)).sum())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "nothing was updated"


def test_a_disabled_grad_scaler_steps_as_without_it(fake_world) -> None:
    """nanoGPT's bf16 loop: ``GradScaler(enabled=False)``, scale/unscale_/step/update around the attached optimizer."""
    gd, opt, ref, ref_opt = _pair(fake_world)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(gd(x).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    _reference_step(ref, ref_opt, ref(x).sum(), 0.05, WORLD)
    _assert_same(gd, opt, ref, ref_opt, "through a disabled GradScaler")
