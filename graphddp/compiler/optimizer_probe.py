"""What an optimizer holds and needs, read off probes of its class (never the user's optimizer
or parameters): its state per parameter, the temporaries of its own ``step()``, and those of
graphddp's update traced inside the backward.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphddp.graph.liveness import liveness
from graphddp.plan.memory import StateRule
from graphddp.runtime.calibrate import fastest_seconds


def _hyper(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The first param group's hyperparameters that the optimizer's class takes."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted}


def state_rules(optimizer: torch.optim.Optimizer | None, dtypes: set[torch.dtype]) -> tuple[StateRule, ...]:
    """Per dtype, the optimizer's state bytes of a parameter of n elements as ``per_element * n +
    fixed``: a probe of its class with its first group's hyperparameters, stepped once on a
    parameter of 4 and one of 8 elements, so that the state that grows with a parameter's size and
    the state that does not (Adam's ``step``) come apart (a zero gradient: only sizes matter)."""
    if optimizer is None:
        return ()
    hyper = _hyper(optimizer)
    rules = []
    for dtype in sorted(dtypes, key=str):
        if not dtype.is_floating_point:
            continue
        small, large = (torch.zeros(n, dtype=dtype, requires_grad=True) for n in (4, 8))
        probe = type(optimizer)([small, large], **hyper)
        for p in (small, large):
            p.grad = torch.zeros_like(p)
        probe.step()
        nbytes = [sum(v.untyped_storage().nbytes() for v in probe.state[p].values() if isinstance(v, torch.Tensor))
                  for p in (small, large)]
        per_element = (nbytes[1] - nbytes[0]) // 4
        rules.append(StateRule(str(dtype).removeprefix("torch."), per_element, nbytes[0] - 4 * per_element))
    return tuple(rules)


_PROBE = 4096  # elements of the probe parameter the optimizer's workspace is measured on


class _Allocations(TorchDispatchMode):
    """The most bytes of new tensors alive at once while active (a tensor's bytes end with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def step_workspace(optimizer: torch.optim.Optimizer | None) -> float:
    """The temporaries of the optimizer's own ``step()`` per byte of a parameter (its largest
    parameter's is what a step after the backward adds): a probe of its class stepped twice on one
    parameter, the second step watched."""
    if optimizer is None:
        return 0.0
    probe_param = torch.zeros(_PROBE, requires_grad=True)
    probe = type(optimizer)([probe_param], **_hyper(optimizer))
    probe_param.grad = torch.zeros_like(probe_param)
    probe.step()
    with _Allocations() as watched:
        probe.step()
    return watched.peak / (_PROBE * probe_param.element_size())


def _traced_update(optimizer: torch.optim.Optimizer | None, n: int, device: torch.device) -> tuple[Any, tuple] | None:
    """graphddp's update inside the backward for ``optimizer``'s first group and its arguments (a
    parameter of ``n`` elements on ``device``, its gradient, state and hyperparameters); None where
    the optimizer is not one graphddp updates inside."""
    from graphddp.optim.attached import SUPPORTED, UPDATES, _group_rule, fake_state, hyper_tensors

    if optimizer is None or type(optimizer).__name__ not in SUPPORTED:
        return None
    rule = _group_rule(optimizer, 0)
    param, grad = torch.zeros(n, device=device), torch.full((n,), 1e-3, device=device)
    state, hyper = fake_state(rule, param, lambda: torch.zeros(n, device=device)), hyper_tensors(optimizer.param_groups[0], rule)
    return (lambda p, g, st, h: UPDATES[rule.kind](rule, p, g, st, h)), (param, grad, state, hyper)


def update_workspace(optimizer: torch.optim.Optimizer | None) -> float:
    """The temporaries of graphddp's update inside the backward per byte of the parameter (or
    part) updated, as the traced update runs op by op (aot_eager; inductor fuses it into less)."""
    traced = _traced_update(optimizer, _PROBE, torch.device("cpu"))
    if traced is None:
        return 0.0
    update, args = traced
    return liveness(make_fx(update)(*args), ()).peak_outputs_freed / (_PROBE * args[0].element_size())


_TIMED = 1 << 20  # elements the update is timed on: enough to run at the memory's speed, not the cache's


def update_seconds_per_byte(optimizer: torch.optim.Optimizer | None, device: torch.device) -> float | None:
    """graphddp's update inside the backward, op by op as aot_eager runs it, timed on one parameter
    of ``_TIMED`` elements on ``device``: seconds per byte of parameter, the fastest of three after
    a warm-up; None where the optimizer is not one graphddp updates inside."""
    traced = _traced_update(optimizer, _TIMED, device)
    if traced is None:
        return None
    update, args = traced
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return fastest_seconds(lambda: update(*args), sync, 3) / (_TIMED * args[0].element_size())
