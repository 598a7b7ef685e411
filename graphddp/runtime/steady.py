"""The agreement carried in the bucket's own all-reduce, once a position of the step is steady.

Why. Every synchronising backward graph agrees with the other ranks before its buckets go on
the wire (:meth:`graphddp.runtime.step.StepState.agree`): one small collective, then the
buckets. For a model whose backward graph has one bucket (nanoGPT's small GPT, any model up to
a bucket's size) that is two collectives a step where ``DDP`` issues one, and where ranks share
busy cores each costs a round trip the backward cannot hide, which can be all of graphddp's
remaining per-iteration gap to ``DDP(torch.compile)`` (nanoGPT's loop on CPU ranks:
docs/design-agreement-overlap.md).

What. Once a position of the step (its n-th synchronising backward graph) has agreed with every
rank on a layout whose one bucket is replicated, gated (:mod:`graphddp.runtime.gate`) and on the
CPU, that layout is *expected* there (:class:`Expected`, the same on every rank because it is
recorded from an answer every rank read alike). From then on, the agreement at that position is
a header of :data:`HEADER` elements after the bucket's payload, in the bucket's one all-reduce
(:class:`SteadyHeader`): each rank writes 1 where it deviates from the expectation (another
layout, another wire size) or raises a flag of the agreement (joined, eager gradients, an unused
gradient source, unable to carry), 0 elsewhere. The sum over ranks is 0 everywhere exactly when
the classic agreement would have let the step go on: then the payload is the bucket's average,
as it would have been.

Why it cannot hang or average wrongly. The all-reduce's size is the expectation's, not the
rank's: a rank that deviates sends zeros of the expected size and dtype with its flag raised, so
the collective pairs whatever each rank ran. Every rank reads the same sum; on any raised flag
no rank uses the payload (it is written to a scratch buffer, so the bucket keeps this rank's own
gradients), and every rank asks the classic agreement at the same position next
(:meth:`graphddp.runtime.dispatch.BackwardDispatch._gated`), whose answer decides as before.
Every other path that agrees at a steady position (a graph that is not gated, eager gradients
alone, see :meth:`StepState.agree`) sends the deviating header first, then the classic probe,
so the collective sequence pairs on every rank. A flag's sum never rounds to 0 from a raised
flag in any float dtype, so a bf16 or fp16 bucket carries it too.

Where not. A join context (its joined ranks shadow the classic agreement), a GPU (the header is read and
the payload copied back on the host when the graph waits, which on a GPU would hold the host
until the collective completes; classic there, not yet measured),
a graph of more than one bucket (its second bucket would wait for the whole first all-reduce
instead of a small round trip), a group of one rank.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist

HEADER = 8  # elements after the payload: the deviation flag, the agreement's four, padding


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a steady position's graph puts on the wire: the layout hash every rank agreed on
    there, and its one bucket's elements and dtype."""

    layout: int
    numel: int
    dtype: torch.dtype

    def buffer(self) -> torch.Tensor:
        """What the position's all-reduce sends, payload then header: one per steady position,
        kept from step to step (:meth:`graphddp.runtime.step.StepState.steady_header`), as DDP
        keeps its buckets; a fresh one each step cost the page faults of its first touch."""
        return torch.empty(self.numel + HEADER, dtype=self.dtype)


class SteadyHeader:
    """One steady position's agreement, as the header of its bucket's all-reduce (module
    docstring). ``flags``: the classic agreement's (joined, eager, unused here, carrying,
    unable to carry); ``layout``: this rank's layout hash at this position."""

    def __init__(self, position: int, expected: Expected, layout: int, flags: tuple[bool, ...], out: torch.Tensor) -> None:
        self.position = position
        self.expected = expected
        self.layout = layout
        self.flags = flags
        self.out = out  # the position's send buffer (Expected.buffer)

    def deviates(self, flat: torch.Tensor | None) -> bool:
        """Does this rank deviate from the expectation (``flat``: its bucket, None for a path
        that has no bucket to send)?"""
        e = self.expected
        return flat is None or self.layout != e.layout or flat.numel() != e.numel or flat.dtype != e.dtype

    def wire(self, flat: torch.Tensor | None, carried: Sequence[tuple[int, torch.Tensor]], world: int) -> torch.Tensor:
        """What this rank all-reduces: its bucket with the gradients it carries added, divided
        by the world size (the gate's arithmetic: each element ``(new + carried) / world``),
        then the header; zeros of the expected size in place of the bucket where it deviates.
        ``flat`` is not written. ``carried``: ``(offset, gradient)`` per slot, in slot order;
        the slots tile the bucket (:meth:`graphddp.values.schedule.Bucket.offsets`), so the
        carried gradients, concatenated, are the bucket's layout: one concatenation and one
        add, not an add per parameter."""
        e = self.expected
        out = self.out
        payload, header = out[: e.numel], out[e.numel:]
        deviates = self.deviates(flat)
        header.zero_()
        joined, eager, unused, _carrying, blocked = self.flags
        for i, raised in enumerate((deviates, joined, eager, unused, blocked)):
            if raised:
                header[i] = 1
        if deviates:
            payload.zero_()
            return out
        with torch.no_grad():
            if carried:
                torch.cat([grad.view(-1) for _, grad in carried], out=payload)
                payload.add_(flat.view(-1))  # carried + new: the same sum as new + carried
                payload.div_(world)
            else:
                torch.div(flat.view(-1), world, out=payload)
        return out

    def goes_on(self, wire: torch.Tensor) -> bool:
        """After the all-reduce: did no rank raise a flag (the payload is the average)?"""
        return not bool(wire[self.expected.numel:].any())


def send_deviating(header: SteadyHeader, group: Any) -> None:
    """A path with no bucket to send at a steady position (module docstring): the header's
    all-reduce with this rank's deviation raised, so that it pairs with every other rank's."""
    dist.all_reduce(header.wire(None, (), 1), group=group)
