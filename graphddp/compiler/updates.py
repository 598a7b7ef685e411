"""The attached optimizer's side of the compiler: updates inside the backward, and when not.

Each backward graph goes on after its collectives: which parameters it can update itself, the
sharded plan (``sharding="optimizer"``), with_updates -> insert_update -> verify_updates, and the
variant without the update for steps the graph cannot update alone. At run time an
``InGraphUpdate`` decides step by step whether the graph's update is the whole step
(``GraphRecord.fallbacks`` records when not). Mixed into GraphCompiler, whose attributes it reads.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Callable, Mapping

import torch.fx as fx

from graphddp.compiler.compose import Shared
from graphddp.compiler.record import GraphRecord
from graphddp.graph.insert_comm import insert_collectives
from graphddp.optim.insert_shard import insert_sharded_updates
from graphddp.optim.shard_functions import shard_layout
from graphddp.optim.insert_update import UpdateInputs, insert_update, written_inputs
from graphddp.optim.verify import verify_sharded, verify_updates
from graphddp.plan.planner import with_sharding, with_updates
from graphddp.runtime.step import NotInside
from graphddp.runtime.variants import InGraphUpdate
from graphddp.values.collectives import ALL_REDUCE, SHARDED
from graphddp.values.schedule import Schedule

log = logging.getLogger("graphddp")


class InGraphUpdates:
    """GraphCompiler's passes and run-time decisions for an optimizer attached to the backward."""

    def _in_graph_update(
        self, record: GraphRecord, graph_index: int, compile_grads: Callable[[], Any] | None
    ) -> InGraphUpdate | None:
        optimizer = self.optimizer
        names = tuple(n for b in record.schedule.buckets for n in b.updates)
        if optimizer is None or not names:
            return None
        sharded = [b for b in record.schedule.buckets if b.collective == SHARDED]
        replicated = tuple(n for b in record.schedule.buckets if b not in sharded for n in b.updates)
        shards = tuple(
            shard_layout(b, {n: optimizer.rule(n) for n in b.param_names}, optimizer.group_of, record.schedule.placement, optimizer.sharded.rank)
            for b in sharded
        )

        clip = record.schedule.max_grad_norm is not None
        # With clipping the norm covers every gradient of the step, the returned ones too.
        graded = tuple(s.param_name for b in record.schedule.buckets for s in b.slots if not s.zero_filled) if clip else names
        tensors = {**self.parameters, **optimizer.params}

        def not_inside(unused: frozenset[str]) -> NotInside | None:
            """None where the graph's update is the whole step for its parameters; otherwise torch's
            step runs for them after the backward, and the reason is recorded."""
            held = tuple(n for n in graded if n in tensors and tensors[n].grad is not None)
            reason = self.step.not_inside(
                graph_index, names, scaled=optimizer.scaled, unused=unused, held=held, in_norm=self._has_gradients if clip else None
            )
            if reason is not None:
                record.fell_back(reason.kind, reason.names, reason.why, self._warned)
            return reason

        return InGraphUpdate(optimizer, replicated, not_inside, compile_grads, written_inputs(record.graph), shards=shards)

    def _has_gradients(self, graph_index: int) -> bool:
        """Does graph ``graph_index`` read a parameter that takes a gradient (adds to a norm)?"""
        return any(p.requires_grad for n in self.step.graphs[graph_index].params if (p := self.parameters.get(n)) is not None)

    def _updatable(self, schedule: Schedule, graph_index: int, fw_values: Mapping[str, Any]) -> tuple[list[str], tuple[str, ...]]:
        """The parameters the graph can update itself, and those a graph of another frame also
        reads (tied across a graph break: part of their gradient comes from there, so they keep
        torch's step after the backward). Recompiles of this graph's own frame do not count."""
        optimizer = self.optimizer
        elsewhere = self.step.in_other_frames(graph_index)
        zero_filled = {s.param_name for b in schedule.buckets for s in b.slots if s.zero_filled}
        updatable = [
            n for n in schedule.param_names if optimizer.rule(n) and n in fw_values and n not in elsewhere | zero_filled
        ]
        return updatable, tuple(n for n in schedule.param_names if optimizer.rule(n) and n in elsewhere)

    def _shard_plan_pass(self, gm: fx.GraphModule, schedule: Schedule, *, graph_index: int, shared: Shared, **_: Any) -> Schedule:
        """sharding="optimizer": buckets the graph can update whole are reduce-scattered. With
        ``max_grad_norm``, all or none: the norm is one, so a gradient of the optimizer's that
        the graph would leave to the step after the backward (tied across a graph break, or in
        a bucket beside a parameter the optimizer does not hold) leaves every one there, where
        torch clips them together, whole."""
        if not shared.fw_values:
            return schedule
        updatable, tied = self._updatable(schedule, graph_index, shared.fw_values)
        sharded = with_sharding(schedule, updatable, self.config.gather, self.placement)
        if self.config.max_grad_norm is None:
            return sharded
        left = [
            s.param_name for b in sharded.buckets if b.collective != SHARDED
            for s in b.slots if not s.zero_filled and self.optimizer.rule(s.param_name)
        ]
        return schedule if tied or left else sharded

    def _optimizer_pass(self, gm: fx.GraphModule, schedule: Schedule, *, graph_index: int, shared: Shared, carry: bool = False, **_: Any) -> Schedule:
        """The optimizer's backward pass, after the collectives: with_updates -> insert_update ->
        verify_updates, then the sharded buckets. The graph without the updates goes to
        ``shared.without_update`` (None when nothing is updated), the parameters tied across a graph
        break to ``shared.tied``."""
        optimizer, fw_values = self.optimizer, shared.fw_values
        if optimizer is None or not fw_values:
            return schedule
        updatable, tied = self._updatable(schedule, graph_index, fw_values)
        shared.tied = tied
        max_norm = self.config.max_grad_norm
        if max_norm is not None and tied:  # part of the norm comes from another graph: torch clips and steps them all
            updatable = []
        if self.config.sharding == "optimizer":  # the rest of a bucket with a tied parameter: the shard's step after
            updatable = [n for b in schedule.buckets if b.collective == SHARDED for n in b.param_names]
        if tied:
            self._warned.add((graph_index, "shared"))
            warnings.warn(
                f"graphddp: optimizer= : parameters {list(tied)} are read on both sides of a graph break, so their gradient "
                f"comes in parts from several graphs; backward graph {graph_index} leaves their update to torch's step "
                "after the backward (the result is the same, the update is not overlapped)",
                stacklevel=2,
            )
        if not updatable:
            return schedule
        shared.without_update = self._without_update(gm, schedule, shared, carry)
        schedule = with_updates(schedule, updatable, str(optimizer), max_norm, self.config.grad_norm_type)
        inputs = UpdateInputs.of(optimizer, updatable, fw_values)
        insert_update(gm, schedule, inputs)
        log.debug("backward graph %d after insert_update:\n%s", graph_index, gm.code)
        if self.config.verify:
            verify_updates(gm, schedule)
        if insert_sharded_updates(gm, schedule, inputs, rank=optimizer.sharded.rank if optimizer.sharded is not None else self.rank):
            log.debug("backward graph %d after insert_sharded_updates:\n%s", graph_index, gm.code)
            if self.config.verify:
                verify_sharded(gm, schedule)
        return schedule

    def _without_update(self, gm: fx.GraphModule, schedule: Schedule, shared: Shared, carry: bool = False) -> fx.GraphModule:
        """The variant for steps the graph cannot update alone: every gradient averaged (sharded
        buckets all-reduced, from the graph before the collectives) and returned."""
        if shared.before_comm is None:
            return copy.deepcopy(gm)
        graph = copy.deepcopy(shared.before_comm)
        if self.world_size > 1:
            replicated = [dataclasses.replace(b, collective=ALL_REDUCE.key) for b in schedule.buckets]
            insert_collectives(graph, dataclasses.replace(schedule, buckets=tuple(replicated)), carry=carry)
        return graph
