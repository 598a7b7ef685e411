"""All-gathers a backward issued and the next forward completes (``gather="forward"``).

With ``sharding="optimizer", gather="forward"`` a compiled backward returns each sharded bucket's
all-gather of the updated parts un-waited: until the next forward the parameters hold the previous
step's values. The forward of the same graph takes them as inputs and waits for each bucket before
its first read (:class:`ForwardDispatch`); anything else that could read the parameters first
(another graph, ``state_dict()``, the checkpoint functions, ``join()``) finishes them eagerly. A
tensor read directly between steps (an EMA copy) is not seen: such code calls
:func:`graphddp.finish_gathers`, which is why this is not the default.

The backward issues them, not the next forward, so that completing a bucket needs only a wait,
never a collective: a ``state_dict()`` that rank 0 alone calls to save a checkpoint would
otherwise issue an all-gather no other rank joins, and hang. The price is memory between steps.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Collection

import torch

from graphddp.values.comm import WAIT


@dataclasses.dataclass
class Pending:
    """One backward's un-waited all-gathers (one per bucket, in bucket order)."""

    names: frozenset[str]  # the parameters they write
    tensors: list[torch.Tensor]
    write: Callable[[list[torch.Tensor]], None]  # eager: wait for each, write its parameters


class PendingGathers:
    """The all-gathers between a backward and the next forward, per compiled graph."""

    def __init__(self) -> None:
        self._pending: dict[int, Pending] = {}
        # At collection or at exit, whichever comes first; the callback holds the dict, not self.
        weakref.finalize(self, _wait_left, self._pending)
        self.taken = 0  # graphs whose gathers a forward graph completed

    def __bool__(self) -> bool:
        return bool(self._pending)

    def held_bytes(self) -> int:
        """Bytes of the gathered buckets this rank holds now, not yet written."""
        return sum(t.numel() * t.element_size() for p in self._pending.values() for t in p.tensors)

    def put(self, graph_index: int, pending: Pending) -> None:
        """Graph ``graph_index``'s backward issued these; any of its earlier ones are finished first."""
        self.finish(graph_index=graph_index)
        self._pending[graph_index] = pending

    def take(self, graph_index: int) -> list[torch.Tensor] | None:
        """For the forward of ``graph_index``, which completes them in its graph."""
        pending = self._pending.pop(graph_index, None)
        if pending is None:
            return None
        self.taken += 1
        return pending.tensors

    def before_graph(self, graph_index: int, names: Collection[str], own: bool) -> None:
        """Before graph ``graph_index`` reads ``names``: other graphs' gathers that write one of
        them are finished now, its own too unless ``own`` (its forward takes them)."""
        names = frozenset(names)
        for index, pending in list(self._pending.items()):
            if (index != graph_index or not own) and pending.names & names:
                self.finish(graph_index=index)

    @torch.no_grad()
    def finish(self, graph_index: int | None = None) -> None:
        """Wait for and write every pending all-gather (or those of ``graph_index``)."""
        indices = list(self._pending) if graph_index is None else [graph_index]
        for index in indices:
            pending = self._pending.pop(index, None)
            if pending is not None:
                pending.write(pending.tensors)


def _wait_left(pending: dict[int, Pending]) -> None:
    """Wait for the all-gathers no forward will take, unwritten, when their owner is collected or
    the interpreter exits: c10d reports an unwaited functional collective as an error of the
    program. A failure is not raised: the step that issued them has ended, and no caller is left."""
    for gathers in pending.values():
        for tensor in gathers.tensors:
            try:
                WAIT(tensor)
            except RuntimeError:
                pass
    pending.clear()


class ForwardDispatch:
    """The compiled forward AOTAutograd calls, for a graph whose backward defers its all-gathers:
    the plain forward, or, when its all-gathers are pending, the forward that takes them as inputs
    (``compile_slot``, set once the backward is planned, compiled at first use)."""

    def __init__(self, plain: Callable[[list[Any]], Any], graph_index: int, gathers: PendingGathers) -> None:
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__ (as BackwardDispatch)
        self.plain = plain
        self.graph_index = graph_index
        self.gathers = gathers
        self.compile_slot: Callable[[], Callable[[list[Any]], Any]] | None = None
        self._slot: Callable[[list[Any]], Any] | None = None
        self.slot_graph: Any = None  # the slot variant's FX graph, once made (for people and tests)
        self.slot_code: str | None = None  # ... and inductor's generated code of it

    def __call__(self, args: list[Any]) -> Any:
        pending = self.gathers.take(self.graph_index) if self.compile_slot is not None else None
        if pending is None:
            self.gathers.finish(self.graph_index)  # none, or none this graph can take: written now
            return self.plain(args)
        if self._slot is None:
            self._slot = self.compile_slot()
            self.slot_code = getattr(self._slot, "source_code", None)
        full = list(args) + pending
        args.clear()  # the boxed convention: the callee frees the inputs it no longer needs
        return self._slot(full)
