"""What a training step is, at run time: the one owner of the state of a step.

Dynamo makes several graphs for two reasons that must never be confused. A graph break splits one
forward into graphs that all run in the same step (a parameter read by two of them gets its
gradient in parts); a recompile (a guard failed) makes a graph that replaces an older one, and the
two never run in the same step. So "is this parameter in another graph" is asked of the graphs of
this step: a graph's Dynamo frame (recompiles share it) says which graphs could run together,
which ones did is known only at run time, and kept here.

Each synchronising forward records the autograd node its call made, held weakly: a graph is in this
step while it has a node whose backward ran in this step, or a live one still to run (a dropped
output frees its node). At the end of every synchronising backward (one engine callback however
many graphs ran) the listeners run in order and the step is over. The replica writes the step's
switches through this class's methods; the backend and the dispatchers only read them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from graphddp.runtime.gathers import PendingGathers
from graphddp.runtime.steady import Expected
from graphddp.runtime.step_agreement import StepAgreement


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    """One compiled Dynamo graph as the step sees it."""

    index: int
    frame: int | None  # Dynamo's frame id; None when not compiled under Dynamo (each its own frame)
    params: frozenset[str]


@dataclasses.dataclass(frozen=True)
class NotInside:
    """Why a backward's optimizer update is not the whole step for ``names``
    (:meth:`StepState.not_inside`); ``why`` is the warning's text, empty for expected reasons."""

    kind: str
    names: tuple[str, ...]
    why: str = ""


class _Run:
    """One forward's backward node, whether its backward started, and whether the forward ran under
    ``no_sync`` (``local``) or with other parameters than compiled (``foreign``): sharding="full" only."""

    __slots__ = ("node", "started", "local", "foreign")

    def __init__(self, node: Any, local: bool = False, foreign: bool = False) -> None:
        self.node = weakref.ref(node)
        self.started, self.local, self.foreign = False, local, foreign

    def counts(self) -> bool:
        return self.started or self.node() is not None


