"""``optimizer.step()`` while attached, and the step an enabled ``torch.amp.GradScaler`` takes.

While attached, ``step`` and ``zero_grad`` are no-ops, so loops written for DDP need not change;
but ``GradScaler.step``'s call, for a step whose loss it scaled, must run the update the backward
left to it.

Background
    fp16 training scales the loss so that small gradients do not flush to zero; ``unscale_`` divides
    every ``p.grad`` back and records any inf or NaN, ``step`` calls ``optimizer.step()`` only when
    none was found. An update inside the backward would run before that, on scaled gradients.

Algorithm
    * ``scaler.scale(loss)`` on an attached model's output (found by :mod:`graphddp.optim.guards`)
      marks the step scaled (:meth:`LossScaled.loss_scaled`): every backward graph then runs its
      variant without the update (fallback ``"scaler"``), leaving the averaged gradients (or parts)
      in ``p.grad``.
    * ``unscale_`` and ``step`` are torch's own on them. Whole averaged gradients show an inf on
      every rank; ``sharding="full"``'s parts need the flag agreed (``guards.agree_found_inf``).
    * During ``scaler.step``, ``optimizer.step()`` runs the attached optimizer's step
      (:func:`attached_step`): ``max_grad_norm``'s clip on the unscaled gradients, then torch's step.
      ``sharding="full"`` keeps torch's ``opt.step()``, with its clip as a step pre-hook.
    * Until ``scaler.step`` the gradients are the user's, as with DDP (``clip_grad_norm_`` after
      ``unscale_`` is allowed); after it, stepped or skipped, none is kept.

    The price: a scaled step's update is not overlapped with the backward, and with
    ``sharding="optimizer"`` its gradients are all-reduced whole instead of reduce-scattered.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

# id(optimizer) -> its attached step, while GradScaler.step runs: what optimizer.step() then does.
_STEPPING: dict[int, Callable[[], None]] = {}


def attached_step(self: torch.optim.Optimizer, closure: Any = None) -> None:
    """A no-op, but for ``GradScaler.step``'s call, which runs the step the scaled backward left."""
    run = _STEPPING.get(id(self))
    if run is not None:
        run()
        return
    if closure is not None:
        raise RuntimeError(
            "graphddp: optimizer.step(closure) is not supported while the optimizer is attached "
            "(graphddp.compile(..., optimizer=)): the backward already updates the parameters"
        )


def attached_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:  # noqa: ARG001 - its signature
    """A no-op: gradients are None after a synchronising backward, and ``no_sync`` accumulation must
    survive until it."""


class LossScaled:
    """The scaler's side of an attached optimizer: whether this step's gradients are scaled.
    ``owns_step``: ``optimizer.step()`` is the attached no-op, not torch's (``sharding="full"``)."""

    optimizer: Any
    params: dict[str, Any]
    scaled = False
    owns_step = False
    after_scaler_step: tuple[Callable[[], None], ...] = ()

    def finish(self) -> None:  # pragma: no cover - AttachedOptimizer's
        raise NotImplementedError

    def _scaled_step(self) -> None:
        self.scaled = False
        self.finish()

    def loss_scaled(self) -> None:
        self.scaled = True

    @contextlib.contextmanager
    def stepping_for_scaler(self) -> Iterator[None]:
        if not self.owns_step:
            yield
            return
        _STEPPING[id(self.optimizer)] = self._scaled_step
        try:
            yield
        finally:
            _STEPPING.pop(id(self.optimizer), None)

    def scaler_stepped(self) -> None:
        self.scaled = False
        if self.owns_step:
            for p in self.params.values():
                p.grad = None
        for done in self.after_scaler_step:
            done()
