"""The optimizer inside the backward graph: each bucket's parameters updated after its wait.

DDP keeps every gradient alive until ``optimizer.step()`` after the backward; graphddp compiles a
bucket's update right after its wait, so it runs while later buckets are on the wire and no gradient
outlives its bucket (``p.grad`` stays None). docs/optimizer.md has the whole story.

Background
    torch's optimizers are Python loops over ``param.grad``; for the classes supported here the
    math is a few pointwise ops per parameter, written once below as traceable functions with the
    formulas of ``torch.optim``'s single-tensor implementations, in the same order, hyperparameters
    in float64 as torch computes them in Python. Compiled code may fuse them, so results agree with
    ``torch.optim`` to float32 rounding, not bit for bit.

Algorithm
    * Hyperparameters are graph inputs read from ``param_groups`` every step (a scheduler needs no
      recompile); options that change the update's shape are compiled in (:class:`UpdateRule`),
      and changing one later raises, naming it.
    * State lives in ``optimizer.state[p]``, updated in place, so state dicts interchange with a
      plain optimizer of the same class.
    * A step the graph cannot update alone falls back to torch's ``step`` at the end of the backward
      for the parameters concerned (:meth:`AttachedOptimizer.finish`; the reasons:
      ``runtime.step.StepState.not_inside``). Either way each optimised parameter is stepped once per
      synchronising backward and left with ``grad`` None.
    * ``optimizer.step()``/``zero_grad()`` become no-ops while attached; step hooks do not run.

Not supported: other optimizer classes, ``differentiable=True``, complex parameters, clipping
``p.grad`` in the loop (refused, :mod:`graphddp.optim.guards`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from graphddp.graph.part_facts import UPDATE_PARAM
from graphddp.graph.trace import role
from graphddp.optim import guards
from graphddp.optim.scaled_step import LossScaled, attached_step, attached_zero_grad

SUPPORTED = ("SGD", "Adam", "AdamW")
F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """What one param group's update compiles to: the optimizer and its shape-changing flags;
    ``hyper`` and ``state`` name the graph inputs passed per group and per parameter."""

    optimizer: str  # "SGD" | "Adam" | "AdamW"
    flags: tuple[tuple[str, bool], ...]

    @property
    def kind(self) -> str:
        return "sgd" if self.optimizer == "SGD" else "adam"

    def flag(self, name: str) -> bool:
        return dict(self.flags)[name]

    @property
    def hyper(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("lr", "momentum", "dampening", "weight_decay")
        return ("lr", "beta1", "beta2", "eps", "weight_decay")

    @property
    def state(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("momentum_buffer", "first") if self.flag("momentum") else ()
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.flag("amsgrad") else ())

    def __str__(self) -> str:
        on = [name for name, value in self.flags if value]
        return f"{self.optimizer}({', '.join(on)})" if on else self.optimizer


def _group_rule(optimizer: torch.optim.Optimizer, index: int) -> UpdateRule:
    group = optimizer.param_groups[index]
    name = type(optimizer).__name__
    if group.get("differentiable"):
        raise ValueError(f"optimizer: param group {index} has differentiable=True, which the in-graph update does not support")
    if name == "SGD":
        flags = (("momentum", float(group["momentum"]) != 0.0), ("nesterov", bool(group["nesterov"])), ("maximize", bool(group["maximize"])))
    else:
        decoupled = bool(group.get("decoupled_weight_decay", name == "AdamW"))
        flags = (("amsgrad", bool(group["amsgrad"])), ("maximize", bool(group["maximize"])), ("decoupled_weight_decay", decoupled),
                 ("capturable", bool(group.get("capturable"))), ("fused", bool(group.get("fused"))))
    return UpdateRule(name, flags)


def adam_step(rule: UpdateRule, like: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:
    """Adam's ``state["step"]`` for ``like`` where torch's ``Adam._init_group`` puts it (on the device
    if capturable or fused, else a host scalar), the place the graph was traced for: a given
    ``step`` (say, loaded) is moved there; None: a new one at zero."""
    device = like.device if rule.flag("capturable") or rule.flag("fused") else torch.device("cpu")
    dtype = torch.float32 if rule.flag("fused") or torch.get_default_dtype() != F64 else F64  # torch's _get_scalar_dtype
    if step is None:
        return torch.zeros((), dtype=dtype, device=device)
    return step if (step.device, step.dtype) == (device, dtype) else step.to(device=device, dtype=dtype)


def fake_state(rule: UpdateRule, like: torch.Tensor, moment: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Values shaped as ``rule.state`` for ``like`` (a parameter or part), each moment ``moment()``:
    call it in the graph's fake mode, for the update's new inputs."""
    return [adam_step(rule, like) if s == "step" else torch.empty((), dtype=torch.bool) if s == "first" else moment() for s in rule.state]