def current_frame() -> int | None:
    """The frame Dynamo is compiling now (recompiles of one frame share it), or None."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else compile_id.frame_id


class StepState(StepAgreement):
    """The state of the current step, one per model replica; its agreement methods are its base's."""

    def __init__(self, track_runs: bool = True) -> None:
        # Recording each forward's backward node costs a walk to it and a weak reference per
        # graph and step; only the optimizer inside the backward and a traced hook ask for it.
        self.track_runs = track_runs
        self.graphs: list[GraphEntry] = []
        self.sync = True  # the user's switch, DDP's require_backward_grad_sync (set_sync)
        self.eager_hook_step = False  # this step's hook runs eagerly on accumulated gradients
        self.eager_graphs: list[int] = []  # ... over these graphs' buckets, at the end of the backward
        self.accumulated = False  # gradients accumulated locally (no_sync) wait for a synchronising step
        self.ran_params: set[str] = set()  # parameters of the graphs the current forward ran
        # Agreement (graphddp.runtime.step_agreement): what this step ran and whether ranks' steps differ.
        self.expected = 0  # synchronising forwards of compiled graphs since the step began
        self.probed = 0  # synchronising backward graphs that agreed in this step
        self.divergent = False  # this step's graphs differ across ranks: the union average at its end
        self.joined = False  # this rank has joined (graphddp.runtime.join): it asks every step to be divergent
        self.local_grads: dict[str, torch.Tensor] = {}  # divergent: this rank's gradients, not averaged yet
        self.local_used: set[str] = set()  # ... of which these came from a used output
        self.local_schedules: list[Any] = []  # ... from the graphs with these schedules, in run order
        # Parameters eager code may give a gradient though no compiled graph of this step covers
        # them (a frame Dynamo skipped): name -> its grad before the backward. Any makes the step divergent.
        self.eager: dict[str, torch.Tensor | None] = {}
        self._runs: dict[int, list[_Run]] = {}
        self._updates: collections.Counter[tuple[int, str]] = collections.Counter()  # (graph, "inside" or a reason): backwards
        self._listeners: list[Callable[[], None]] = []
        self._end_queued = False
        # gather="forward": all-gathers the last backward issued, completed by the next forward.
        self.gathers = PendingGathers()
        # Carrying: this synchronising step's graphs average the gradients accumulated under no_sync
        # in their own buckets, together with the new ones.
        self.carrying = False
        self._carry_graphs: dict[int, Any] = {}  # graph -> weak reference to the node its forward made
        self._carry_blocked = False  # a fact of this rank's forward that rules carrying out
        self._average_accumulated: Callable[[bool], None] = lambda shadow: None  # the replica's eager average
        self.carry_ready: Callable[[int], bool] = lambda index: False  # has graph ``index`` a carrying variant
        # Steady positions (graphddp.runtime.steady): position -> the layout every rank agreed on
        # there, kept across steps, written only from answers every rank read alike.
        self.steady: dict[int, Expected] = {}
        self._wires: dict[int, torch.Tensor] = {}  # per steady position, the buffer its all-reduce sends
        self._layouts: dict[tuple[int, int, int], int] = {}  # layout_hash((digest, position, expected)), kept
        self._solo: tuple[Any, bool] | None = None  # (group, nothing_to_agree(group)), the last asked
        self.headers_allowed = True  # not in a join context (the replica sets it per forward)

    # -- compile time ---------------------------------------------------------------------------
    def add_graph(self, frame: int | None, params: Iterable[str]) -> GraphEntry:
        entry = GraphEntry(len(self.graphs), frame, frozenset(params))
        self.graphs.append(entry)
        return entry

    def in_other_frames(self, index: int) -> set[str]:
        """Parameters that graphs of other frames read, which may run in the same step as
        graph ``index`` (after a graph break); recompiles of its own frame never do."""
        me = self.graphs[index]
        return {
            n for g in self.graphs
            if g.index != index and (g.frame is None or g.frame != me.frame) for n in g.params
        }

    # -- the replica's switches (graphddp.frontend.replica): the only writers of these fields ---------------
    def set_sync(self, sync: bool) -> None:
        """DDP's ``require_backward_grad_sync``, the one switch ``no_sync()`` also goes through."""
        self.sync = sync

    def accumulate(self) -> None:
        """A forward under ``no_sync`` ran: gradients accumulate locally until a synchronising step."""
        self.accumulated = True

    def accumulated_averaged(self) -> None:
        """The accumulated gradients were averaged (eagerly, behind the synchronising forward)."""
        self.accumulated = False

    def set_accumulated_average(self, average: Callable[[bool], None]) -> None:
        """The replica's eager average of accumulated gradients, ``average(shadow)``: what a step
        that cannot carry does instead (:meth:`agree`)."""
        self._average_accumulated = average

    def carry_accumulated(self) -> None:
        """This synchronising forward's graphs carry the accumulated gradients into their buckets."""
        self.carrying, self.accumulated = True, False
        self._carry_graphs.clear()
        self._carry_blocked = False

    def allow_headers(self, allowed: bool) -> None:
        """May this step's steady positions carry their agreement in their bucket? Not in a join
        context, where joined ranks shadow the classic agreement."""
        self.headers_allowed = allowed

    def block_carry(self) -> None:
        """Something of this forward rules carrying out on this rank; the first agreement of the
        backward tells every rank, and the step averages eagerly instead."""
        self._carry_blocked = True

    def take_carried(self) -> bool:
        """Does this graph's synchronising backward carry (the step still carries)?"""
        return self.carrying

    def hook_accumulated(self) -> None:
        """This step's traced hook averages the accumulated gradients eagerly, at the end of its backward."""
        self.eager_hook_step = True
        self.accumulated = False

    def expect_eager_gradient(self, name: str, grad: torch.Tensor | None) -> None:
        """Parameter ``name`` (its ``grad`` now) may get a gradient from eager code this step."""
        self.eager[name] = None if grad is None else grad.detach().clone()

    @contextlib.contextmanager
    def shadowing(self) -> Iterator[None]:
        """A joined rank's shadow of one step of the others (:mod:`graphddp.runtime.join`)."""
        self.joined = True
        try:
            yield
        finally:
            self.joined = False
            self.end_agreement()

    # -- forward --------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A model forward begins; a backward that raised never ran its end of step: it ends here."""
        if self._end_queued:  # its backward raised
            self._forget_started()
            self.end_agreement()
        self.ran_params.clear()
        self.eager_graphs.clear()
        self.eager_hook_step = False
        self._end_queued = False

    def graph_syncs(self) -> bool:
        """Does a compiled graph called now run its synchronising backward?"""
        return self.sync and not self.eager_hook_step

    def forward_ran(self, index: int, node: Any | None, syncing: bool, renamed: dict[str, str] | None = None) -> None:
        """Graph ``index`` ran a forward; ``node`` is the backward node this call made;
        ``renamed``: the parameters it ran with, when not the compiled ones."""
        params = self.graphs[index].params if renamed is None else frozenset(renamed.values())
        if self.carrying and syncing and torch.is_grad_enabled() and params:
            # Each parameter's accumulated gradient goes into exactly one bucket: a graph run
            # twice, one sharing a parameter with another graph of the step, or one running
            # another module's parameters rules carrying out.
            if renamed or index in self._carry_graphs or params & self.ran_params or node is None:
                self._carry_blocked = True
            else:
                self._carry_graphs[index] = weakref.ref(node)
        self.ran_params.update(params)
        if syncing and torch.is_grad_enabled():
            self.expected += 1
        if not syncing and self.eager_hook_step and node is not None:
            # The step after no_sync with a traced hook: the graph runs locally, and its
            # buckets go through the hook eagerly when this synchronising backward ends.
            self.eager_graphs.append(index)
            node.register_prehook(self._eager_backward)
        if self.track_runs and syncing and node is not None and torch.is_grad_enabled():
            self.record_run(index, node)

    def record_run(self, index: int, node: Any, local: bool = False, foreign: bool = False) -> None:
        """Graph ``index``'s forward made ``node``; runs whose outputs were dropped are forgotten."""
        self._runs[index] = [r for r in self._runs.get(index, ()) if r.counts()] + [_Run(node, local, foreign)]

    # -- backward -------------------------------------------------------------------------------
    def contribute(self, schedule: Any, grads: dict[str, torch.Tensor], used: Iterable[str]) -> None:
        """A divergent step's graph ran locally: its gradients wait here for the union average."""
        for name, grad in grads.items():
            held = self.local_grads.get(name)
            self.local_grads[name] = grad if held is None else held + grad
        self.local_used.update(used)
        self.local_schedules.append(schedule)

    def runs(self, index: int) -> int:
        """Backwards of graph ``index`` in this step: run already, running, or still to come."""
        return sum(r.counts() for r in self._runs.get(index, ()))

    def shared_this_step(self, index: int, names: Iterable[str]) -> set[str]:
        """Which of ``names`` another graph of this step also reads (its gradient comes in parts)."""
        wanted = set(names)
        return {n for g in self.graphs if g.index != index and self.runs(g.index) for n in g.params & wanted}

    def not_inside(
        self, index: int, names: Sequence[str], *, scaled: bool, unused: frozenset[str] = frozenset(),
        held: Sequence[str] = (), in_norm: Callable[[int], bool] | None = None,
    ) -> NotInside | None:
        """None where graph ``index``'s update inside its backward is the whole step for ``names``,
        else the first reason it is not; torch's step after the backward (or full sharding's
        ``opt.step()``) then steps them from their gradients: the same result, not overlapped.

        * ``"scaler"``: a GradScaler's unscale, inf check and step come after the backward.
        * ``"unused"``: no rank used them: torch.optim skips a parameter DDP leaves without a gradient.
        * ``"no_sync"``: this backward accumulates (sharding="full" only; a replicated graph runs locally).
        * ``"ran twice"``: the step's gradient is the sum of the graph's backwards.
        * ``"other parts"``: the graph ran for other parameters than compiled; state passed by name
          would be another's (sharding="full" only).
        * ``"shared"``: another graph of this step reads them: autograd adds the parts after this backward.
        * ``"clip spans graphs"``: another graph of this step adds to the global norm (``in_norm``).
        * ``"accumulated"``: they hold a gradient from earlier micro-steps (``held``)."""
        mine = [r for r in self._runs.get(index, ()) if r.counts()]
        wanted, shared = set(names), self.shared_this_step(index, names)
        others = [g.index for g in self.graphs if g.index != index and in_norm is not None and self.runs(g.index) and in_norm(g.index)]
        reasons = (
            (scaled, "scaler", names, ""),
            (unused & wanted, "unused", sorted(unused & wanted), "no rank used them in this step"),
            (any(r.local for r in mine), "no_sync", names, ""),
            (len(mine) > 1, "ran twice", names, f"the graph's forward ran {len(mine)} times before one backward"),
            (any(r.foreign for r in mine), "other parts", names, ""),
            (shared, "shared", sorted(shared), "another compiled graph of this step reads them too"),
            (others, "clip spans graphs", names, f"max_grad_norm: the global norm spans {len(others) + 1} compiled graphs of this step (a graph break)"),
            (held, "accumulated", held, ""),
        )
        return next((NotInside(kind, tuple(which), why) for holds, kind, which, why in reasons if holds), None)

    def count_update(self, index: int, kind: str) -> None:
        """A synchronising backward of graph ``index`` updated inside (``"inside"``, ``"inside,
        carried"``) or left its update to torch's step (a :meth:`not_inside` kind)."""
        self._updates[index, kind] += 1

    def updates(self, index: int | None = None) -> dict[str, int]:
        """How many synchronising backwards (of graph ``index``, or of every graph) updated inside,
        and how many did not, by reason."""
        counts: collections.Counter[str] = collections.Counter()
        for (graph, kind), n in self._updates.items():
            if index is None or graph == index:
                counts[kind] += n
        return dict(counts)

    def optimizer_stepped(self) -> None:
        """torch's ``opt.step()`` ended a step that no synchronising backward ends (sharding="full"):
        a forward whose backward never ran no longer counts."""
        self._runs.clear()
        self._end_queued = False

    def on_end_of_step(self, listener: Callable[[], None]) -> None:
        """Run ``listener`` at the end of every synchronising backward, in registration order."""
        self._listeners.append(listener)

    def _eager_backward(self, _grad_outputs: Any = None) -> None:
        self.synchronising_backward(None)

    def synchronising_backward(self, index: int | None = None) -> None:
        """A synchronising backward of graph ``index`` starts (the first of its runs not started
        yet); the step ends when the whole backward is done."""
        for run in self._runs.get(index, ()) if index is not None else ():
            if not run.started and run.node() is not None:
                run.started = True
                break
        self.queue_end()

    def queue_end(self) -> None:
        """End the step at the end of this backward (called from inside it, once per backward)."""
        if self._end_queued:
            return
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_step)

    def _forget_started(self) -> None:
        """Runs whose backward started belong to a step that is over; those waiting count next."""
        for index, runs in list(self._runs.items()):
            self._runs[index] = [r for r in runs if not r.started and r.node() is not None]

    def _end_of_step(self) -> None:
        self._end_queued = False
        try:
            for listener in self._listeners:
                listener()
        finally:
            self.eager_hook_step = False
            self.eager_graphs.clear()
            self.carrying = False
            self._forget_started()
            self.end_agreement()

    def end_agreement(self) -> None:
        """The step's agreement is over: the next synchronising backward starts afresh."""
        self.expected = self.probed = 0
        self.divergent = False
        self.local_grads.clear()
        self.local_used.clear()
        self.local_schedules.clear()
        self.eager.clear()
