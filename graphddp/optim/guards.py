"""Loops written for DDP that read ``p.grad`` must not silently do something else.

Background
    With ``optimizer=`` the parameters are updated inside the backward and ``p.grad`` stays None,
    so two things training loops do after it (nanoGPT's ``train.py`` does both) go wrong without a
    word: ``clip_grad_norm_``/``clip_grad_value_`` clip nothing, and an enabled ``GradScaler``'s
    step fails deep in torch after an update with scaled gradients. Clipping has an in-graph form
    (``max_grad_norm=``), so it is refused here, naming it; a scaled step is honoured, its update left
    to ``scaler.step`` (:mod:`graphddp.optim.scaled_step`).

Algorithm
    The first attach installs, once per process, thin wrappers around ``torch.nn.utils``' clip
    functions (both attributes nanoGPT may look up at call time) and ``GradScaler``'s ``scale``,
    ``unscale_`` and ``step``; each asks one question, else calls torch's function unchanged:

    * clipping: is a parameter passed held by a live attached optimizer whose step is not scaled?
    * an enabled scaler's ``scale(outputs)``: do the outputs' autograd graphs reach a forward the
      compiler tagged with its attached optimizer (:data:`ATTACHED_NODE`)? Then that step is
      marked scaled before ``backward()``, so no parameter is updated with scaled gradients.
    * an enabled scaler's ``unscale_``/``step`` on an attached optimizer not marked scaled: refused
      (the backward updated already); over parts ``unscale_`` agrees on the inf flag over the ranks.

    Wrappers, because the error must come where the user's code does the wrong thing: nothing
    graphddp runs sees a clip call or a scaled loss. With no attached optimizer alive each costs one
    empty-set check.
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

from graphddp.graph.capture import autograd_nodes

# Key of the autograd node metadata the compiler sets on every forward of a model whose
# optimizer is attached.
ATTACHED_NODE = "graphddp_attached_optimizer"

# torch's own, kept before wrapping: the fallback step clips with it.
clip_grad_norm_ = clip_grad.clip_grad_norm_

_ATTACHED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # live AttachedOptimizer objects
# Optimizers over parts of the gradients (sharding="full"), and the group whose ranks must agree on
# an enabled GradScaler's inf flag.
_AGREE: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_installed = False
# The attribute sharding="full" sets on the whole parameters model.parameters() gathers: copies
# for reading, with no gradient, so clipping them would clip nothing.
GATHERED_COPY = "_graphddp_gathered_copy"
# The attribute it sets on each rank's part: the norm of parts is this rank's share of the norm.
PART = "_graphddp_part"
_gathered_copies = False  # some were made in this process: the clip wrappers look for them


def watch_gathered_copies() -> None:
    global _gathered_copies
    _gathered_copies = True
    _install()


def watch(attached: Any) -> None:
    _ATTACHED.add(attached)
    _install()


def _owner_of(params: Iterable[Any]) -> Any:
    live = list(_ATTACHED)
    if not live:
        return None
    ids = {id(p) for p in params}
    return next((a for a in live if not ids.isdisjoint(a.param_ids)), None)


def _clipping_instead(clipping: Any, args: tuple, kwargs: dict) -> str:
    """What a refused ``clip_grad_norm_`` call should become, given graphddp's ``clipping``
    ((max_grad_norm, grad_norm_type) or None): the option to pass, or that it is done already."""
    max_norm = args[0] if args else kwargs.get("max_norm", "...")
    try:
        norm_type = float(args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0))
    except (TypeError, ValueError):  # torch would refuse it too; the message still names the options
        norm_type = 2.0
    ask = f"max_grad_norm={max_norm!r}" + (f", grad_norm_type={norm_type:g}" if norm_type != 2.0 else "")
    if clipping is None:
        return (f"Instead, pass {ask} to graphddp.compile (or graphddp.backend) and drop this call: graphddp then clips "
                f"the averaged gradients by their global L{norm_type:g} norm before the update")
    done = (f"They are clipped already: with max_grad_norm={clipping[0]!r} given, graphddp clips the averaged gradients "
            f"by their global L{clipping[1]:g} norm before the update. Drop this call")
    other = ([f"max_grad_norm={max_norm!r}"] if max_norm != "..." and float(max_norm) != clipping[0] else []) + (
        [f"grad_norm_type={norm_type:g}"] if norm_type != clipping[1] else [])
    return f"{done}, and pass {', '.join(other)} to graphddp.compile for what it asks" if other else done


def _clip_guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _ATTACHED or _gathered_copies:
            generator = isinstance(parameters, types.GeneratorType)
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            copy = next((getattr(p, GATHERED_COPY) for p in params if getattr(p, GATHERED_COPY, False)), None)
            if copy is not None:  # the marker: True, or (max_grad_norm, grad_norm_type) where those are given
                raise RuntimeError(
                    f"graphddp: torch.nn.utils.{name} was called on the whole parameters that model.parameters() gathers "
                    "with sharding='full': copies for reading, with no gradient, so this would clip nothing. "
                    + (_clipping_instead(copy if copy is not True else None, args, kwargs) if name == "clip_grad_norm_" else
                       "Clip the parts' gradients instead (model.module.parameters(), between backward() and opt.step(); "
                       "by value is elementwise, so parts clip as the whole would), which needs them kept: max_grad_norm= "
                       "or an optimizer other than SGD/Adam/AdamW, whose parts are not updated inside the backward")
                )
            part = next((getattr(p, PART) for p in params if getattr(p, PART, False)), None)  # as GATHERED_COPY's
            if name == "clip_grad_norm_" and part is not None:
                raise RuntimeError(
                    "graphddp: torch.nn.utils.clip_grad_norm_ was called on the parts sharding='full' holds "
                    "(model.module.parameters()): their norm is this rank's share of the whole gradient's, so each rank "
                    f"would clip by another number. {_clipping_instead(part if part is not True else None, args, kwargs)}"
                )
            owner = _owner_of(params)
            if owner is not None and not owner.scaled:  # scaled: the averaged gradients wait in p.grad for scaler.step
                clipping = None if owner.max_grad_norm is None else (owner.max_grad_norm, owner.grad_norm_type)
                instead = (
                    _clipping_instead(clipping, args, kwargs)
                    if name == "clip_grad_norm_" else
                    "Instead (clipping by value has no in-graph form): compile without optimizer= and clip p.grad between "
                    "backward() and optimizer.step(), or clip by norm with max_grad_norm="
                )
                raise RuntimeError(
                    f"graphddp: torch.nn.utils.{name} was called on parameters that graphddp.compile(..., optimizer=) "
                    f"updates inside the backward ({type(owner.optimizer).__name__}): they are updated already and "
                    f"p.grad is None, so this would clip nothing. {instead}"
                )
            parameters = (p for p in params) if generator else params
        return original(parameters, *args, **kwargs)

    return guarded


def _scaler_refusal(what: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"graphddp: torch.amp.GradScaler.{what} with an optimizer attached by graphddp.compile(..., optimizer=): {why}"
    )


def _attached_reached(outputs: Any) -> list[Any]:
    found: list[Any] = []
    for node in autograd_nodes(outputs):
        attached = node.metadata.get(ATTACHED_NODE)
        if attached is not None and all(a is not attached for a in found):
            found.append(attached)
    return found


def _refuse_fused(optimizer: Any, what: str) -> None:
    """A fused optimizer checks for inf in its own kernel, not reading the flag the ranks agreed
    on, so the skip could differ between ranks."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        raise _scaler_refusal(
            what,
            f"{type(optimizer).__name__}(fused=True) unscales and checks for inf inside its own kernel, where graphddp "
            "cannot make every rank skip the step together; build the optimizer with fused=False",
        )


