"""All-gathers of updated parts that the next forward completes (``gather="forward"``).

With ``sharding="optimizer", gather="forward"`` a compiled backward returns each sharded
bucket's updated parts (this rank's 1/world of the bucket, :mod:`graphddp.optim.insert_shard`)
instead of gathering them. Between that backward and the next forward the parameters of those
buckets still hold the previous step's values. :class:`PendingGathers` (one per step owner,
:class:`graphddp.runtime.step.StepState`) keeps the parts, gathers them when the next forward
starts, and completes the gathers in one of two ways:

* in the graph: the forward of the same compiled graph takes them as extra inputs and waits
  for each bucket right before its parameters are first read (:class:`ForwardDispatch`,
  :mod:`graphddp.optim.insert_gather`), so the transfer hides behind the forward's compute;
* eagerly (:meth:`PendingGathers.finish`): gather, wait, then write the parameters, before
  anything else can read them: another compiled graph that reads one of them (an evaluation
  graph, a recompile, a sibling module's call of the same graph), the end of a forward whose
  graphs did not take them, ``state_dict()`` / ``load_state_dict()`` on any module holding
  them, the checkpoint functions, ``join()``, and :func:`graphddp.finish_gathers`.

Why the parts wait for the forward, not the backward's end: between steps a rank then holds
1/world of the updated parameters, not a whole second copy of them. The forward's first graph
issues every pending all-gather (:meth:`PendingGathers.take`), its own buckets first, each
graph's in reverse bucket order (the order the forward reads them), so the link starts on them
as early as it could have at the end of the backward on a step that runs nothing in between.

What this cannot see: a tensor read directly between the backward and the next forward
(``model.fc.weight.norm()``, an EMA copy, a manual in-place write). Such code must call
:func:`graphddp.finish_gathers` first; that is why ``gather="forward"`` is not the default.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection

import torch


@dataclasses.dataclass
class Pending:
    """One backward's updated parts (one tensor per bucket, in bucket order), or once issued
    (:meth:`issue`) their un-waited all-gathers."""

    names: frozenset[str]  # the parameters they write
    tensors: list[torch.Tensor]
    gather: Callable[[torch.Tensor, int], torch.Tensor]  # (parts, index in tensors) -> the all-gather, not waited
    write: Callable[[list[torch.Tensor]], None]  # eager: wait for each all-gather, write its parameters
    issued: bool = False

    def issue(self) -> None:
        """Put every bucket's all-gather on the wire, the last bucket's first (the forward reads
        it first); the parts are dropped here (the collective keeps what it still reads)."""
        if not self.issued:
            gathered = {i: self.gather(t, i) for i, t in reversed(list(enumerate(self.tensors)))}
            self.tensors = [gathered[i] for i in range(len(self.tensors))]
            self.issued = True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class PendingGathers:
    """The updated parts and their all-gathers between a backward and the next forward, per
    compiled graph."""

    def __init__(self) -> None:
        self._pending: dict[int, Pending] = {}
        self.finished_eagerly = 0  # graphs whose gathers were completed outside a forward graph
        self.taken = 0  # ... and inside one

    def __bool__(self) -> bool:
        return bool(self._pending)

    def in_flight(self) -> bool:
        """Whether an all-gather is on the wire now (only between a forward's start and its
        writes: a step leaves none behind)."""
        return any(p.issued for p in self._pending.values())

    def held_bytes(self) -> int:
        """Bytes this rank holds for them now: the parts, or the gathered buckets once issued."""
        return sum(p.nbytes() for p in self._pending.values())

    def put(self, graph_index: int, pending: Pending) -> None:
        """Graph ``graph_index``'s backward returned these. A forward always takes or finishes the
        graph's earlier ones first; finishing any left over keeps the parameters right anyway."""
        self.finish(graph_index=graph_index)
        self._pending[graph_index] = pending

    def take(self, graph_index: int) -> list[torch.Tensor] | None:
        """For the forward of ``graph_index``, which completes them in its graph: its all-gathers,
        issued now if they are not yet, and every other graph's after them (a forward has started)."""
        pending = self._pending.pop(graph_index, None)
        if pending is None:
            return None
        pending.issue()
        for index in sorted(self._pending):  # graphs run in the forward in the order they were compiled
            self._pending[index].issue()
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
        """Gather (where not yet issued), wait for and write every pending bucket (or those of
        ``graph_index``)."""
        indices = list(self._pending) if graph_index is None else [graph_index]
        for index in indices:
            pending = self._pending.pop(index, None)
            if pending is not None:
                pending.issue()
                pending.write(pending.tensors)
                self.finished_eagerly += 1


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
