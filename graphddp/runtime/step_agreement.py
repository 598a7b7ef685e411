"""A step's agreement with the other ranks: the half of :class:`~graphddp.runtime.step.StepState`
that talks to them. A base of ``StepState`` only: the fields it reads and writes are declared in
``StepState.__init__``, the step stays their one owner.

Every synchronising backward graph with buckets first agrees in band (:meth:`agree`): one small
maximum over ranks of a hash of its wire layout, its position in the step and the synchronising
forwards the step ran, plus flags. Equal everywhere (the static case), the graph runs its compiled
all-reduces. Different (control flow used other parameters, or ranks ran other numbers of graphs),
asked for by a joined rank, or with parameters eager code may give a gradient, the step is
divergent on every rank at once: every later graph of it runs its local backward and hands its
gradients to the step, and the end of the step averages the union (:mod:`graphddp.runtime.union`).
A flag for an unused gradient source makes the graph agree on which parameters were used
anywhere: the ones used nowhere keep ``grad`` None, as in DDP.
"""
from __future__ import annotations

from typing import Any

import torch

from graphddp.runtime import agree
from graphddp.runtime.agree import PendingProbe, layout_hash, probe_async
from graphddp.runtime.steady import Expected, SteadyHeader, send_deviating


class StepAgreement:
    """The agreement methods of :class:`~graphddp.runtime.step.StepState`."""

    def agree(self, group: Any, digest: int, what: str, unused_here: bool) -> tuple[bool, bool]:
        """Is this step divergent, and did some rank see an unused gradient source? The same
        answer on every rank; once divergent, the step stays so without further checks."""
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
        """:meth:`agree`'s collective, issued now (a gated backward reads it at its first bucket);
        :meth:`agreed` finishes it. ``steady``: this graph's one bucket's ``(numel, dtype)`` where
        it could carry its next agreements."""
        position, self.probed = self.probed, self.probed + 1
        return self._ask(group, position, self._layout(digest, position), self._flags(position, unused_here), what, steady)

    def _layout(self, digest: int, position: int) -> int:
        """The hash an agreement at ``position`` compares, kept: every step asks the same."""
        key = (digest, position, self.expected)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 1024:  # positions x layouts: a handful, unless graphs keep changing
                self._layouts.clear()
            layout = self._layouts[key] = layout_hash(key)
        return layout

    def _alone(self, group: Any) -> bool:
        """``agree.nothing_to_agree(group)``, asked once per group (a steady backward asks every
        step); read through the module, where a test that agrees at world size 1 patches it."""
        if self._solo is None or self._solo[0] is not group:
            self._solo = (group, agree.nothing_to_agree(group))
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
        position is steady; None where the classic probe asks."""
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
        """The classic probe at a steady position whose header some rank raised: every rank asks
        it next, at the same position, with the same flags."""
        return self._ask(group, header.position, header.layout, header.flags, what, steady)

    @staticmethod
    def goes_on(pending: PendingProbe) -> bool:
        """Does the agreement let a synchronising graph issue its buckets as compiled? Reads the answer."""
        same, (join_asks, eager, unused, _carrying, blocked, _unsteady) = pending.result()
        return same and not (join_asks or eager or unused or blocked)

    def agreed(self, pending: PendingProbe) -> tuple[bool, bool]:
        """What :meth:`agree` returns, from its collective. Records or forgets the position's
        steady expectation from the answer, which every rank reads alike."""
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
        """Rules carrying out on this rank, at the step's first agreement: a fact of its forward, a
        graph without a carrying variant, or one whose forward ran but whose backward this backward
        will not run (its accumulated gradients would stay unaveraged)."""
        if self._carry_blocked:
            return True
        for index, ref in self._carry_graphs.items():
            node = ref()
            if node is None or not self.carry_ready(index) or not _runs_in_this_backward(node):
                return True
        return False


def _runs_in_this_backward(node: Any) -> bool:
    """Will the running backward execute ``node``, or is it executing it now? torch's
    ``_will_engine_execute_node`` calls the root unexecuted when the backward starts at it (a
    backward on a compiled graph's own output, a Hugging Face model's ``.loss``)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return (current is not None and node is current()) or torch._C._will_engine_execute_node(node)
