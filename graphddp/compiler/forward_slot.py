"""``gather="forward"``: each training forward graph as a :class:`ForwardDispatch`, and its slot
variant. A forward is compiled before its backward is planned, which decides what it
all-gathers; so a copy of its graph is kept, and the variant that takes the all-gathers is built
from it and compiled the first time a step needs it.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from graphddp.optim.insert_gather import insert_forward_gathers, verify_forward_gathers
from graphddp.runtime.gathers import ForwardDispatch, PendingGathers

log = logging.getLogger("graphddp")


class ForwardSlots:
    """The training forwards of one model's compiled graphs, by graph index."""

    def __init__(self, gathers: PendingGathers, verify: bool) -> None:
        self.gathers = gathers
        self.verify = verify
        self.forwards: dict[int, ForwardDispatch] = {}
        self._makers: dict[int, Callable[[Sequence[Any]], Callable[[], Any]]] = {}

    def __contains__(self, graph_index: int) -> bool:
        return graph_index in self.forwards

    def wrap(
        self, graph_index: int, fw: fx.GraphModule, plain: Any, compile_graph: Callable[..., Callable[[], Any]],
        param_inputs: Mapping[int, str],
    ) -> ForwardDispatch:
        """Graph ``graph_index``'s forward (``fw``, the graph before it was compiled, ``plain`` its
        code) as a dispatcher; ``compile_graph(graph)`` (:attr:`Compiler.later`) compiles a
        variant of it on first use."""
        forward = ForwardDispatch(plain, graph_index, self.gathers)
        self.forwards[graph_index] = forward
        index = {name: i for i, name in param_inputs.items()}

        def maker(shards: Sequence[Any]) -> Callable[[], Any]:
            def compile_slot() -> Any:
                graph = copy.deepcopy(fw)
                insert_forward_gathers(graph, shards, index)
                log.debug("forward graph %d with its all-gathers:\n%s", graph_index, graph.code)
                if self.verify:
                    verify_forward_gathers(graph, shards)
                forward.slot_graph = copy.deepcopy(graph)
                return compile_graph(graph)()  # the shards' placeholders, appended, as extra inputs

            return compile_slot

        self._makers[graph_index] = maker
        return forward

    def planned(self, graph_index: int, shards: Sequence[Any]) -> None:
        """Graph ``graph_index``'s backward is planned: its forward can take ``shards``' all-gathers."""
        self.forwards[graph_index].compile_slot = self._makers[graph_index](shards)
