"""One trace of the model as the user wrote it, before any placement: what ``sharding="auto"``
chooses from and what :func:`graphddp.predict_memory` predicts from.

Why one trace: a placement changes the collectives, the optimizer's share and what is gathered,
not the model's graphs, so every placement's step and memory facts are read off the same graphs.
The example batch's forward runs once through Dynamo and AOTAutograd as plain FX code, without a
backward: each joint graph is partitioned both ways a run may (the default partition, and
min-cut, which inductor and full sharding compile), so the backward's graph is known without
running it. The trace holds one forward's activations beside the whole parameters, which the
module holds anyway before it is placed, and leaves no mark on the module.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
import warnings
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from graphddp.compiler.aot import ISOLATED, first_compile_shapes
from graphddp.compiler.optimizer_probe import state_rules, step_workspace, update_workspace
from graphddp.graph.capture import extract_facts, graph_nodes, names_by_identity, output_nodes, parameter_of_inputs
from graphddp.graph.liveness import liveness, saved_storages, value_bytes
from graphddp.plan.memory import GraphMemory, MemoryFacts, ParamFact
from graphddp.plan.step import StepFacts


@dataclasses.dataclass(frozen=True)
class ModelTrace:
    """Every Dynamo graph's step facts (partitioned as the run's backend partitions) and the
    model's memory facts."""

    steps: tuple[StepFacts, ...]
    memory: MemoryFacts
    measured: tuple[float, float] | None = None  # seconds of the traced forward and backward, when timed


def call_example(module: Any, example: Any) -> Any:
    """``module`` on ``example``: a tuple is its positional inputs, a dict its keyword inputs, anything else its one input."""
    if isinstance(example, tuple):
        return module(*example)
    if isinstance(example, dict):
        return module(**example)
    return module(example)


@dataclasses.dataclass
class _Graph:
    """One Dynamo graph: its inputs that are parameters, by position and name, and both partitions."""

    params: dict[int, str]
    default: tuple[fx.GraphModule, fx.GraphModule] | None = None
    min_cut: tuple[fx.GraphModule, fx.GraphModule] | None = None


class _Tracer:
    """A ``torch.compile`` backend that keeps each Dynamo graph's partitions and runs its forward as FX code."""

    def __init__(self, module: nn.Module) -> None:
        self.names_by_id = names_by_identity(module.named_parameters(remove_duplicate=False))
        self.graphs: list[_Graph] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        graph = _Graph(parameter_of_inputs(example_inputs, self.names_by_id))

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            graph.min_cut = min_cut_rematerialization_partition(_copy_graph(joint), joint_inputs, **kwargs)
            graph.default = default_partition(joint, joint_inputs, **kwargs)
            self.graphs.append(graph)
            return graph.default

        boxed = lambda g, _: make_boxed_func(g)  # noqa: E731
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, inference_compiler=boxed, partition_fn=partition)(gm, example_inputs)