def fake_hyper(rules: Iterable[UpdateRule]) -> list[torch.Tensor]:
    """Per param group's rule, values as :func:`hyper_tensors` makes them: in the graph's fake mode."""
    return [torch.empty((), dtype=F64) for rule in rules for _ in rule.hyper]


def init_adam_state(rule: UpdateRule, state: dict[str, Any], like: torch.Tensor, zeros: Callable[[], torch.Tensor]) -> None:
    """Adam's ``state`` of ``like`` (a parameter or part) as torch's ``Adam._init_group`` makes it."""
    if "step" in state:
        state["step"] = adam_step(rule, like, state["step"])
    else:
        state.update(step=adam_step(rule, like), exp_avg=zeros(), exp_avg_sq=zeros())
    if rule.flag("amsgrad") and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = zeros()


def hyper_values(group: Mapping[str, Any], rule: UpdateRule) -> list[float]:
    if rule.kind == "sgd":
        return [float(group["lr"]), float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"])]
    beta1, beta2 = group["betas"]
    return [float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])]


def hyper_tensors(group: Mapping[str, Any], rule: UpdateRule) -> list[torch.Tensor]:
    """:func:`hyper_values` as the update's inputs: float64 scalars, as torch computes them in Python."""
    return [torch.tensor(v, dtype=F64) for v in hyper_values(group, rule)]


# -- the math, traced into the graph ---------------------------------------------------------
# Written with elementary ops in the order torch's CPU kernels evaluate them (``add(a, b,
# alpha)`` is ``a + alpha * b``, ``addcmul(s, a, b, value)`` is ``s + value * a * b``,
# ``addcdiv(s, a, b, value)`` is ``s + value * a / b``), so inductor lowers every one.


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.lerp`` as its kernel computes it (two formulas, picked by the weight)."""
    low = start + weight * (end - start)
    high = end - (end - start) * (1 - weight)
    return torch.where(weight.abs() < 0.5, low, high)


def sgd_update(rule: UpdateRule, param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], hyper: Sequence[torch.Tensor]) -> None:
    """torch.optim.SGD's step for one parameter, in place on ``param`` and its state."""
    lr, momentum, dampening, weight_decay = hyper
    if rule.flag("maximize"):
        grad = -grad
    grad = grad + weight_decay * param
    if rule.flag("momentum"):
        buf, first = state
        # torch starts the buffer as a copy of the first gradient, without dampening.
        new_buf = torch.where(first, grad, buf * momentum + (1 - dampening) * grad)
        grad = grad + momentum * new_buf if rule.flag("nesterov") else new_buf
        buf.copy_(new_buf)
    param.copy_(param + (-lr) * grad)


def adam_update(rule: UpdateRule, param: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], hyper: Sequence[torch.Tensor]) -> None:
    """torch.optim.Adam/AdamW's step for one parameter, in place on ``param`` and its state."""
    lr, beta1, beta2, eps, weight_decay = hyper
    step, exp_avg, exp_avg_sq = state[:3]
    if rule.flag("maximize"):
        grad = -grad
    new_step = step + 1
    value = param
    if rule.flag("decoupled_weight_decay"):
        value = param * (1 - lr * weight_decay)
    else:
        grad = grad + weight_decay * param
    new_avg = _lerp(exp_avg, grad, 1 - beta1)
    new_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    steps = new_step.to(F64)
    bias_correction1 = 1 - beta1**steps
    bias_correction2 = 1 - beta2**steps
    step_size = lr / bias_correction1
    second = new_avg_sq
    if rule.flag("amsgrad"):
        second = torch.maximum(state[3], new_avg_sq)
        state[3].copy_(second)
    denom = second.sqrt() / bias_correction2.sqrt() + eps
    step.copy_(new_step)
    exp_avg.copy_(new_avg)
    exp_avg_sq.copy_(new_avg_sq)
    param.copy_(value + (-step_size) * new_avg / denom)


