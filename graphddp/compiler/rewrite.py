"""One backward graph planned and rewritten, and the facts of the configuration that decide how.

:meth:`BackwardRewrite.rewrite_backward` is capture -> plan -> the backend's backward passes
(:mod:`graphddp.compiler.compose`) -> verify for one backward graph, talking to no rank; a
recompile takes its frame's buckets (:mod:`graphddp.compiler.frames`). Beside it, what the
configuration decides for every graph alike, so the same on every rank: whether a step after
``no_sync`` carries its accumulated gradients into the buckets (:meth:`~BackwardRewrite.carries`),
whether the graphs are gated (:meth:`~BackwardRewrite.gates`), which hook phase runs next. In a
module of its own so that the compiler's reads as compiling one Dynamo graph and wiring its
variants at run time. :class:`BackwardRewrite` is mixed into GraphCompiler and reads its
attributes: ``config``, ``group``, ``group_name``, ``world_size``, ``placement``, ``hook``, ``_hook_context``,
``optimizer``, ``step``, ``frames`` and ``backward_passes``.
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
    """GraphCompiler's plan and rewrite of one backward graph, and the configuration's facts
    that decide its variants."""

    def carries(self) -> bool:
        """Can a step after ``no_sync`` carry its accumulated gradients into the compiled buckets
        (one collective of their sum per bucket, overlapped, as DDP's bucket after ``no_sync``;
        with ``sharding="optimizer"`` a reduce-scatter, the part then updated in the graph)?
        With built-in hooks: a traced hook sees each bucket's accumulated gradients alone, after
        the backward (:meth:`~graphddp.compiler.hook_runtime.HookRuntime._hook_end_of_step`). A fact of
        the configuration: the same on every rank."""
        return self.world_size > 1 and self.hook is None and self.config.sharding in (None, "optimizer")

    def gates(self) -> bool:
        """Are this configuration's graphs gated (:mod:`graphddp.runtime.gate`: the agreement read
        at the first bucket's issue, not before the backward)? Where every bucket can be held
        local without having changed anything: replicated buckets with the built-in hook and no
        compression, no optimizer inside the backward, and ranks to agree with. A fact of the
        configuration: the same on every rank, so every rank follows an answer alike."""
        return (
            self.carries() and self.optimizer is None and self.config.comm_dtype is None
            and agrees_at_run_time(self.group)
        )

    def carries_for(self, schedule: Schedule) -> bool:
        """Does a graph of this plan get a carrying variant (:meth:`carries`, buckets, and no
        zero-filled slot)? Decided from the plan alone, so a cache hit decides as a cold compile."""
        return self.carries() and bool(schedule.buckets) and not any(s.zero_filled for b in schedule.buckets for s in b.slots)

    def _phase(self) -> str:
        """Which synchronising variant the next step runs: the hook's phase, else the one."""
        return self.hook.phase() if self.hook is not None else "sync"

    def _frame(self, graph_index: int) -> int | None:
        """Graph ``graph_index``'s Dynamo frame (None for a graph the step never saw: a test's)."""
        return self.step.graphs[graph_index].frame if graph_index < len(self.step.graphs) else None

    def plan_graph(self, facts: Any, graph_index: int, unreduced: tuple[str, ...], hook: str | None = None) -> Schedule:
        """The planner on one graph's facts; a recompile takes its frame's buckets
        (:mod:`graphddp.compiler.frames`: zeros where a parameter stopped taking a gradient, with a hook)."""
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
        """The plans :meth:`plan_graph` may reuse for graph ``graph_index`` (the compile cache's key)."""
        return self.frames.names(self._frame(graph_index))

    def rewrite_backward(
        self, gm: fx.GraphModule, param_inputs: Mapping[int, str], graph_index: int,
        fw_values: Mapping[str, Any] | None = None, phase: str = "sync", carry: bool = False,
    ) -> GraphRecord:
        """capture -> plan -> rewrite -> verify for one backward graph. Talks to no rank.

        With a user's traced hook, every bucket runs it, except in its ``"allreduce"`` phase
        (PowerSGD before ``start_powerSGD_iter``), where buckets are averaged as by default.
        With an optimizer attached and the forward values of the parameters (``fw_values``),
        then with_updates -> insert_update -> verify_updates.
        """
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
        record = GraphRecord(schedule=schedule, graph=gm, without_update=shared.without_update)
        if shared.tied:
            record.fallbacks["shared"] = shared.tied
        return record
