"""The agreement read where it is needed: at the first bucket's issue, not before the backward.

Read before the backward, the agreement (:meth:`graphddp.runtime.step.StepState.agree`) makes the
host wait a round trip with nothing to hide it behind: on busy shared cores, and on a GPU waiting
for the host, that is time lost every step. Issued when the backward starts and read at its first
bucket's issue, the round trip has usually come back by then.

A compiled graph cannot branch on the answer, so the choice is made where every bucket's
collective goes: the graph all-reduces on :class:`Gate`, a process group registered under its own
name that wraps the user's group and is armed (:class:`Armed`) with the running backward's
agreement. When the step goes on, each bucket has what it carries from ``no_sync`` added, is
divided by the world size and all-reduced: DDP's arithmetic, in DDP's order. Otherwise each is
held, undivided, and the graph returns this rank's own gradients, so that the dispatcher does what
a step that agreed before its backward would have done. That is why a gated bucket has no division
in the graph, and why only configurations whose every collective can be held unchanged gate
(:meth:`graphddp.compiler.rewrite.BackwardRewrite.gates`); every rank of one configuration gates
alike.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    _create_work_from_future,
    _register_process_group,
    _unregister_process_group,
)
from torch.distributed.distributed_c10d import _resolve_process_group

from graphddp.runtime.agree import PendingProbe
from graphddp.runtime.steady import SteadyHeader
from graphddp.runtime.step import StepState
from graphddp.values.comm import gate_name, group_name_of


def carry_and_divide(flat: torch.Tensor, carried: Sequence[tuple[int, torch.Tensor]], world: int) -> None:
    """DDP's arithmetic on a bucket: the gradients it carries, ``(offset, gradient)`` per slot, added,
    then divided by the world size."""
    with torch.no_grad():
        for offset, grad in carried:
            flat.narrow(0, offset, grad.numel()).add_(grad.view(-1))
        flat.div_(world)


class Armed:
    """One gated backward: its agreement, and what its buckets do once it is read. ``carried``: per
    bucket, ``(offset, accumulated gradient)`` per slot, dropped bucket by bucket so that carrying
    holds no more memory than the carrying graph did."""

    def __init__(
        self, agreement: PendingProbe | SteadyHeader, world: int, carried: list[list[tuple[int, torch.Tensor]]] | None
    ) -> None:
        self.agreement = agreement
        self.world = world
        self.carried = carried
        self.goes_on: bool | None = None  # read at the first bucket
        self.issued = 0  # buckets issued (or held) so far
        self.held: list[torch.Tensor] = []  # the buckets held, in issue order (local, undivided)
        # A steady header (graphddp.runtime.steady): its all-reduce, as the graph waits for it.
        self._header: HeaderWork | None = None

    def read(self) -> bool:
        """The agreement's answer (waits for it once): the probe's, or the header's sum."""
        if self.goes_on is None:
            if isinstance(self.agreement, SteadyHeader):
                assert self._header is not None, "a steady header is read after its bucket's issue"
                self.goes_on = self._header.answer()
                if self.goes_on:
                    if self.carried is not None:
                        self.carried[0] = []
                else:
                    self.held.append(self._header.flat)  # this rank's own gradients: the payload was a copy
            else:
                self.goes_on = StepState.goes_on(self.agreement)
        return self.goes_on

    def _issue_with_header(self, flat: torch.Tensor, opts: AllreduceOptions, inner: Any) -> Any:
        """The first bucket at a steady position: the payload and the header in one all-reduce."""
        header = self.agreement
        assert isinstance(header, SteadyHeader)
        carried = self.carried[0] if self.carried is not None else ()
        wire = header.wire(flat, carried, self.world)
        self._header = HeaderWork(inner.allreduce([wire], opts), header, wire, flat)
        return self._header

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: AllreduceOptions, inner: Any) -> Any:
        index, self.issued = self.issued, self.issued + 1
        (flat,) = tensors
        if index == 0 and isinstance(self.agreement, SteadyHeader):
            return self._issue_with_header(flat, opts, inner)
        if not self.read():
            self.held.append(flat)
            # A work already done, holding no tensor: a future holding CUDA tensors would have
            # to name their devices, and the graph's wait reads nothing from it.
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([])
            return _create_work_from_future(done)
        carry_and_divide(flat, self.carried[index] if self.carried is not None else (), self.world)
        if self.carried is not None:
            self.carried[index] = []
        return inner.allreduce(list(tensors), opts)


class HeaderWork(dist.Work):
    """A steady header's all-reduce as its graph waits for it: the header read and, where no rank
    raised a flag, the average copied into the bucket, on the waiting thread. Not a callback on
    the collective's future: that runs on gloo's thread and takes the interpreter's lock from the
    waiting one, a scheduling round trip per step on busy cores."""

    def __init__(self, work: Any, header: SteadyHeader, wire: torch.Tensor, flat: torch.Tensor) -> None:
        super().__init__()
        self.work = work
        self.header = header
        self.wire = wire
        self.flat = flat
        self._goes_on: bool | None = None

    def answer(self) -> bool:
        """Waits for the all-reduce once (a failure raises here, in the graph's wait)."""
        if self._goes_on is None:
            self.work.wait()
            self._goes_on = self.header.goes_on(self.wire)
            if self._goes_on:
                with torch.no_grad():
                    self.flat.copy_(self.wire[: self.flat.numel()])
        return self._goes_on

    def wait(self, timeout: Any = None) -> bool:
        self.answer()
        return True


class Gate(dist.ProcessGroup):
    """The user's group as a gated graph sees it: all-reduces go through the armed backward."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        # Per thread: a backward runs on one thread (autograd's device thread on a GPU), and
        # another model's backward on another thread must not read this one's agreement.
        self._local = threading.local()

    def allreduce(self, tensor_list: Sequence[torch.Tensor], opts: AllreduceOptions = AllreduceOptions()) -> Any:
        armed = getattr(self._local, "armed", None)
        if armed is None:
            raise RuntimeError(
                "graphddp: a gated all-reduce ran outside the backward that owns it; gated graphs are called only "
                "through graphddp's dispatcher. Please report this with the model."
            )
        return armed.allreduce(tensor_list, opts, self.inner)

    def arm(self, armed: Armed | None) -> None:
        """Route this thread's gated all-reduces to ``armed`` (None after its backward)."""
        self._local.armed = armed


_GATES: dict[str, Gate] = {}


def gate_for(group: Any) -> Gate:
    """The gate of ``group``, registered anew when its name no longer resolves to it (a process
    group destroyed and made anew reuses names)."""
    name = gate_name(group_name_of(group))
    gate = _GATES.get(name)
    if gate is None or gate.inner is not group or _resolved(name) is not gate:
        gate = _GATES[name] = Gate(group)
        if _resolved(name) is not None:
            _unregister_process_group(name)
        _register_process_group(name, gate)
    return gate


def _resolved(name: str) -> Any:
    """The process group registered as ``name``, or None."""
    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
