"""What every mode's torch.compile backend does for a Dynamo graph around the mode's passes,
written once in :class:`GraphFront`: the inputs named as the module's parameters, the inductor
settings checked, an index per Dynamo graph, and at run time each forward call's backward node
found, tagged as the optimizer's and told which output gradients were None (an unused
parameter's gradient stays None), before the mode records the call in its step.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from graphddp.compiler.record import GraphRecord
from graphddp.config import DDPConfig
from graphddp.graph.capture import parameter_of_inputs
from graphddp.optim.guards import ATTACHED_NODE
from graphddp.runtime.usage import NoneOutputs
from graphddp.runtime.variants import compiled_backward_node


class GraphFront:
    """A ``torch.compile`` backend's part that every mode shares. A mode supplies
    ``compile_graph(gm, example_inputs, param_inputs, patches, index)``: its passes, returning
    :meth:`runtime` of the compiled forward; and what a forward call means to its step:
    ``before_call(index, param_inputs, renamed)``, whose result the other two are given,
    ``wants_node(before, noting, renamed)`` (finding the backward node walks the outputs' autograd
    graph) and ``forward_ran(index, node, before, renamed)``. ``optimizer``: the attached
    optimizer whose backward nodes are tagged (a GradScaler's scale marks the step through them)."""

    optimizer: Any = None
    tracked: Callable[[], bool] = staticmethod(lambda: True)  # which forward calls go through the record

    def __init__(self, config: DDPConfig, names_by_id: Mapping[int, str], on_record: Callable[[GraphRecord], None]) -> None:
        self.config = config
        self.names_by_id = names_by_id  # the module's parameters' names, by the id Dynamo passes them with
        self.on_record = on_record
        self.graphs_compiled = 0  # Dynamo graphs this backend compiled: the next one's index

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict | None = None
    ) -> Callable[..., Any]:
        """Compile one Dynamo graph; ``mode``/``options``: a ``torch.compile`` call's, else the
        config's, checked on the inputs' device."""
        param_inputs = parameter_of_inputs(example_inputs, self.names_by_id)
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), None)
        patches = self.config.check_inductor_settings("graphddp", device, mode, options)
        index = self.graphs_compiled
        self.graphs_compiled += 1
        return self.compile_graph(gm, example_inputs, param_inputs, patches, index)

    def runtime(
        self, compiled: Callable[..., Any], index: int, param_inputs: Mapping[int, str], example_inputs: Sequence[Any],
        none_outputs: NoneOutputs, noting: Callable[[], bool],
    ) -> Callable[..., Any]:
        """``compiled``, graph ``index``'s forward, as Dynamo calls it (one list, which the callee
        frees, or for some recompiled graphs, sizes as ints, the arguments), each ``tracked()``
        call recorded by the mode with the backward node it made, which notes its None output
        gradients while ``noting()`` (its backward may leave a parameter unused). A call with other
        parameters than ``example_inputs``' (Dynamo reuses a module's graph for its siblings when
        their parent's frame runs eagerly) is told which: ``renamed``."""
        boxed = getattr(compiled, "_boxed_call", False)
        ids = {i: id(example_inputs[i]) for i in param_inputs}  # never the tensors: Dynamo's first call's, kept alive

        def called(*args: Any) -> Any:
            if not self.tracked():
                return compiled(*args)
            inputs = list(args[0]) if boxed and len(args) == 1 and isinstance(args[0], list) else args
            renamed = None
            if any(i < len(inputs) and id(inputs[i]) != pid for i, pid in ids.items()):
                renamed = {name: self.names_by_id.get(id(inputs[i]), name) for i, name in param_inputs.items()}
            before = self.before_call(index, param_inputs, renamed)
            out = compiled(*args)
            node, watch = None, noting()
            if torch.is_grad_enabled() and self.wants_node(before, watch, renamed):
                node = compiled_backward_node(out if isinstance(out, (list, tuple)) else [out], inputs)
            if node is not None and self.optimizer is not None:
                node.metadata[ATTACHED_NODE] = self.optimizer
            if node is not None and watch:
                node.register_prehook(none_outputs.note)
            self.forward_ran(index, node, before, renamed)
            return out

        called._boxed_call = boxed  # type: ignore[attr-defined]
        return called
