"""The facts a memory prediction is made from, read once off a model's own compiled graphs.

The model (a deep copy) is compiled by plain AOTAutograd, with no graphddp pass and no process
group, and run forward and backward once on the example inputs: its graphs are what every
placement's graphs are before graphddp rewrites them, so one trace serves every placement
(:func:`graphddp.plan.memory.predict`). The optimizer's state per parameter is read by stepping
a probe of the optimizer's class, with the user's hyperparameters, on two small parameters per
dtype: the state that grows with a parameter's size and the state that does not (Adam's
``step``) come out apart.
"""
from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphddp.graph.capture import output_nodes
from graphddp.graph.liveness import liveness, saved_storages, value_bytes
from graphddp.plan.memory import GraphMemory, MemoryFacts, ParamFact, StateRule


def _sum_loss(out: Any) -> torch.Tensor:
    return sum(t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad)


def memory_facts(
    model: nn.Module, *example_inputs: Any, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None, **example_kwargs: Any,
) -> MemoryFacts:
    """Trace a copy of ``model`` on ``example_inputs`` and read the facts (module docstring).
    ``optimizer`` makes the run's optimizer from parameters, as ``graphddp.explain`` takes it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[tuple[str, fx.GraphModule]] = []
    reads: list[list[int]] = []  # per Dynamo graph, the positions of its inputs that are parameters

    def keep(kind: str) -> Callable[..., Any]:
        def compiler(gm: fx.GraphModule, _inputs: Any) -> Any:
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler

    copied = copy.deepcopy(model)
    named = {id(p): p for p in copied.parameters()}
    recomputed: list[tuple[fx.GraphModule, fx.GraphModule]] = []

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        """The default partition (what the replicated modes compile), and the min-cut one
        (full sharding's, which recomputes cheap activations in the backward) kept beside it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # copying a GraphModule's pytree specs
            copied_joint = copy.deepcopy(joint)
        recomputed.append(min_cut_rematerialization_partition(copied_joint, joint_inputs, **kwargs))
        return default_partition(joint, joint_inputs, **kwargs)

    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition)

    def backend(gm: fx.GraphModule, inputs: list[Any]) -> Any:
        reads.append([i for i, t in enumerate(inputs) if id(t) in named])  # Dynamo hands the real parameters
        return aot(gm, inputs)

    # Static sizes, as a run's first compile has them, even where this process compiled the same code with other shapes.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        (loss_fn or _sum_loss)(torch.compile(copied, backend=backend)(*example_inputs, **example_kwargs)).backward()
    forwards = [gm for kind, gm in graphs if kind == "forward"]
    backwards = [gm for kind, gm in graphs if kind == "backward"]
    params = tuple(
        ParamFact(name, p.numel(), p.element_size(), p.requires_grad, str(p.dtype).removeprefix("torch."))
        for name, p in copied.named_parameters()
    )
    buffers = sum(b.untyped_storage().nbytes() for b in copied.buffers())
    made = optimizer(copied.parameters()) if optimizer is not None else None
    return MemoryFacts(
        params=params, buffer_bytes=buffers, state=_state_rules(made, {p.dtype for p in copied.parameters()}),
        step_workspace=_step_workspace(made), update_workspace=_update_workspace(made),
        device=next((p.device.type for p in copied.parameters()), "cpu"),
        graphs=tuple(_graph_memory(fw, bw, r) for fw, bw, r in zip(forwards, reversed(backwards), reads)),
        recomputed=tuple(_graph_memory(fw, bw, r) for (fw, bw), r in zip(recomputed, reads)),
    )


def _graph_memory(forward: fx.GraphModule, backward: fx.GraphModule, params: list[int]) -> GraphMemory:
    """A Dynamo graph's forward and backward (backwards compile in the reverse order of forwards);
    ``params``: its inputs that are parameters (the backward's outputs at those positions are
    their gradients)."""
    same = saved_storages(forward)
    fw = liveness(forward, ())
    primals = [n for n in forward.graph.nodes if n.op == "placeholder"]
    of_params = {primals[i].name for i in params}
    held = [n.name for n in backward.graph.nodes if n.op == "placeholder" and same.get(n.name, n.name) not in of_params]
    bw = liveness(backward, held, same)
    grads = output_nodes(backward)
    return GraphMemory(
        param_bytes=sum(value_bytes(primals[i]) for i in params),
        forward_peak=fw.peak_outputs_kept, saved=bw.saved,
        gradients=sum(value_bytes(grads[i]) for i in params if i < len(grads) and isinstance(grads[i], fx.Node)),
        backward_peak=bw.peak_outputs_kept, backward_peak_held=bw.peak_inputs_held,
    )


def _hyper(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The first param group's hyperparameters that the optimizer's class takes."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted}


def _state_rules(optimizer: torch.optim.Optimizer | None, dtypes: set[torch.dtype]) -> tuple[StateRule, ...]:
    """Per dtype, the optimizer's state bytes of a parameter of n elements as ``per_element * n +
    fixed``: a probe of its class with its first group's hyperparameters, stepped once on a
    parameter of 4 and one of 8 elements (a zero gradient: values do not matter, only sizes)."""
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


def _step_workspace(optimizer: torch.optim.Optimizer | None) -> float:
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


def _update_workspace(optimizer: torch.optim.Optimizer | None) -> float:
    """The temporaries of graphddp's update inside the backward per byte of the parameter (or
    part) updated, as the traced update runs op by op (aot_eager; inductor fuses it into less)."""
    from graphddp.optim.attached import SUPPORTED, UPDATES, _group_rule, fake_state, hyper_values

    if optimizer is None or type(optimizer).__name__ not in SUPPORTED:
        return 0.0
    rule = _group_rule(optimizer, 0)
    param, grad = torch.zeros(_PROBE), torch.zeros(_PROBE)
    state = fake_state(rule, param, lambda: torch.zeros(_PROBE))
    hyper = [torch.tensor(v, dtype=torch.float64) for v in hyper_values(optimizer.param_groups[0], rule)]
    gm = make_fx(lambda p, g, st, h: UPDATES[rule.kind](rule, p, g, st, h))(param, grad, state, hyper)
    return liveness(gm, ()).peak_outputs_freed / (_PROBE * param.element_size())