UPDATES: dict[str, Callable[..., None]] = {"sgd": sgd_update, "adam": adam_update}


def param_update_fn(rule: UpdateRule, clipped: bool = False) -> Callable[..., torch.Tensor]:
    """One parameter's update: arguments its gradient, the parameter, its state (``rule.state``),
    its group's hyperparameters, then (with ``clipped``) the clip coefficient the gradient is
    multiplied by first. Returns the parameter as written, which a trace's later readers read."""
    width = len(rule.state)

    def update(grad: torch.Tensor, param: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if clipped:
            *rest, coef = rest
            with role("update"):  # clip_grad_norm_'s in-place mul_, before the step reads the gradient
                grad = grad * coef
        with role("update"):
            UPDATES[rule.kind](rule, param, grad, list(rest[:width]), list(rest[width:]))
        return param

    return update


# -- the runtime side -------------------------------------------------------------------------


@dataclasses.dataclass
class UpdateArgs:
    """The extra graph inputs of one backward graph's update, built fresh at every step."""

    tensors: list[torch.Tensor]
    fresh_buffers: dict[str, torch.Tensor]  # SGD momentum buffers started by this step


class AttachedOptimizer(LossScaled):

    def __init__(self, optimizer: Any, module: nn.Module, where: str, max_grad_norm: float | None = None, grad_norm_type: float = 2.0) -> None:
        name = type(optimizer).__name__
        if not isinstance(optimizer, torch.optim.Optimizer) or name not in SUPPORTED:
            raise TypeError(
                f"{where}: optimizer must be one of torch.optim.{', torch.optim.'.join(SUPPORTED)} "
                f"(their math is compiled into the backward), got {type(optimizer).__module__}.{type(optimizer).__qualname__}"
            )
        names = {id(p): n for n, p in module.named_parameters()}
        self.params: dict[str, nn.Parameter] = {}
        self.group_of: dict[str, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"{where}: optimizer param group {g} holds a tensor of shape {tuple(p.shape)} that is not a parameter of the module")
                if p.is_complex():
                    raise ValueError(f"{where}: optimizer: parameter {names[id(p)]!r} is complex, which the in-graph update does not support")
                self.params[names[id(p)]] = p
                self.group_of[names[id(p)]] = g
        self.optimizer = optimizer
        self.rules = [_group_rule(optimizer, g) for g in range(len(optimizer.param_groups))]
        self.param_ids = frozenset(id(p) for p in self.params.values())  # what graphddp.optim.guards refuses
        # max_grad_norm: the step after the backward clips as clip_grad_norm_(model.parameters()) would.
        self.max_grad_norm, self.grad_norm_type = max_grad_norm, grad_norm_type
        self.module_params = list(module.parameters())
        # sharding="optimizer": this rank's parts of the state (graphddp.optim.shard.ShardedState).
        self.sharded: Any = None

    def attach(self) -> None:
        """``step``/``zero_grad`` become no-ops on the instance, as bound methods: LR schedulers
        wrap ``optimizer.step`` through its ``__func__``."""
        optimizer = self.optimizer
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):  # a scheduler came first: keep its mark

            def step(*args: Any, **kwargs: Any) -> None:
                optimizer._opt_called = True  # what the scheduler's wrapper records
                attached_step(optimizer, *args, **kwargs)

            step._wrapped_by_lr_sched = True
            optimizer.step = step
        else:
            optimizer.step = types.MethodType(attached_step, optimizer)
        self.owns_step = True
        self.optimizer.zero_grad = types.MethodType(attached_zero_grad, self.optimizer)
        guards.watch(self)  # clipping p.grad is now an error; an enabled GradScaler's scale(loss) marks the step

    def __str__(self) -> str:
        return ", ".join(sorted({str(r) for r in self.rules}))

    def rule(self, name: str) -> UpdateRule | None:
        g = self.group_of.get(name)
        return None if g is None else self.rules[g]

    def check_unchanged(self) -> None:
        if len(self.optimizer.param_groups) != len(self.rules):
            raise RuntimeError("graphddp: optimizer.add_param_group after graphddp.compile(..., optimizer=) is not supported")
        for g, rule in enumerate(self.rules):
            now = _group_rule(self.optimizer, g)
            if now != rule:
                changed = [k for (k, a), (_, b) in zip(rule.flags, now.flags) if a != b]
                raise RuntimeError(
                    f"graphddp: optimizer param group {g} changed {changed} after its update was compiled "
                    f"({rule} -> {now}); these options shape the compiled update: set them before the first step"
                )

    # -- per step -------------------------------------------------------------------------
    def update_args(self, names: Sequence[str], groups: Sequence[int], shards: Sequence[Any] = ()) -> UpdateArgs:
        """The update's inputs in layout order (state created as torch creates it), then each
        sharded bucket's: its parameters, the state of this rank's parts, its hyperparameters."""
        self.check_unchanged()
        tensors: list[torch.Tensor] = []
        fresh: dict[str, torch.Tensor] = {}
        for name in names:
            p = self.params[name]
            rule = self.rules[self.group_of[name]]
            state = self.optimizer.state[p]
            tensors.append(p)
            if rule.kind == "adam":
                init_adam_state(rule, state, p, functools.partial(torch.zeros_like, p, memory_format=torch.preserve_format))
                tensors.extend(state[k] for k in rule.state)
            elif rule.flag("momentum"):
                buf = state.get("momentum_buffer")
                if buf is None:  # torch starts it at the first step: until then, in our hands
                    buf = fresh[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                tensors.extend([buf, torch.tensor(name in fresh)])
        tensors.extend(t for g in groups for t in hyper_tensors(self.optimizer.param_groups[g], self.rules[g]))
        for shard in shards:
            tensors.extend(self.params[n] for n in shard.bucket.param_names)
            for k in shard.owned():
                tensors.extend(self.sharded.update_tensors(shard.bucket.slots[k].param_name))
            tensors.extend(t for g in shard.groups for t in hyper_tensors(self.optimizer.param_groups[g], self.rules[g]))
        return UpdateArgs(tensors, fresh)

    def updated(self, args: UpdateArgs) -> None:
        """After the graph ran ``args``: momentum buffers it started now belong to the state."""
        for name, buf in args.fresh_buffers.items():
            self.optimizer.state[self.params[name]]["momentum_buffer"] = buf

    @torch.no_grad()
    def finish(self) -> None:
        """At the end of every synchronising backward: torch's step for the parameters the graphs
        left a grad, then no gradient is kept. With ``max_grad_norm``, ``clip_grad_norm_`` over the
        whole module first: a step that left anything to torch left everything, all-reduced. A
        scaled step's gradients wait for ``GradScaler.step``."""
        if self.scaled:
            return
        if any(p.grad is not None for p in self.params.values()):
            if self.max_grad_norm is not None:  # every gradient is whole here, sharded or not
                guards.clip_grad_norm_(self.module_params, self.max_grad_norm, norm_type=self.grad_norm_type)
            if self.sharded is not None:  # each rank steps its part, then one all-gather
                self.sharded.step([n for n, p in self.params.items() if p.grad is not None])
            else:  # the class's step, not the no-op bound on the instance: torch's own math and state
                type(self.optimizer).step(self.optimizer)
        for p in self.params.values():
            p.grad = None


def layout(rules: Sequence[UpdateRule], group_of: Sequence[int]) -> tuple[list[str], list[int]]:
    """Placeholder names of the updates' inputs: per parameter itself and its state, then per group
    used its hyperparameters; and the groups used."""
    names: list[str] = []
    for k, rule in enumerate(rules):
        names.append(f"{UPDATE_PARAM}{k}")
        names.extend(f"update_{s}_{k}" for s in rule.state)
    groups = sorted(set(group_of))
    for g in groups:
        names.extend(f"update_group{g}_{h}" for h in rules[group_of.index(g)].hyper)
    return names, groups


def cut(values: Sequence[Any], widths: Sequence[int]) -> list[list[Any]]:
    """``values`` cut into consecutive runs of ``widths``: a layout's inputs per parameter and group."""
    runs, at = [], 0
    for width in widths:
        runs.append(list(values[at:at + width]))
        at += width
    return runs
