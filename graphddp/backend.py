"""The torch.compile backend: AOTAutograd, then graphddp's passes on every backward graph.

Dynamo hands each captured forward graph to :class:`GraphDDPBackend`. AOTAutograd splits it
into forward and backward ATen graphs; the backward one goes through
capture -> plan -> insert_allreduce -> verify before the inner compiler sees it:

* ``inductor``: :func:`torch._inductor.compile_fx.compile_fx` with our pass wrapped around
  its ``inner_compile``, so inductor's own decompositions, partitioner and joint-graph
  passes run unchanged. Inductor's comm reordering runs ``raise_comms`` then ``sink_waits``
  so each all-reduce is issued as soon as its bucket is ready and its wait stays late (with
  default settings inductor issues and waits them back to back: no overlap). The
  AOTAutograd cache is turned off for our graphs: a cache hit would skip the rewrite.
* ``aot_eager``: the rewritten graphs run as plain FX code (fast to compile, for tests).
* ``eager``: the rewritten graphs run node by node through :class:`torch.fx.Interpreter`
  (slowest; for stepping through with a debugger).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from graphddp.agree import check_schedule_agreement
from graphddp.capture import extract_facts, parameter_of_inputs
from graphddp.config import DDPConfig
from graphddp.passes import insert_allreduce
from graphddp.planner import plan
from graphddp.schedule import Schedule
from graphddp.verify import verify

log = logging.getLogger("graphddp")

# Keep waits late: see the module docstring.
INDUCTOR_OVERLAP_CONFIG: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["raise_comms", "sink_waits"],
}


@dataclasses.dataclass
class GraphRecord:
    """What graphddp did to one backward graph: the plan, the graph, and inductor's code."""

    schedule: Schedule
    graph: fx.GraphModule
    generated_code: str | None = None


class GraphDDPBackend:
    """A torch.compile backend that rewrites every backward graph per the bucket plan."""

    def __init__(
        self,
        config: DDPConfig,
        names_by_id: Mapping[int, str],
        on_record: Callable[[GraphRecord], None],
        group: Any = None,
        sync_enabled: Callable[[], bool] = lambda: True,
    ) -> None:
        self.config = config
        self.group = group
        self.sync_enabled = sync_enabled
        self.names_by_id = names_by_id
        self.on_record = on_record
        self._graph_counter = itertools.count()
        # Parameters lifted into some compiled graph: their gradients come out of a backward
        # graph we rewrite. Known at forward-compile time, before any backward has run.
        self.params_in_graphs: set[str] = set()
        self.graphs_compiled = 0  # every Dynamo graph this backend compiled, both sync variants
        # Parameters of the compiled graphs that actually ran since the wrapper last cleared it:
        # a parameter missing here got its gradient (if any) from eager code.
        self.ran_params: set[str] = set()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        param_inputs = parameter_of_inputs(example_inputs, self.names_by_id)
        self.params_in_graphs.update(param_inputs.values())
        self.graphs_compiled += 1
        return self._track(self._compile(gm, example_inputs, param_inputs), frozenset(param_inputs.values()))

    def _track(self, compiled: Callable[..., Any], names: frozenset[str]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            self.ran_params.update(names)
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], param_inputs: Mapping[int, str]) -> Callable[..., Any]:
        if not self.sync_enabled():  # the no_sync variant: backward without communication
            return _compile_plain(gm, example_inputs, self.config.backend)
        graph_index = next(self._graph_counter)
        rewrite = lambda bw: self.rewrite_backward(bw, param_inputs, graph_index)  # noqa: E731
        if self.config.backend == "inductor":
            return _compile_inductor(gm, example_inputs, rewrite, self.on_record)
        run = _interpret if self.config.backend == "eager" else _as_is

        def bw_compiler(bw: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
            record = rewrite(bw)
            self.on_record(record)
            return make_boxed_func(run(record.graph))

        fw_compiler = lambda fw, _inputs: make_boxed_func(run(fw))  # noqa: E731
        return aot_autograd(
            fw_compiler=fw_compiler, bw_compiler=bw_compiler, keep_inference_input_mutations=True
        )(gm, example_inputs)

    def rewrite_backward(
        self, gm: fx.GraphModule, param_inputs: Mapping[int, str], graph_index: int
    ) -> GraphRecord:
        """capture -> plan -> rewrite -> verify for one backward graph."""
        facts = extract_facts(gm, param_inputs)
        graded = {s.output_index for s in facts.slots}
        unreduced = tuple(name for i, name in sorted(param_inputs.items()) if i not in graded)
        schedule = plan(facts, self.config, graph_index=graph_index, unreduced=unreduced)
        log.info("graphddp plan for backward graph %d (fingerprint %s):\n%s", graph_index, schedule.fingerprint(), schedule.to_table())
        if self.group is not None:
            check_schedule_agreement(schedule, self.group)
        log.debug("backward graph %d before insert_allreduce:\n%s", graph_index, gm.code)
        if self.config.world_size > 1:
            insert_allreduce(gm, schedule)
            log.debug("backward graph %d after insert_allreduce:\n%s", graph_index, gm.code)
            if self.config.verify:
                verify(gm, schedule, {s.output_index: s.param_name for s in facts.slots})
        return GraphRecord(schedule=schedule, graph=gm)


def _compile_plain(gm: fx.GraphModule, example_inputs: Sequence[Any], backend: str) -> Callable[..., Any]:
    """Compile with the same inner compiler and no graphddp pass."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    run = _interpret if backend == "eager" else _as_is
    compiler = lambda g, _inputs: make_boxed_func(run(g))  # noqa: E731
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True)(gm, example_inputs)


def _as_is(gm: fx.GraphModule) -> Callable[..., Any]:
    return gm


def _interpret(gm: fx.GraphModule) -> Callable[..., Any]:
    return lambda *args: fx.Interpreter(gm).run(*args)


def _compile_inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    rewrite: Callable[[fx.GraphModule], GraphRecord],
    on_record: Callable[[GraphRecord], None],
) -> Callable[..., Any]:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        if not kwargs.get("is_backward", False):
            return compile_fx_inner(graph, inputs, **kwargs)
        record = rewrite(graph)
        with inductor_config.patch(INDUCTOR_OVERLAP_CONFIG):
            compiled = compile_fx_inner(record.graph, inputs, **kwargs)
        record.generated_code = getattr(compiled, "source_code", None)
        on_record(record)
        return compiled

    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)
