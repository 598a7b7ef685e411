"""The agreement carried in the bucket's own all-reduce, once a position of the step is steady.

For a backward graph of one bucket the agreement before the bucket makes two collectives a step
where DDP issues one, and on busy cores each costs a round trip the backward cannot hide. Once a
position of the step (its n-th synchronising backward graph) has agreed on a layout whose one
bucket is replicated, gated and on the CPU, that layout is expected there (:class:`Expected`,
recorded from an answer every rank read alike). From then on the agreement is a header of
:data:`HEADER` elements after the payload, in the bucket's one all-reduce: each rank writes 1
where it deviates from the expectation or raises a flag of the agreement, and a sum of 0
everywhere means what the classic agreement's go-on means: the payload is the average.

It cannot hang or average wrongly: the all-reduce's size is the expectation's, not the rank's (a
deviating rank sends zeros with its flag raised), every rank reads the same sum, on a raised flag
no rank uses the payload and every rank asks the classic agreement at the same position next. A
raised flag never sums to 0 in any float dtype, so bf16 buckets carry it too. Not in a join
context, on a GPU (the host would wait for the collective to read the header), for a graph of
several buckets, or on a group of one rank.
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
        """What the position's all-reduce sends, payload then header: kept from step to step, as DDP
        keeps its buckets (a fresh one would pay the page faults of its first touch every step)."""
        return torch.empty(self.numel + HEADER, dtype=self.dtype)


class SteadyHeader:
    """One steady position's agreement, as the header of its bucket's all-reduce. ``flags``: the
    classic agreement's; ``layout``: this rank's layout hash at this position."""

    def __init__(self, position: int, expected: Expected, layout: int, flags: tuple[bool, ...], out: torch.Tensor) -> None:
        self.position = position
        self.expected = expected
        self.layout = layout
        self.flags = flags
        self.out = out  # the position's send buffer (Expected.buffer)

    def deviates(self, flat: torch.Tensor | None) -> bool:
        """Does this rank deviate from the expectation (``flat`` None: it has no bucket to send)?"""
        e = self.expected
        return flat is None or self.layout != e.layout or flat.numel() != e.numel or flat.dtype != e.dtype

    def wire(self, flat: torch.Tensor | None, carried: Sequence[tuple[int, torch.Tensor]], world: int) -> torch.Tensor:
        """What this rank all-reduces: ``(flat + carried) / world`` (the gate's arithmetic), then
        the header; zeros where it deviates. ``flat`` is not written. The carried slots tile the
        bucket, so that one concatenation and one add replace an add per parameter."""
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
    """A path with no bucket at a steady position: the header's all-reduce with this rank's
    deviation raised, so that it pairs with every other rank's."""
    dist.all_reduce(header.wire(None, (), 1), group=group)
