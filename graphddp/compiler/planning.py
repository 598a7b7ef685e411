"""The trace ``sharding="auto"`` chooses from: the model's forward and backward graphs, once,
before any placement is built.

Why a trace of its own: a placement changes how the module is wrapped (full sharding cuts the
parameters at wrap time), so the choice comes before the compile that uses it. This trace runs
the example batch's forward once through Dynamo and AOTAutograd, partitioned as the run's backend
partitions (min-cut under inductor, so the saved activations are the run's), and keeps what every
placement's prediction reads (:class:`graphddp.plan.step.StepFacts`): the backward's nodes and
gradients in production order, the forward's nodes. The graphs run as plain FX code, once,
without a backward: what it holds is one forward's activations beside the whole parameters, which
the module holds anyway before it is placed.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from graphddp.graph.capture import extract_facts, graph_nodes, names_by_identity, parameter_of_inputs
from graphddp.plan.step import StepFacts

_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def call_example(module: Any, example: Any) -> Any:
    """``module`` on ``example``: a tuple is its positional inputs, a dict its keyword inputs, anything else its one input."""
    if isinstance(example, tuple):
        return module(*example)
    if isinstance(example, dict):
        return module(**example)
    return module(example)


class PlanningTrace:
    """A ``torch.compile`` backend that keeps each Dynamo graph's facts and runs it as FX code."""

    def __init__(self, module: nn.Module, min_cut: bool) -> None:
        self.names_by_id = names_by_identity(module.named_parameters(remove_duplicate=False))
        self.min_cut = min_cut
        self.graphs: list[StepFacts] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        param_inputs = parameter_of_inputs(example_inputs, self.names_by_id)
        split = min_cut_rematerialization_partition if self.min_cut else default_partition

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            forward, backward = split(joint, joint_inputs, **kwargs)
            self.graphs.append(StepFacts(extract_facts(backward, param_inputs), graph_nodes(forward)))
            return forward, backward

        return aot_autograd(
            fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
            inference_compiler=lambda g, _: make_boxed_func(g), partition_fn=partition,
        )(gm, example_inputs)


def trace_step_facts(module: nn.Module, example: Any, min_cut: bool, dynamic: bool | None = None) -> list[StepFacts]:
    """Every Dynamo graph's :class:`StepFacts` for ``module`` on ``example`` (module docstring)."""
    tracer = PlanningTrace(module, min_cut)
    compiled = torch.compile(module, backend=tracer, dynamic=dynamic, **_ISOLATED)
    with torch.enable_grad():
        call_example(compiled, example)
    if not tracer.graphs:
        raise ValueError("graphddp: sharding='auto' traced no graph that computes a gradient from example=; "
                         "pass a batch the model trains on")
    return tracer.graphs