def _copy_graph(joint: fx.GraphModule) -> fx.GraphModule:
    """``joint`` with its graph copied (a partition rewrites the graph it is given) and its
    tensors shared: a deep copy would copy a constant the model's code made (Hugging Face's
    key-value cache) as a fake tensor, which fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # copying the graph's pytree specs
        copied = fx.GraphModule(joint, copy.deepcopy(joint.graph))
    copied.meta.update(joint.meta)
    return copied


def trace_model(module: nn.Module, example: Any, optimizer: torch.optim.Optimizer | None, min_cut: bool,
                dynamic: bool | None = None, timed: bool = False, mp_policy: Any = None) -> ModelTrace:
    """The trace of ``module`` on ``example``; ``min_cut``: the run's backend partitions by min-cut
    (inductor). Static sizes unless ``dynamic``, as a run's first compile has them. ``timed``: the
    traced code's forward and backward are timed too, op by op as an ``aot_eager`` run computes.
    ``mp_policy``: full sharding's mixed-precision policy, traced as the run computes; the
    parameters' and the optimizer's facts stay their own."""
    tracer = _Tracer(module)
    compiled = torch.compile(module, backend=tracer, dynamic=dynamic, **ISOLATED)
    with torch.enable_grad(), _unchanged(module), first_compile_shapes(dynamic), _computed_in(module, example, mp_policy) as example:
        call_example(compiled, example)
        measured = time_example(compiled, example, module) if timed else None
    if not tracer.graphs:
        raise ValueError("graphddp: the example traced no graph that computes a gradient; pass a batch the model trains on")
    runs = [(g, g.min_cut if min_cut else g.default) for g in tracer.graphs]
    steps = tuple(StepFacts(extract_facts(bw, g.params), graph_nodes(fw)) for g, (fw, bw) in runs)
    params = list(module.named_parameters())
    memory = MemoryFacts(
        params=tuple(ParamFact(n, p.numel(), p.element_size(), p.requires_grad, str(p.dtype).removeprefix("torch.")) for n, p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in module.buffers()),
        state=state_rules(optimizer, {p.dtype for _, p in params}),
        step_workspace=step_workspace(optimizer), update_workspace=update_workspace(optimizer),
        device=next((p.device.type for _, p in params), "cpu"),
        **_policy_itemsizes(mp_policy),
        graphs=tuple(_graph_memory(*pair, g.params) for g, pair in runs),
        recomputed=tuple(_graph_memory(*g.min_cut, g.params) for g in tracer.graphs),
    )
    return ModelTrace(steps, memory, measured)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor of ``tree`` cast to ``dtype`` (FSDP2's ``cast_forward_inputs``
    and ``output_dtype``; integer tensors, such as token ids, stay as they are)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@contextlib.contextmanager
def _computed_in(module: nn.Module, example: Any, policy: Any) -> Iterator[Any]:
    """The example to trace, with ``module`` computing as a run under the mixed-precision
    ``policy`` computes: every floating parameter in the policy's ``param_dtype`` and, where the
    policy casts forward inputs, the example's floating tensors too; so the graphs' activations
    and gradients have the run's dtypes, including what the model's own code keeps in float32.
    The parameters' own tensors are put back after."""
    dtype = getattr(policy, "param_dtype", None)
    cast = [p for p in module.parameters() if dtype is not None and p.is_floating_point() and p.dtype != dtype]
    own = [p.data for p in cast]
    try:
        for p in cast:
            p.data = p.data.to(dtype)
        yield cast_floats(example, dtype) if dtype is not None and policy.cast_forward_inputs else example
    finally:
        for p, data in zip(cast, own):
            p.data = data


def _policy_itemsizes(policy: Any) -> dict[str, int]:
    """:class:`MemoryFacts`' ``compute_itemsize`` and ``reduce_itemsize`` under a mixed-precision
    ``policy`` (FSDP2's: ``reduce_dtype`` None is ``param_dtype``'s); none without one."""
    dtype = getattr(policy, "param_dtype", None)
    if dtype is None:
        return {}
    return {"compute_itemsize": dtype.itemsize, "reduce_itemsize": (policy.reduce_dtype or dtype).itemsize}


def time_example(run: Any, example: Any, module: nn.Module, repeats: int = 2) -> tuple[float, float]:
    """Seconds of one forward of ``run`` (``module`` or a compiled form of it) on ``example`` and
    of its backward (the fastest of ``repeats`` after a warm-up): what this rank's cores take for
    the model's ops, which node estimates miss. The backward is :func:`torch.autograd.grad` of
    the sum of every floating output, so no ``.grad`` is written (0 seconds where no output needs
    a gradient); buffers and random streams are put back."""
    import time

    params = [p for p in module.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = [float("inf"), float("inf")]
    with torch.enable_grad(), _unchanged(module):
        for i in range(repeats + 1):
            sync()
            start = time.perf_counter()
            total = sum(t.float().sum() for t in floating_outputs(call_example(run, example)) if t.requires_grad)
            sync()
            middle = time.perf_counter()
            backward = isinstance(total, torch.Tensor)
            if backward:
                torch.autograd.grad(total, params, allow_unused=True)
            sync()
            if i:
                best = [min(best[0], middle - start), min(best[1], time.perf_counter() - middle) if backward else 0.0]
    return best[0], best[1]


def floating_outputs(out: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors of a model's output: a tensor, or inside any container pytree
    knows (mappings, sequences, a Hugging Face output) and the dataclasses and namespaces it takes
    for leaves. The sum of those that need a gradient is the loss the trace and ``explain`` take a
    backward of."""
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point():
                yield leaf
        elif isinstance(leaf, types.SimpleNamespace):
            yield from floating_outputs(list(vars(leaf).values()))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            yield from floating_outputs([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])


@contextlib.contextmanager
def _unchanged(module: nn.Module) -> Iterator[None]:
    """The buffers the body updates (BatchNorm's running statistics) and the random streams it
    draws from (dropout) put back, so the run's first step is the one it would be without it."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _graph_memory(forward: fx.GraphModule, backward: fx.GraphModule, params: dict[int, str]) -> GraphMemory:
    """A Dynamo graph's bytes; ``params``: its inputs that are parameters (the backward's outputs
    at those positions are their gradients)."""
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
        backward_peak=bw.peak_outputs_kept, backward_peak_held=bw.peak_inputs_held, params=tuple(params.values()),
    )
