"""What a training step is, at run time: the one owner of the state of a step.

Background
    Dynamo compiles a model into several graphs for two different reasons, and graphddp must
    never confuse them:

    * a **graph break** splits one forward into several graphs that all run in the same step;
      a parameter read by two of them (tied across the break) gets its gradient in parts;
    * a **recompile** (a guard failed: a config attribute set by the first forward, another
      batch or sequence length, ``requires_grad`` toggled, train/eval) makes a new graph that
      *replaces* an older one for later steps; both read the same parameters, but they never
      run in the same step.

    Every decision that asks "is this parameter in another graph" must ask it of the graphs of
    this step, not of every graph compiled so far: whether a graph may update its parameters
    inside the backward, whether a traced hook sees a whole gradient. A graph's frame (Dynamo's
    ``frame_id``: graphs of one frame are recompiles of each other) is known at compile time and
    says which graphs *could* run together; which ones did is known only at run time, and kept
    here.

Algorithm
    * Each synchronising forward of a compiled graph records the autograd node its call made
      (:meth:`forward_ran`), held weakly; its backward notes when it starts
      (:meth:`synchronising_backward`). A graph is
      *in this step* while it has a node whose backward already ran in this step, or a live
      node that has not run yet. A forward whose output is dropped (an evaluation with grad
      enabled) frees its node and stops counting, as it never reaches a backward.
    * At the end of every synchronising backward (one engine callback per backward, however
      many graphs ran) the listeners run in order (a traced hook's end-of-step work, torch's
      optimizer step for gradients the graphs left) and the step is over: nodes that ran are
      forgotten, nodes still waiting count for the next one.
    * The user's switch (DDP's ``require_backward_grad_sync``, which ``no_sync`` toggles), whether gradients were accumulated locally, and the step
      after ``no_sync`` where a traced hook runs eagerly are held here too; the replica sets
      them through this class's methods (``set_sync``, ``accumulate``, ``hook_accumulated``...),
      the backend and the dispatchers read them; no other object writes a field of the step.

Agreement, and steps that differ across ranks
    Every synchronising backward graph with buckets first agrees with the other ranks, in band
    (:meth:`agree`): one small maximum over ranks (an all-gather of a few integers) of a hash of its wire layout, its position in
    the step and the number of synchronising forwards the step ran, plus two flags. Equal
    everywhere (the static case), the graph runs its compiled all-reduces, as before. Different
    (ranks whose control flow used different parameters: LayerDrop, a head per task; ranks that
    ran different numbers of graphs) or asked for by a joined rank (:mod:`graphddp.runtime.join`), the
    step is *divergent* on every rank at once: this and every later graph of the step runs its
    local backward, hands its gradients to the step (:meth:`contribute`) instead of autograd,
    and the end of the step averages the union of every rank's gradients, zeros where a rank
    had none (:mod:`graphddp.runtime.union`), as DDP with ``find_unused_parameters=True`` does. The
    other flag says some rank has a parameter whose every gradient source was unused this step
    (an output left out of the loss): the graph then also agrees on which parameters were used
    anywhere, and the ones used nowhere keep ``grad`` None, as in DDP. A step where parameters
    no compiled graph covers may get a gradient from eager code (Dynamo runs a frame with a
    graph break inside a loop eagerly: BART's LayerDrop) is divergent too, so that those
    gradients are averaged with the rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from graphddp.runtime.agree import PendingProbe, layout_hash, nothing_to_agree, probe_async
from graphddp.runtime.gathers import PendingGathers
from graphddp.runtime.steady import Expected, SteadyHeader, send_deviating


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    """One compiled Dynamo graph as the step sees it."""

    index: int
    frame: int | None  # Dynamo's frame id; None when not compiled under Dynamo (each its own frame)
    params: frozenset[str]


class _Run:
    """One synchronising forward's backward node, and whether its backward started."""

    __slots__ = ("node", "started")

    def __init__(self, node: Any) -> None:
        self.node = weakref.ref(node)
        self.started = False

    def counts(self) -> bool:
        return self.started or self.node() is not None


