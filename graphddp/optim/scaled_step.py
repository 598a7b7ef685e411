"""``optimizer.step()`` while attached, and the step an enabled ``torch.amp.GradScaler`` takes.

While graphddp updates the parameters inside the backward, the attached optimizer's ``step`` and
``zero_grad`` are no-ops (:meth:`graphddp.optim.attached.AttachedOptimizer.attach`), so that
loops written for DDP need not change. One call is not: ``GradScaler.step``'s, for a step whose
loss the scaler scaled, which must run the update the backward left to it.

Background
    fp16 training (V100, T4: no bfloat16) scales the loss so that small gradients do not flush
    to zero, and ``GradScaler`` undoes it after the backward: ``unscale_`` divides every
    ``p.grad`` by the scale and records whether one holds an inf or NaN, ``step`` calls
    ``optimizer.step()`` only when none does, ``update`` moves the scale. An update inside the
    backward would run before any of that, on scaled gradients.

Algorithm
    * ``scaler.scale(loss)`` on an output of a model whose optimizer is attached (the guard in
      :mod:`graphddp.optim.guards` finds the tag the compiler set on its forward's autograd node)
      calls :meth:`LossScaled.loss_scaled`: the coming backward is scaled. Every backward graph
      then runs its variant without the update (``InGraphUpdate.allowed`` says no, recorded as
      the fallback ``"scaler"``; ``sharding="full"``: the reason ``"scaler"``), which averages
      every gradient (or reduce-scatters each part) into ``p.grad``, and the end of the backward
      leaves them there instead of stepping (:meth:`AttachedOptimizer.finish`).
    * The user's ``scaler.unscale_(opt)`` and ``scaler.step(opt)`` are torch's own, on those
      gradients. The replicated and ``sharding="optimizer"`` modes hold whole, averaged
      gradients: an inf on one rank is an inf (or NaN) in the average on every rank, so every
      rank finds it. ``sharding="full"`` holds parts: the guard agrees on the flag (one
      all-reduce of its maximum, :func:`graphddp.optim.guards.agree_found_inf`).
    * torch's ``step`` calls ``optimizer.step()`` when no inf was found. While attached that is
      a no-op, so during ``scaler.step`` it runs the attached optimizer's own step instead
      (:func:`attached_step`): ``max_grad_norm``'s clip, on the unscaled gradients, then
      torch's step (each rank's part and an all-gather with ``sharding="optimizer"``).
      ``sharding="full"`` keeps torch's ``opt.step()``, with its clip as a step pre-hook.
    * Between the backward and ``scaler.step`` the gradients are the user's, as with DDP:
      ``clip_grad_norm_`` after ``unscale_`` is not refused (but on ``sharding="full"``'s parts).
    * After ``scaler.step``, stepped or skipped, the step is over: no gradient is kept (the
      attached ``zero_grad`` is a no-op; ``sharding="full"``: torch's, the user's to call), the
      next backward updates inside again unless its loss is scaled too. The scale, its growth
      tracker and ``state_dict()`` are the scaler's own; FSDP's ``ShardedGradScaler`` works alike.

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
    """``optimizer.step`` while attached: a no-op, but for ``GradScaler.step``'s call (torch makes
    it only when no rank found an inf), which runs the step the scaled backward left."""
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
    """``optimizer.zero_grad`` while attached: a no-op (gradients are already None after a
    synchronising backward, and ``no_sync`` accumulation must survive until it)."""


class LossScaled:
    """The scaler's side of :class:`graphddp.optim.attached.AttachedOptimizer`: whether this
    step's gradients are scaled, and what ``GradScaler.step`` does with them (module docstring).

    ``owns_step``: ``optimizer.step()`` is the attached no-op (replicated, ``sharding="optimizer"``),
    not torch's (``sharding="full"``, where the parts' gradients stay until the user's
    ``zero_grad``)."""

    optimizer: Any
    params: dict[str, Any]
    scaled = False
    owns_step = False
    after_scaler_step: tuple[Callable[[], None], ...] = ()

    def finish(self) -> None:  # pragma: no cover - AttachedOptimizer's
        raise NotImplementedError

    def _scaled_step(self) -> None:
        """What ``optimizer.step()`` does inside ``GradScaler.step``: the end-of-backward step
        the scaled backward skipped, on the gradients the scaler unscaled."""
        self.scaled = False
        self.finish()

    def loss_scaled(self) -> None:
        """An enabled GradScaler scaled a loss of this model: the coming backward leaves the
        gradients to it."""
        self.scaled = True

    @contextlib.contextmanager
    def stepping_for_scaler(self) -> Iterator[None]:
        """Within: ``optimizer.step()`` runs the attached step (:func:`attached_step`)."""
        if not self.owns_step:
            yield
            return
        _STEPPING[id(self.optimizer)] = self._scaled_step
        try:
            yield
        finally:
            _STEPPING.pop(id(self.optimizer), None)

    def scaler_stepped(self) -> None:
        """``GradScaler.step`` returned, stepped or skipped: the scaled step is over."""
        self.scaled = False
        if self.owns_step:
            for p in self.params.values():
                p.grad = None
        for done in self.after_scaler_step:
            done()
