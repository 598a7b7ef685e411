"""Which backward runs, the synchronising one or the local one: decided per forward call.

DDP decides at forward time whether the coming backward communicates (``no_sync`` clears
``require_backward_grad_sync``, the forward reads it). graphddp does the same, per compiled graph
and per call, without Dynamo guards: a guard lives in one frame, and after a graph break the inner
frames are compiled without it. A forward under ``no_sync`` registers a pre-hook on the autograd
node of that call, which tells the dispatcher to run the local variant once. Before its
collectives a synchronising variant agrees with the other ranks; in a divergent step it runs
locally and hands its gradients to the union average (:mod:`graphddp.runtime.union`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from graphddp.runtime.agree import CollectiveError, layout_hash
from graphddp.runtime.failures import collective_failure
from graphddp.runtime.gate import Armed, Gate, carry_and_divide
from graphddp.runtime.gathers import Pending
from graphddp.runtime.step import NotInside, StepState
from graphddp.runtime.usage import GradientUsage
from graphddp.runtime.variants import GraphState, InGraphUpdate, Synced
from graphddp.values.schedule import Schedule


class BackwardDispatch:
    """The compiled backward AOTAutograd calls: the local or a synchronising variant (``phase``
    picks which; ``on_sync`` runs before it)."""

    def __init__(
        self,
        state: GraphState,
        variants: dict[str, Synced],
        compile_plain: Callable[[], Callable[[list[Any]], Any]],
        group: Any,
        step: StepState,
        phase: Callable[[], str] | None = None,
        on_sync: Callable[[Synced], None] | None = None,
        carry: Synced | None = None,
        parameters: Mapping[str, torch.nn.Parameter] | None = None,
        gate_carries: bool = False,
        gate: Gate | None = None,
    ) -> None:
        # Called with one list of arguments, which the callee may free. An instance attribute:
        # wrappers (torch._dynamo.disable) copy __dict__, not class attributes.
        self._boxed_call = True
        self.state = state
        self.variants = variants
        self._compile_plain = compile_plain
        self._plain: Callable[[list[Any]], Any] | None = None
        self.group = group
        self.step = step
        self.phase = phase or (lambda: next(iter(variants)))
        self._on_sync = on_sync
        # The carrying variant: the synchronising one whose buckets also take the gradients
        # accumulated under no_sync (``parameters`` holds them, by name, until it takes them).
        self.carry = carry
        self.parameters = dict(parameters or {})
        self.usage = GradientUsage.of_schedule(next(iter(variants.values())).schedule)
        # A gated graph's all-reduces go through its group's gate, registered by the compiler before
        # the graph was compiled; it carries through the gate, with no variant of its own.
        self.gate_carries = gate_carries
        self.gate = gate

    @property
    def can_carry(self) -> bool:
        """Can this graph's synchronising backward take the gradients accumulated under no_sync?"""
        return self.carry is not None or self.gate_carries

    @property
    def schedule(self) -> Schedule:
        """The plan of the synchronising variant the next step runs."""
        return self.variants[self.phase()].schedule

    def __call__(self, args: list[Any]) -> Any:
        local = self.state.take_local()
        renamed = self.state.take_renamed()
        unused = self.usage.unused(*self.state.none_outputs.take(), args)
        outputs = self.usage.outputs
        if renamed:  # the graph ran for other parameters (GraphState.rename_next)
            unused = frozenset(renamed[n] for n in unused)
            outputs = {renamed[n]: i for n, i in outputs.items()}
        if local:
            return GradientUsage.drop(self.plain()(args), outputs, unused)
        synced = self.variants[self.phase()]
        schedule, digest = synced.schedule, synced.digest
        if renamed:
            schedule = schedule.renamed(renamed)
            digest = layout_hash(schedule.wire_layout())
        divergent = False
        if schedule.gated and not self.step.divergent:
            return self._gated(synced, schedule, digest, args, unused, outputs, renamed)
        if schedule.buckets:
            what = synced.what
            divergent, some_unused = self.step.agree(self.group, digest, what, bool(unused))
            if some_unused and not divergent:  # which of them did no rank use
                unused = self._unused_anywhere(schedule, unused)
        self.step.synchronising_backward(schedule.graph_index)
        if divergent:
            return self._contribute(schedule, list(self.plain()(args)), unused, outputs)
        if self.carry is not None and not renamed and self.step.take_carried():
            synced = self.carry
            args.extend(self._take_accumulated(synced.schedule))
        if self._on_sync is not None:
            self._on_sync(synced)
        args.extend(synced.hook_args())  # inputs after the graph's own, before the update's
        if synced.update is not None:
            # Another module's parameters: the compiled update would write the compiled ones.
            update = synced.update
            out = self._named_failures(schedule, lambda: self._with_update(synced, update, args, unused, bool(renamed)))
        else:
            out = self._named_failures(schedule, lambda: synced.code()(args))
        return GradientUsage.drop(out, outputs, unused)

    @staticmethod
    def _named_failures(schedule: Schedule, run: Callable[[], Any]) -> Any:
        """``run()``; a collective of the graph that fails is re-raised naming graphddp, the graph
        and the bucket (an agreement that fails names itself already)."""
        try:
            return run()
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as-is unless a collective failed
            failure = collective_failure(e, schedule)
            if failure is None:
                raise
            raise failure from e

    def _gated(
        self, synced: Synced, schedule: Schedule, digest: int, args: list[Any], unused: frozenset[str],
        outputs: dict[str, int], renamed: dict[str, str] | None,
    ) -> Any:
        """A gated graph (:mod:`graphddp.runtime.gate`): its agreement issued now and read at its
        first bucket's issue. When the answer stops it, its buckets were held and it returned this
        rank's own gradients; then this does what :meth:`__call__` does after an answer read
        before the backward, in the same order of collectives (every rank of this configuration
        gates): the local gradients to the union average, or the held buckets all-reduced now."""
        what, steady = synced.what, synced.steady
        header = self.step.steady_header(self.group, digest, bool(unused)) if steady is not None else None
        agreement = header or self.step.agree_async(self.group, digest, what, bool(unused), steady)
        self.step.synchronising_backward(schedule.graph_index)
        taken: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        carried = None
        if self.gate_carries and not renamed and self.step.take_carried():
            carried, taken = self._carried_by_bucket(schedule)
        armed = Armed(agreement, schedule.world_size, carried)
        assert self.gate is not None, "a gated graph's dispatcher is given its gate"
        self.gate.arm(armed)
        try:
            out = self._named_failures(schedule, lambda: synced.code()(args))
        finally:
            self.gate.arm(None)
        if armed.read():  # read already at the first bucket's issue (a gated graph has buckets)
            if header is None:
                self.step.agreed(agreement)
            else:
                counters["graphddp"]["agreement_in_bucket"] += 1
            return out
        self.state.held += 1
        if header is not None:  # some rank raised a flag in the header: the classic probe, here
            pending = self.step.probe_after(header, self.group, what, steady)
            if self.step.goes_on(pending):  # every rank changed alike: the held buckets go on as compiled
                self.step.agreed(pending)
                self._issue_held(armed, schedule, carried)
                return out
        else:
            pending = agreement
        for param, grad in taken:  # the gate added none of them: back where they were
            param.grad = grad
        divergent, some_unused = self.step.agreed(pending)
        if divergent:
            return self._contribute(schedule, list(out), unused, outputs)
        if some_unused:
            unused = self._unused_anywhere(schedule, unused)
        self._issue_held(armed, schedule, None)
        return GradientUsage.drop(out, outputs, unused)

    def _issue_held(self, armed: Armed, schedule: Schedule, carried: list[list[tuple[int, torch.Tensor]]] | None) -> None:
        """The held buckets, with the gradients ``carried`` added, divided and all-reduced now in
        issue order: what every other rank's compiled buckets do."""
        for index, flat in enumerate(armed.held):
            carry_and_divide(flat, carried[index] if carried is not None else (), schedule.world_size)
            try:
                dist.all_reduce(flat, group=self.group)
            except Exception as e:  # noqa: BLE001 - any backend failure, re-raised with context
                raise CollectiveError.of(
                    f"the all-reduce of bucket {index} of backward graph {schedule.graph_index} (held by its agreement "
                    "and issued after it)", e,
                ) from e

    def _unused_anywhere(self, schedule: Schedule, unused: frozenset[str]) -> frozenset[str]:
        """Which of this graph's parameters no rank used (one OR over ranks)."""
        return GradientUsage.unused_anywhere((s.param_name for b in schedule.buckets for s in b.slots), unused, self.group)

    def _carried_by_bucket(
        self, schedule: Schedule
    ) -> tuple[list[list[tuple[int, torch.Tensor]]], list[tuple[torch.nn.Parameter, torch.Tensor | None]]]:
        """:meth:`_take_accumulated` for a gate: per bucket, ``(offset, gradient)`` per slot; and
        each parameter with the ``grad`` it had, to put back if the gate holds the buckets."""
        taken = [(self.parameters[s.param_name], self.parameters[s.param_name].grad) for b in schedule.buckets for s in b.slots]
        flat = iter(self._take_accumulated(schedule))
        return [[(off, next(flat)) for off in b.offsets()] for b in schedule.buckets], taken

    def _take_accumulated(self, schedule: Schedule) -> list[torch.Tensor]:
        """The carried inputs, in bucket and slot order: each parameter's accumulated gradient
        (zeros where it has none), taken out of ``.grad`` so that autograd sets the bucket's
        average there instead of adding it to what was accumulated."""
        taken = []
        for bucket in schedule.buckets:
            for slot in bucket.slots:
                param = self.parameters[slot.param_name]
                grad = param.grad
                if grad is None:
                    grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
                elif not grad.is_contiguous():
                    grad = grad.contiguous()
                taken.append(grad)
                param.grad = None
        return taken

    def _contribute(self, schedule: Schedule, out: list[Any], unused: frozenset[str], outputs: dict[str, int]) -> Any:
        """This rank's gradients in ``out`` handed to the step's union average; none to autograd."""
        grads = {}
        for name, index in outputs.items():
            if out[index] is not None:
                grads[name], out[index] = out[index], None
        self.step.contribute(schedule, grads, (n for n in grads if n not in unused))
        return out

    def _with_update(self, synced: Synced, update: InGraphUpdate, args: list[Any], unused: frozenset[str], other: bool) -> Any:
        index = synced.schedule.graph_index
        reason = NotInside("other parts", update.names) if other else update.not_inside(unused)
        if reason is not None:
            self.step.count_update(index, reason.kind)
            return update.after(args)
        out = update.inside(synced.code, args)
        deferred = update.deferred_shards
        if deferred:  # the all-gathers after the gradients: the next forward's
            out = list(out)
            tensors = out[len(out) - len(deferred):]
            del out[len(out) - len(deferred):]
            names = frozenset(n for s in deferred for n in s.bucket.param_names)
            self.step.gathers.put(synced.schedule.graph_index, Pending(names, tensors, update.write_deferred))
        self.step.count_update(index, "inside")
        return out

    def plain(self) -> Callable[[list[Any]], Any]:
        if self._plain is None:
            self._plain = self._compile_plain()
            self.state.plain_compiles += 1
        return self._plain