def current_frame() -> int | None:
    """The frame Dynamo is compiling now (recompiles of one frame share it), or None."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else compile_id.frame_id


class StepState:
    """The state of the current step (module docstring). One per model replica."""

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
        # Agreement (module docstring): what this step ran and whether ranks' steps differ.
        self.expected = 0  # synchronising forwards of compiled graphs since the step began
        self.probed = 0  # synchronising backward graphs that agreed in this step
        self.divergent = False  # this step's graphs differ across ranks: the union average at its end
        self.joined = False  # this rank has joined (graphddp.runtime.join): it asks every step to be divergent
        self.local_grads: dict[str, torch.Tensor] = {}  # divergent: this rank's gradients, not averaged yet
        self.local_used: set[str] = set()  # ... of which these came from a used output
        self.local_schedules: list[Any] = []  # ... from the graphs with these schedules, in run order
        # Parameters no compiled graph of this step covers, which eager code (a frame Dynamo
        # skipped: a graph break inside a loop) may give a gradient: name -> its grad before the
        # backward. Any makes the step divergent, and the union average takes their gradients.
        self.eager: dict[str, torch.Tensor | None] = {}
        self._runs: dict[int, list[_Run]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._end_queued = False
        # gather="forward": all-gathers the last backward issued, completed by the next forward.
        self.gathers = PendingGathers()
        # Carrying (module docstring): this synchronising step's graphs average the gradients
        # accumulated under no_sync in their own buckets, together with the new ones.
        self.carrying = False
        self._carry_graphs: dict[int, Any] = {}  # graph -> weak reference to the node its forward made
        self._carry_blocked = False  # a fact of this rank's forward that rules carrying out
        self._average_accumulated: Callable[[bool], None] = lambda shadow: None  # the replica's eager average
        self.carry_ready: Callable[[int], bool] = lambda index: False  # has graph ``index`` a carrying variant
        # Steady positions (graphddp.runtime.steady): position -> the layout every rank agreed on
        # there, whose agreement now rides in its one bucket's all-reduce. Kept across steps;
        # written only from answers every rank read alike.
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
        """DDP's ``require_backward_grad_sync``, the one switch ``no_sync()`` also goes through:
        read at every forward (a forward run while it is False gets its graphs' local
        backward, and its gradients accumulate until a synchronising step)."""
        self.sync = sync

    def accumulate(self) -> None:
        """A forward under ``no_sync`` ran: gradients accumulate locally until a synchronising step."""
        self.accumulated = True

    def accumulated_averaged(self) -> None:
        """The accumulated gradients were averaged (eagerly, behind the synchronising forward)."""
        self.accumulated = False

    def set_accumulated_average(self, average: Callable[[bool], None]) -> None:
        """The replica's eager average of accumulated gradients, ``average(shadow)`` (a joined
        rank's shadow: zeros): what a step that cannot carry does instead (:meth:`agree`)."""
        self._average_accumulated = average

    def carry_accumulated(self) -> None:
        """This synchronising forward's graphs carry the accumulated gradients into their buckets."""
        self.carrying, self.accumulated = True, False
        self._carry_graphs.clear()
        self._carry_blocked = False

    def allow_headers(self, allowed: bool) -> None:
        """May this step's steady positions carry their agreement in their bucket
        (:mod:`graphddp.runtime.steady`)? Not in a join context, where joined ranks shadow the
        classic agreement: set at every forward, alike on every rank."""
        self.headers_allowed = allowed

    def block_carry(self) -> None:
        """Something of this forward rules carrying out on this rank (parameters holding an
        accumulated gradient that no graph of this step covers, say); the first agreement of
        the backward tells every rank, and the step averages eagerly instead."""
        self._carry_blocked = True

    def take_carried(self) -> bool:
        """Does this graph's synchronising backward carry (the step still carries)?"""
        return self.carrying

    def hook_accumulated(self) -> None:
        """This synchronising step's traced hook averages the accumulated gradients eagerly,
        at the end of its backward (its graphs run locally)."""
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
        """A model forward begins: the graphs it runs are recorded afresh. A backward that
        raised never ran its end-of-step callback: its runs are over and the next end is
        queued anew."""
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
            # Forwards whose outputs were dropped never reach a backward: forget them.
            self._runs[index] = [r for r in self._runs.get(index, ()) if r.counts()] + [_Run(node)]

    # -- backward -------------------------------------------------------------------------------
    def agree(self, group: Any, digest: int, what: str, unused_here: bool) -> tuple[bool, bool]:
        """Before a synchronising backward graph's collectives: is this step divergent (module
        docstring), and did some rank see an unused gradient source? The same answer on every
        rank. Once divergent, the step stays so and no further check is made."""
        if self.divergent:
            return True, False
        header = self.steady_header(group, digest, unused_here)
        if header is not None:  # this path has no bucket to carry it: the header deviates, then the probe
            send_deviating(header, group)
            return self.agreed(self.probe_after(header, group, what))
        return self.agreed(self.agree_async(group, digest, what, unused_here))

    def _flags(self, position: int, unused_here: bool) -> tuple[bool, ...]:
        return (self.joined, bool(self.eager), unused_here, self.carrying, self.carrying and position == 0 and self._cannot_carry())

    def agree_async(
        self, group: Any, digest: int, what: str, unused_here: bool, steady: tuple[int, torch.dtype] | None = None
    ) -> PendingProbe:
        """:meth:`agree`'s collective, issued now and read later (a gated backward reads it at
        its first bucket's issue: :mod:`graphddp.runtime.gate`); :meth:`agreed` finishes it.
        Only while the step is not divergent yet. ``steady``: this graph's one bucket's
        ``(numel, dtype)`` where it could carry its next agreements (:mod:`graphddp.runtime.steady`)."""
        position, self.probed = self.probed, self.probed + 1
        return self._ask(group, position, self._layout(digest, position), self._flags(position, unused_here), what, steady)

    def _layout(self, digest: int, position: int) -> int:
        """What a rank's agreement at ``position`` compares: its graph's layout, the position and
        the synchronising forwards of the step so far (a hash, kept: every step asks the same)."""
        key = (digest, position, self.expected)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 1024:  # positions x layouts: a handful, unless graphs keep changing
                self._layouts.clear()
            layout = self._layouts[key] = layout_hash(key)
        return layout

    def _alone(self, group: Any) -> bool:
        """``nothing_to_agree(group)``, asked once per group (a steady backward asks every step)."""
        if self._solo is None or self._solo[0] is not group:
            self._solo = (group, nothing_to_agree(group))
        return self._solo[1]

    @staticmethod
    def _ask(
        group: Any, position: int, layout: int, flags: tuple[bool, ...], what: str, steady: tuple[int, torch.dtype] | None
    ) -> PendingProbe:
        # The last flag: this rank's graph here cannot carry its agreement in its bucket; an
        # expectation is recorded only where no rank raises it (agreed).
        return probe_async(None, (*flags, steady is None), group, what, digest=layout, question=(position, layout, steady))

    def steady_header(self, group: Any, digest: int, unused_here: bool) -> SteadyHeader | None:
        """The next position's agreement as a header of its bucket's all-reduce, where that
        position is steady (:mod:`graphddp.runtime.steady`); None where the classic probe asks.
        Takes the position as :meth:`agree_async` does."""
        expected = self.steady.get(self.probed) if self.headers_allowed and not self.joined else None
        if expected is None or self._alone(group):
            return None
        position, self.probed = self.probed, self.probed + 1
        wire = self._wires.get(position)
        if wire is None:
            wire = self._wires[position] = expected.buffer()
        return SteadyHeader(position, expected, self._layout(digest, position), self._flags(position, unused_here), wire)

    def probe_after(
        self, header: SteadyHeader, group: Any, what: str, steady: tuple[int, torch.dtype] | None = None
    ) -> PendingProbe:
        """The classic probe at a steady position whose header some rank raised: every rank
        asks it next, at the same position, with the same flags (:meth:`agreed` decides);
        ``steady`` as for :meth:`agree_async`."""
        return self._ask(group, header.position, header.layout, header.flags, what, steady)

    @staticmethod
    def goes_on(pending: PendingProbe) -> bool:
        """Does the agreement let a synchronising graph issue its buckets as compiled: the same
        layout everywhere, no rank joined, eager, with an unused gradient or unable to carry?
        Reads (waits for) the answer; no side effect."""
        same, (join_asks, eager, unused, _carrying, blocked, _unsteady) = pending.result()
        return same and not (join_asks or eager or unused or blocked)

    def agreed(self, pending: PendingProbe) -> tuple[bool, bool]:
        """What :meth:`agree` returns, from its collective: the step's divergence and the
        averages a step that cannot carry makes now (module docstring). Records or forgets
        the position's expectation (:mod:`graphddp.runtime.steady`) from the answer, which
        every rank reads alike."""
        same, (join_asks, eager, unused, carrying, blocked, unsteady) = pending.result()
        if pending.question is not None:
            position, layout, steady = pending.question
            if same and not (join_asks or eager or unused or blocked or unsteady) and steady is not None:
                expected = Expected(layout, *steady)
                if self.steady.get(position) != expected:
                    self._wires.pop(position, None)
                self.steady[position] = expected
            else:
                self.steady.pop(position, None)
                self._wires.pop(position, None)
        self.divergent = not same or join_asks or eager
        if carrying and (self.divergent or unused or blocked):
            # Some rank carries but this step cannot (or it is divergent): every rank averages
            # the accumulated gradients now, as before the backward (a joined rank with zeros),
            # and the step goes on as one without accumulation.
            self.carrying = False
            self._average_accumulated(self.joined)
        return self.divergent, unused

    def _cannot_carry(self) -> bool:
        """Rules carrying out on this rank, at the step's first agreement: a fact of its
        forward (:meth:`block_carry`), a graph without a carrying variant, or a graph whose
        forward ran in this step but whose backward this backward will not run (its
        parameters' accumulated gradients would stay unaveraged)."""
        if self._carry_blocked:
            return True
        for index, ref in self._carry_graphs.items():
            node = ref()
            if node is None or not self.carry_ready(index) or not _runs_in_this_backward(node):
                return True
        return False

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

    def others_this_step(self, index: int) -> list[int]:
        """The other graphs of this step (their backward ran, runs, or is still to come)."""
        return [g.index for g in self.graphs if g.index != index and self.runs(g.index)]

    def shared_this_step(self, index: int, names: Iterable[str]) -> set[str]:
        """Which of ``names`` another graph of this step also reads (its gradient comes in parts)."""
        wanted = set(names)
        return {n for g in self.graphs if g.index != index and self.runs(g.index) for n in g.params & wanted}

    def on_end_of_step(self, listener: Callable[[], None]) -> None:
        """Run ``listener`` at the end of every synchronising backward, in registration order."""
        self._listeners.append(listener)

    def _eager_backward(self, _grad_outputs: Any = None) -> None:
        self.synchronising_backward(None)

    def synchronising_backward(self, index: int | None = None) -> None:
        """A synchronising backward of graph ``index`` starts (its node is alive while it runs:
        the first of its runs not started yet is this one; with two alive the graph falls back
        either way); the step ends when the whole backward is done (a callback queued once per
        backward)."""
        for run in self._runs.get(index, ()) if index is not None else ():
            if not run.started and run.node() is not None:
                run.started = True
                break
        self.queue_end()

    def queue_end(self) -> None:
        """Make sure the end of this backward ends the step (once per backward; called from
        inside it: a backward graph, or a gradient eager code gave a parameter)."""
        if self._end_queued:
            return
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_step)

    def _forget_started(self) -> None:
        """Runs whose backward started belong to a step that is over; those still waiting
        count for the next one."""
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


def _runs_in_this_backward(node: Any) -> bool:
    """Will the running backward execute ``node``, or is it executing it now? torch's
    ``_will_engine_execute_node`` leaves the graph task's root out when the backward starts at
    one node (its ``nodes_in_graph`` holds what the root leads to): a backward called on a
    compiled graph's own output (a Hugging Face model's ``.loss``, computed inside the graph)
    starts at that graph's node, which the check then calls unexecuted while it runs."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return (current is not None and node is current()) or torch._C._will_engine_execute_node(node)