def agree_found_inf(optimizer: Any, group: Any) -> None:
    """An enabled GradScaler's ``unscale_(optimizer)`` agrees on the inf flag over ``group`` from
    now on: over parts one rank may see an inf the others do not, and every rank must skip that
    step (FSDP's ``ShardedGradScaler`` does the same all-reduce)."""
    _AGREE[optimizer] = group
    _install()


def _agree(scaler: Any, optimizer: Any, group: Any) -> None:
    """The maximum over ``group`` of the inf flags, written back into each (or one new entry)."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    total = torch.zeros((), dtype=torch.float32, device=scaler._scale.device)
    for flag in found.values():
        total = torch.maximum(total, flag.to(total.device))
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    for flag in found.values():
        flag.copy_(total)
    if not found:
        found[total.device] = total


def _scaler_guards(cls: type) -> None:
    """Wraps the scaler methods ``cls`` defines itself (module docstring): a subclass overriding
    some (FSDP's ``ShardedGradScaler``) keeps the base class's wrapper for the rest. ``step`` runs
    the attached optimizer's real step from torch's ``optimizer.step()`` call."""
    scale, unscale_, step = cls.scale, cls.unscale_, cls.step

    @functools.wraps(scale)
    def guarded_scale(self: Any, outputs: Any) -> Any:
        if _ATTACHED and self._enabled:
            reached = _attached_reached(outputs)
            for attached in reached:
                _refuse_fused(attached.optimizer, "scale(loss)")
            for attached in reached:
                attached.loss_scaled()
        return scale(self, outputs)

    def scaled_owner(what: str, optimizer: Any) -> Any:
        attached = next((a for a in _ATTACHED if a.optimizer is optimizer), None)
        if attached is not None and not attached.scaled:
            raise _scaler_refusal(
                what,
                "this scaler's scale(loss) was not seen on a loss of that model since its last step, so its gradients "
                "are not scaled and graphddp already updated the parameters inside the backward. Scale the loss of this "
                "model with the same scaler (scaler.scale(loss).backward()) before unscale_/step, or train in bfloat16 "
                "(no loss scaling; a GradScaler with enabled=False keeps working)",
            )
        if optimizer in _AGREE:
            _refuse_fused(optimizer, what)
        return attached

    @functools.wraps(unscale_)
    def guarded_unscale_(self: Any, optimizer: Any) -> None:
        if not self._enabled or not (_ATTACHED or _AGREE):
            return unscale_(self, optimizer)
        scaled_owner("unscale_(optimizer)", optimizer)
        unscale_(self, optimizer)
        group = _AGREE.get(optimizer)
        if group is not None:
            _agree(self, optimizer, group)

    @functools.wraps(step)
    def guarded_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled or not (_ATTACHED or _AGREE):
            return step(self, optimizer, *args, **kwargs)
        attached = scaled_owner("step(optimizer)", optimizer)
        if attached is None:
            return step(self, optimizer, *args, **kwargs)
        try:
            with attached.stepping_for_scaler():
                return step(self, optimizer, *args, **kwargs)
        finally:
            attached.scaler_stepped()

    for name, guarded in (("scale", guarded_scale), ("unscale_", guarded_unscale_), ("step", guarded_step)):
        if name in vars(cls):
            setattr(cls, name, guarded)


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for module in (nn_utils, clip_grad):
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            if hasattr(module, name):
                setattr(module, name, _clip_guard(name, getattr(module, name)))
    _scaler_guards(torch.amp.GradScaler)
    try:  # FSDP users' scaler, which sharding="full" takes in its place
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:  # a build without torch.distributed.fsdp
        return
    _scaler_guards(ShardedGradScaler)
