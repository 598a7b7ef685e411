"""A user's traced hook at run time, and the end of a step it shares with the union average.

Around the compiled graphs a traced hook still has run-time work: its state tensors as each
graph's extra inputs, its eager work before a synchronising step, the eager hook on accumulated
gradients after ``no_sync``, and the refusal of a gradient two graphs of a step split.
:class:`HookRuntime` is mixed into GraphCompiler, whose attributes it reads.
"""
from __future__ import annotations

from typing import Callable

import torch

from graphddp.compiler.record import GraphRecord
from graphddp.graph.insert_comm import HOOK_STATE, HOOK_STATE_SPEC
from graphddp.runtime.variants import Synced
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY


class HookRuntime:
    """GraphCompiler's run-time side of a user's traced hook, and its listeners on the step."""

    def _hook_args(self, record: GraphRecord, graph_index: int) -> Callable[[], list[torch.Tensor]]:
        """The real state tensors of ``record``'s hook inputs, in input order (graphddp owns them)."""
        if self.hook_state is None:  # no hook, no state inputs (and a cached record's graph stays unread)
            return list
        specs = [
            (n.meta[BUCKET_KEY], n.meta[HOOK_STATE_SPEC]) for n in record.graph.graph.nodes
            if n.op == "placeholder" and n.meta.get(ROLE_KEY) == HOOK_STATE
        ]
        if not specs:
            return list
        frame = self._frame(graph_index)
        for bucket in record.schedule.buckets:
            self.hook_state.share(graph_index, bucket.index, self.frames.owner(frame, graph_index, bucket))
        tensors = [self.hook_state.allocate(graph_index, bucket, [spec])[0] for bucket, spec in specs]  # type: ignore[union-attr]
        return lambda: list(tensors)

    def _on_sync(self, synced: Synced) -> None:
        """Before a synchronising variant runs: the hook's eager work."""
        self.hook.before_step(self.hook_state, synced.schedule.graph_index, synced.schedule)

    def hook_runs_now(self) -> bool:
        """A user's hook averages the coming synchronising step (not a plain all-reduce phase)."""
        return self.hook is not None and self._phase() != "allreduce"

    def _hook_end_of_step(self) -> None:
        """At the end of every synchronising backward. After ``no_sync``, DDP's semantics: the hook
        sees each bucket's accumulated gradients (a nonlinear hook such as PowerSGD differs from
        hooking each micro-batch), so the graphs ran locally and every bucket goes through the hook
        here, eagerly. Then the hook counts the step, as DDP's ``bucket.is_last()`` does."""
        from graphddp.graph.bucket_function import run_hook_eagerly

        for graph_index in dict.fromkeys(self.step.eager_graphs):
            schedule = self.dispatches[graph_index].schedule
            self.hook.before_step(self.hook_state, graph_index, schedule)
            run_hook_eagerly(self.hook, schedule, self._hook_context, self.hook_state)
        self.hook.after_backward()

    def _union_end_of_step(self) -> None:
        """A divergent step ends with the union average; a step whose gradients came from eager
        code alone agrees here first (its first and only agreement)."""
        step = self.step
        if self.world_size > 1 and not step.divergent and step.eager and not step.probed:
            # pairs with another rank's first backward graph, or with its own made here
            step.agree(self.group, 0, "the gradients of eager code", False)
        if step.divergent and self.world_size > 1:
            self.union.run(step, self.hook_runs_now())

    def shadow_step(self) -> None:
        """A joined rank's part of one synchronising step of the others: the agreement (asking
        for a divergent step), then the union average, with zeros."""
        step = self.step
        with step.shadowing():
            step.agree(self.group, 0, "a joined rank's shadow of a backward", False)
            self.union.run(step, self.hook_runs_now())
            if self.hook is not None:
                self.hook.after_backward()

    def refuse_split_gradients(self, graph_index: int) -> None:
        """A parameter two graphs of one step read gets its gradient in two parts, which a traced
        hook would compress apart where DDP hooks their sum: refused, never approximated, at each
        synchronising forward (only then is it known which graphs run together)."""
        if self.hook is None:
            return
        shared = sorted(self.step.shared_this_step(graph_index, self.step.graphs[graph_index].params))
        if shared:
            raise RuntimeError(
                f"graphddp: comm_hook {self.hook.name!r}: parameters {shared} are read by more than one compiled graph "
                "of this step (tied across a graph break), so each graph's hook would see part of their gradient, where "
                "DDP's hook sees the sum; move the graph break or untie them, or use a built-in comm_hook"
            )
