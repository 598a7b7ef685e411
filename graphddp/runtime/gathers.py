"""All-gathers a backward issued and the next forward completes (``gather="forward"``).

With ``sharding="optimizer", gather="forward"`` a compiled backward returns each sharded
bucket's all-gather of the updated parts un-waited (:mod:`graphddp.optim.insert_shard`).
Between that backward and the next forward the parameters of those buckets still hold the
previous step's values: the new ones are on the wire. :class:`PendingGathers` (one per step
owner, :class:`graphddp.runtime.step.StepState`) keeps them, and completes them in one of two
ways:

* in the graph: the forward of the same compiled graph takes them as extra inputs and waits
  for each bucket right before its parameters are first read (:class:`ForwardDispatch`,
  :mod:`graphddp.optim.insert_gather`), so the transfer hides behind the forward's compute;
* eagerly (:meth:`PendingGathers.finish`): wait, then write the parameters, before anything
  else can read them: another compiled graph that reads one of them (an evaluation graph, a
  recompile, a sibling module's call of the same graph), the end of a forward whose graphs did
  not take them, ``state_dict()`` / ``load_state_dict()`` on any module holding them, the
  checkpoint functions, ``join()``, and :func:`graphddp.finish_gathers`.

Why the backward issues them, and not the next forward: completing a bucket then never needs
a collective, only a wait. A ``state_dict()`` that one rank alone calls between steps (to save a
checkpoint on rank 0) finishes the gathers on that rank and returns; had the forward been left
to issue them, that rank would issue an all-gather no other rank joins, and hang. The price is
memory: between steps a rank holds the gathered buckets next to the parameters.

What this cannot see: a tensor read directly between the backward and the next forward
(``model.fc.weight.norm()``, an EMA copy, a manual in-place write). Such code must call
:func:`graphddp.finish_gathers` first; that is why ``gather="forward"`` is not the default.

The last backward's all-gathers have no next forward: a run that ends there, or drops the
model, would leave them issued and never waited, and c10d counts every functional collective
not passed to ``wait_tensor`` as an error of the program ("unwaited collective calls", printed
at exit). So the gathers still pending when their :class:`PendingGathers` is collected, or when
the interpreter exits, are waited then (:func:`_wait_left`); nothing reads them any more.
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
        # At collection or at exit, whichever comes first (module docstring). The callback holds
        # the dict, not self, so it does not keep self alive.
        weakref.finalize(self, _wait_left, self._pending)
        self.taken = 0  # graphs whose gathers a forward graph completed

    def __bool__(self) -> bool:
        return bool(self._pending)

    def held_bytes(self) -> int:
        """Bytes of the gathered buckets this rank holds now, not yet written."""
        return sum(t.numel() * t.element_size() for p in self._pending.values() for t in p.tensors)

    def put(self, graph_index: int, pending: Pending) -> None:
        """Graph ``graph_index``'s backward issued these. A forward always takes or finishes the
        graph's earlier ones first; finishing any left over keeps the parameters right anyway."""
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
        """Before compiled graph ``graph_index`` runs, reading parameters ``names``: every other
        graph's gathers that write one of them are finished now; its own too unless ``own``
        (its forward takes them)."""
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
    """Wait for the all-gathers no forward will take (their values are not written: nothing
    reads these parameters any more). A failed one is not raised: there is no caller to raise
    to, and the step that issued it has ended."""
    for gathers in pending.values():
        for tensor in gathers.tensors:
            try:
                WAIT(tensor)
            except RuntimeError:
                pass
    pending.clear()


class ForwardDispatch:
    """The compiled forward AOTAutograd calls, for a graph whose backward defers its all-gathers:
    the plain forward, or, when this graph's all-gathers are pending, the forward that takes
    them as extra inputs and completes them before the first read of each bucket. The latter is
    built and compiled the first time it is needed (``compile_slot``, set once the backward is
    planned: which buckets it has is known only then)."""

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
