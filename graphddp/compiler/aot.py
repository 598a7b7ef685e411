"""The torch.compile backend of every mode, built in one place: AOTAutograd with the mode's
forward and backward passes as peers (:class:`Passes`), then inductor or plain FX code.

Under ``inductor`` the passes run around ``compile_fx``'s ``inner_compile``, so that inductor's
decompositions, partitioner and joint-graph passes run unchanged; under ``aot_eager`` and
``eager`` they are ``aot_autograd``'s compilers. A pass compiles a graph through a
:class:`Compiler`, now or at first use (a variant a step may never need).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

# Each graphddp torch.compile counts its own recompiles: by default every torch.compile of the same
# code shares one recompile limit, so earlier compiles of the model's class (explain's, auto's
# trace, another wrapper's) would push a later one into eager fallback.
ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def first_compile_shapes(dynamic: bool | None) -> contextlib.AbstractContextManager[Any]:
    """A run's first compile of a model is static unless ``dynamic`` says otherwise; Dynamo would
    make a later one dynamic where this process compiled the same code with other shapes before
    (graphddp.explain's and the model trace's compiles must be the run's first)."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False) if dynamic is None else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Compiler:
    """How a pass compiles a graph: ``now(graph, extra=(), settings=None)`` returns its code,
    ``later(...)`` a call that compiles it the first time (``extra``: example inputs the graph reads beyond
    AOTAutograd's, later's by default its placeholders' past those; ``settings``: inductor's, else the mode's for that graph).
    ``in_place``: compiling rewrites the graph (inductor's does)."""

    now: Callable[..., Any]
    later: Callable[..., Callable[[], Any]]
    in_place: bool

    def copy(self, graph: fx.GraphModule) -> fx.GraphModule:
        """``graph`` to compile where the caller keeps it as it is."""
        return copy.deepcopy(graph) if self.in_place else graph


@dataclasses.dataclass(frozen=True)
class Passes:
    """One mode's work on AOTAutograd's graphs. ``forward(graph, compiler, inference)`` and
    ``backward(graph, compiler)`` return what AOTAutograd runs; ``settings(graph)``: the inductor
    settings pinned for a graph; ``run(graph, inputs)``: a graph's code without inductor;
    ``joint``: a pass on the joint graph before it is partitioned (inductor's
    ``joint_custom_pre_pass``: a ``CustomGraphPass``, so that inductor's caches key on it);
    ``min_cut``: partition by min-cut without inductor too, as inductor does."""

    forward: Callable[[fx.GraphModule, Compiler, bool], Any]
    backward: Callable[[fx.GraphModule, Compiler], Any]
    settings: Callable[[fx.GraphModule], dict[str, Any]]
    run: Callable[[fx.GraphModule, Sequence[Any]], Any]
    joint: Any = None
    min_cut: bool = False


def compile_aot(
    backend: str, gm: fx.GraphModule, example_inputs: Sequence[Any], passes: Passes,
    patches: dict[str, Any] | None = None, functorch: dict[str, Any] | None = None, this_compile: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """``gm`` through AOTAutograd and ``passes`` for ``backend``; with inductor, every graph
    under the user's ``patches``, this call's under ``this_compile`` too (not the variants
    compiled later), with AOTAutograd's ``functorch`` config patched."""
    if backend != "inductor":
        return _aot_eager(gm, example_inputs, passes)
    from torch._dynamo.convert_frame import compile_lock
    from torch._functorch import config as functorch_config
    from torch._guards import CompileContext, TracingContext, compile_context, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = {**(patches or {}), **({} if passes.joint is None else {"joint_custom_pre_pass": passes.joint})}

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        given = list(inputs)

        def now(g: fx.GraphModule, extra: Sequence[Any] = (), settings: dict[str, Any] | None = None) -> Any:
            with inductor_config.patch(passes.settings(g) if settings is None else settings):
                return compile_fx_inner(g, [*given, *extra], **kwargs)

        def later(g: fx.GraphModule, extra: Sequence[Any] | None = None, settings: dict[str, Any] | None = None) -> Callable[[], Any]:
            """As AOTAutograd compiles its own backward lazily: under the tracing and compile
            contexts of now, so that shape guards and fake tensors are the ones ``g`` was traced with."""
            contexts = TracingContext.try_get(), CompileContext.try_get()
            if extra is None:  # the fake values of the inputs ``g`` appended to AOTAutograd's
                extra = [n.meta["val"] for n in g.graph.find_nodes(op="placeholder")][len(given):]

            def compile_now() -> Any:
                pinned = {**patches, **(passes.settings(g) if settings is None else settings)}
                with compile_lock, tracing(contexts[0]), compile_context(contexts[1]), inductor_config.patch(pinned):
                    return compile_fx_inner(g, [*given, *extra], **kwargs)

            return compile_now

        compiler = Compiler(now, later, in_place=True)
        if kwargs.get("is_backward", False):
            return passes.backward(graph, compiler)
        return passes.forward(graph, compiler, bool(kwargs.get("is_inference", False)))

    with functorch_config.patch(functorch or {}), inductor_config.patch({**patches, **(this_compile or {})}):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], passes: Passes) -> Callable[..., Any]:
    """AOTAutograd without a code generator: every graph runs as ``passes.run`` makes it."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    def compiler(inputs: Sequence[Any]) -> Compiler:
        now = lambda g, extra=(), settings=None: passes.run(g, inputs)  # noqa: E731
        return Compiler(now, lambda g, extra=(), settings=None: lambda: now(g), in_place=False)

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        if passes.joint is not None:
            passes.joint(joint.graph)
        split = min_cut_rematerialization_partition if passes.min_cut else default_partition
        return split(joint, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=lambda g, inputs: passes.forward(g, compiler(inputs), False),
        bw_compiler=lambda g, inputs: passes.backward(g, compiler(inputs)),
        inference_compiler=lambda g, inputs: passes.forward(g, compiler(inputs), True),
        partition_fn=partition, keep_inference_input_mutations=True,
    )(gm, example_inputs)
