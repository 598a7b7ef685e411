"""One backward graph planned and rewritten, and the facts of the configuration that decide how.

:meth:`BackwardRewrite.rewrite_backward` is capture -> plan -> the backward passes -> verify for
one backward graph, talking to no rank. Beside it, what the configuration decides for every graph
alike, so the same on every rank: whether a step after ``no_sync`` carries, whether graphs are
gated, which hook phase runs next. Mixed into GraphCompiler, whose attributes it reads.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch.fx as fx

from graphddp.compiler.compose import Shared, run_passes
from graphddp.compiler.record import GraphRecord
from graphddp.graph.capture import extract_facts
from graphddp.plan.planner import plan
from graphddp.runtime.agree import agrees_at_run_time
from graphddp.runtime.gate import gate_for
from graphddp.values.schedule import Schedule

log = logging.getLogger("graphddp")


class BackwardRewrite:
    """GraphCompiler's plan and rewrite of one backward graph (module docstring)."""

    def carries(self) -> bool:
        """Can a step after ``no_sync`` carry its accumulated gradients into the compiled buckets
        (one collective of their sum per bucket, overlapped, as DDP's bucket after ``no_sync``)?
        Not with a traced hook, which sees each bucket's accumulated gradients alone."""
        return self.world_size > 1 and self.hook is None and self.config.sharding in (None, "optimizer")

    def gates(self) -> bool:
        """Are this configuration's graphs gated? Where every bucket can be held local unchanged:
        replicated buckets, the built-in hook, no compression, no optimizer inside the backward,
        and ranks to agree with."""
        return (
            self.carries() and self.optimizer is None and self.config.comm_dtype is None
            and agrees_at_run_time(self.group)
        )

    def carries_for(self, schedule: Schedule) -> bool:
        """Does a graph of this plan get a carrying variant? From the plan alone, so that a cache
        hit decides as a cold compile."""
        return self.carries() and bool(schedule.buckets) and not any(s.zero_filled for b in schedule.buckets for s in b.slots)

    def _phase(self) -> str:
        """Which synchronising variant the next step runs: the hook's phase, else the one."""
        return self.hook.phase() if self.hook is not None else "sync"

    def _frame(self, graph_index: int) -> int | None:
        """Graph ``graph_index``'s Dynamo frame (None for a graph the step never saw: a test's)."""
        return self.step.graphs[graph_index].frame if graph_index < len(self.step.graphs) else None

    def plan_graph(self, facts: Any, graph_index: int, unreduced: tuple[str, ...], hook: str | None = None) -> Schedule:
        """The planner on one graph's facts; a recompile takes its frame's buckets."""
        frame = self._frame(graph_index)
        like = self.frames.like(frame, (s.param_name for s in facts.slots))
        schedule = plan(
            facts, self.config, world_size=self.world_size, group_name=self.group_name, graph_index=graph_index,
            unreduced=unreduced, hook=hook, like=like, gated=self.gates(), placement=self.placement,
        )
        if schedule.gated:
            gate_for(self.group)  # registered before anything compiles or runs its all-reduces
        if like is None:
            self.frames.add(frame, schedule)
        return schedule

    def frame_plans(self, graph_index: int) -> list[Any]:
        """The plans :meth:`plan_graph` may reuse for graph ``graph_index`` (for the compile cache's key)."""
        return self.frames.names(self._frame(graph_index))

    def rewrite_backward(
        self, gm: fx.GraphModule, param_inputs: Mapping[int, str], graph_index: int,
        fw_values: Mapping[str, Any] | None = None, phase: str = "sync", carry: bool = False,
    ) -> GraphRecord:
        """capture -> plan -> rewrite -> verify for one backward graph. A traced hook runs in every
        bucket except in its ``"allreduce"`` phase, where buckets are averaged as by default."""
        hook = self.hook if phase != "allreduce" else None
        facts = extract_facts(gm, param_inputs)
        graded = {s.output_index for s in facts.slots}
        unreduced = tuple(name for i, name in sorted(param_inputs.items()) if i not in graded)
        schedule = self.plan_graph(facts, graph_index, unreduced, hook.name if hook is not None else None)
        shared = Shared(fw_values=dict(fw_values or {}))
        schedule = run_passes(
            self.backward_passes, gm, schedule, world_size=self.world_size, hook=hook, hook_context=self._hook_context,
            graph_index=graph_index, check=self.config.verify, outputs={s.output_index: s.param_name for s in facts.slots},
            shared=shared, carry=carry,
        )
        log.info("graphddp plan for backward graph %d (fingerprint %s):\n%s", graph_index, schedule.fingerprint(), schedule.to_table())
        record = GraphRecord(schedule=schedule, graph=gm, index=graph_index, without_update=shared.without_update)
        if shared.tied:
            record.fallbacks["shared"] = shared.tied
        return record
