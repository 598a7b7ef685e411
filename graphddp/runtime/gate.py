"""The agreement read where it is needed: at the first bucket's issue, not before the backward.

Why. Every synchronising backward graph with buckets agrees with the other ranks first
(:meth:`graphddp.runtime.step.StepState.agree`): a small collective whose answer says whether
the buckets about to go on the wire pair with every other rank's. Read before the backward,
the host waits for a round trip with nothing to hide it behind: where ranks share busy cores it
can be all of graphddp's per-iteration gap to ``DDP(torch.compile)`` (nanoGPT's loop:
docs/design-agreement-overlap.md), and on a GPU it is time the GPU waits for the host (docs/gpu.md). Here the agreement is issued when the backward
starts and read when its first bucket is issued: by then the backward has computed that
bucket's gradients, and the round trip has usually come back.

How, without a branch in the graph. A compiled graph cannot branch on the answer, so the
choice is made where every bucket's collective goes: the graph issues its all-reduces on
:class:`Gate`, a process group of graphddp's registered under its own name
(:func:`gate_name`) that wraps the user's group. While a backward runs, the gate is armed
(:class:`Armed`) with that backward's pending agreement; its first all-reduce reads the
answer, and then each bucket:

* when the agreement lets the step go on (:meth:`StepState.goes_on`), has the gradients this
  rank accumulated under ``no_sync`` added (carrying, as DDP's bucket after ``no_sync`` holds
  their sum), is divided by the world size (DDP pre-divides) and all-reduced on the user's
  group: the same arithmetic as DDP's, in the same order;
* otherwise is held: nothing goes on the wire, the buffer keeps this rank's own gradients
  (not divided, nothing carried), and the graph returns them. The dispatcher then does what a
  step that agreed before its backward would have done, with these local gradients in place
  of a local backward (:meth:`graphddp.runtime.dispatch.BackwardDispatch._gated`).

That is why a gated bucket has no division in the graph: the local gradients must come back
exactly. Only where every collective of the graph can be held without having changed
anything: replicated buckets with the built-in hook, no optimizer inside the backward, no
compression (see :meth:`graphddp.compiler.rewrite.BackwardRewrite.gates`). Every other
configuration agrees before its backward as before. Every rank of one configuration gates
alike, so the collectives that follow an answer are the same on every rank.

Once a graph of one CPU bucket is steady (:mod:`graphddp.runtime.steady`) there is no separate
agreement: its all-reduce carries it as a header (:meth:`Armed._issue_with_header`), and the
answer is read from that all-reduce's sum.
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


class Armed:
    """One gated backward: its agreement, and what its buckets do once it is read.

    ``carried``: per bucket in issue order, ``(offset, accumulated gradient)`` per slot, added
    to the bucket before it is divided when the step goes on (dropped bucket by bucket, so
    carrying holds no more memory than the carrying graph did)."""

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
        """The agreement's answer (waits for it once): the classic probe's, or the header's
        sum, which the first bucket's all-reduce brings back."""
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
        """The first bucket at a steady position: the payload and the header in one all-reduce
        (:mod:`graphddp.runtime.steady`); the average is copied into the bucket when the graph
        waits for it and no rank raised a flag (:class:`HeaderWork`)."""
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
        with torch.no_grad():
            if self.carried is not None:
                for offset, grad in self.carried[index]:
                    flat.narrow(0, offset, grad.numel()).add_(grad.view(-1))
                self.carried[index] = []
            flat.div_(self.world)
        return inner.allreduce(list(tensors), opts)


class HeaderWork(dist.Work):
    """A steady header's all-reduce as its graph waits for it: on the waiting thread, once it
    completes, the header read and, where no rank raised a flag, the average copied into the
    bucket, before the graph reads the bucket.

    Why a work of our own and not a callback on the collective's future: the callback runs on
    gloo's thread and, being Python, takes the interpreter's lock from the thread that waits for
    it; with both ranks computing on every core that hand-over cost the synchronising backward
    a scheduling round trip per step."""

    def __init__(self, work: Any, header: SteadyHeader, wire: torch.Tensor, flat: torch.Tensor) -> None:
        super().__init__()
        self.work = work
        self.header = header
        self.wire = wire
        self.flat = flat
        self._goes_on: bool | None = None

    def answer(self) -> bool:
        """Waits for the all-reduce (once; a failed one raises here, in the graph's wait) and
        says whether the step goes on, the bucket then holding the average."""
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
    """The user's group as a gated graph sees it (module docstring): all-reduces go through the
    armed backward; a gated graph has no other collective."""

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
        """Route this thread's gated all-reduces to ``armed`` (None: to nothing, after its
        backward): set around the graph's call, in a ``try``/``finally``."""
        self._local.armed = armed


_GATES: dict[str, Gate] = {}


def gate_for(group: Any) -> Gate:
    """The gate of ``group``, registered under :func:`gate_name` of its name. Registered again
    when the name no longer resolves to it (a process group destroyed and made anew: names
    are reused)."""
    name = gate_name(group_name_of(group))
    gate = _GATES.get(name)
    if gate is None or gate.inner is not group or not _registered(name, gate):
        gate = _GATES[name] = Gate(group)
        if _resolved(name) is not None:
            _unregister_process_group(name)
        _register_process_group(name, gate)
    return gate


def _registered(name: str, gate: Gate) -> bool:
    return _resolved(name) is gate


def _resolved(name: str) -> Any:
    """The process group registered as ``name``, or None."""
    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
