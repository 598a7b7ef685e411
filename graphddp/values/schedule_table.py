"""A Schedule as a terminal table: :meth:`Schedule.to_table` and ``str(schedule)``.

The table is the longest reader of a :class:`~graphddp.values.schedule.Schedule` and the only
one that is prose (the caps or cost model it was planned under, where its agreement goes, what
the sharded buckets gather and when, what the optimizer updates); it lives apart from the value
types so that ``schedule.py`` holds what a Schedule *is*. :class:`ScheduleTable` is a base of
``Schedule`` only (its methods read the Schedule's fields), so ``schedule.to_table()`` is
unchanged. It stays in the bottom layer, beside the Schedule, because the log, the CLI and
:mod:`graphddp.render` all print it; the renderers that need the cost model are in
:mod:`graphddp.render`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphddp.values.prediction import Timeline


class ScheduleTable:
    """:class:`~graphddp.values.schedule.Schedule`'s table (module docstring)."""

    def _agreement(self) -> str:
        """Where a gated schedule's agreement goes (graphddp.runtime.steady)."""
        if self.agreement_in_bucket:
            return "agreement in bucket 0's all-reduce once steady"
        return "agreement read at bucket 0's issue"

    def to_table(self, timeline: Timeline | None = None) -> str:
        """A terminal table: one row per bucket, in issue order.

        With ``timeline`` (``graphddp.simulate(schedule, cost)``) each row gets its predicted
        ready, start and end times, and a last line sums the step up.
        """
        head = f"{'bucket':>6}  {'dtype':<9} {'device':<7} {'params':>6} {'numel':>10} {'MB':>8}  {'issue after':<22} {'overlap':>7}"
        hooked = any(b.hook for b in self.buckets)
        kinds = any(b.collective != "all_reduce" for b in self.buckets)
        head += f" {'wire MB':>8}  {'hook':<12}" if hooked else ""
        head += f" {'collective':<14}" if kinds else ""
        head += f"  {'ready ms':>8} {'start ms':>8} {'end ms':>8}" if timeline else ""
        head += "  parameters"
        if self.cost_model is not None:
            policy = f"auto buckets, minimising the predicted backward under {self.cost_model.describe()}"
        else:
            policy = f"caps first={self.first_bucket_cap_mb} MB rest={self.bucket_cap_mb} MB" + (
                f" last={self.last_bucket_cap_mb} MB" if self.last_bucket_cap_mb is not None else "")
        lines = [
            f"graph {self.graph_index}: {self.num_buckets} buckets, {self.nbytes / 2**20:.2f} MB, "
            f"world_size={self.world_size}, {policy}"
            + (f", {self._agreement()} (gated)" if self.gated else ""),
            head,
            "-" * len(head),
        ]
        for b in self.buckets:
            names = ", ".join(b.param_names)
            if len(names) > 60:
                names = names[:57] + "..."
            row = (
                f"{b.index:>6}  {b.dtype:<9} {b.device:<7} {len(b.slots):>6} {b.numel:>10} "
                f"{b.nbytes / 2**20:>8.3f}  {b.issue_after:<22} {len(b.overlap):>7}"
            )
            if hooked:
                row += f" {b.wire_nbytes / 2**20:>8.3f}  {(b.hook or 'allreduce')[:12]:<12}"
            if kinds:
                row += f" {b.collective:<14}"
            if timeline:
                t = timeline.buckets[b.index]
                row += f"  {t.ready * 1e3:>8.3f} {t.start * 1e3:>8.3f} {t.end * 1e3:>8.3f}"
            lines.append(f"{row}  {names}")
        gathers = sorted({b.gather for b in self.buckets if b.collective == "reduce_scatter"}, key=str)
        if gathers and self.max_grad_norm is not None:  # graphddp.optim.insert_shard: _Splicer.clipped
            forward = "; with gather='forward' waited for and written in the next forward" if "forward" in gathers else ""
            p = self.grad_norm_type  # graphddp.optim.clip.part_norms
            parts = "takes the largest |g| of each part" if p == math.inf else f"sums {'the squares' if p == 2 else f'|g|^{p:g}'} of its parts"
            op = " (max)" if p == math.inf else ""
            lines.append(
                f"reduce_scatter buckets, clipped: each rank {parts} after the wait; after the last bucket one "
                f"all-reduce{op} of those {'sums ' if op == '' else ''}gives the norm, then every part is updated and all-gathered" + forward
            )
        elif gathers:
            where = {
                "backward": "issued after the next bucket's reduce-scatter, waited for and written in the backward "
                "(after the next bucket's all-gather where nothing later reads the parameters, else at its end)",
                "forward": "issued after the next bucket's reduce-scatter and waited for and written in the next forward, "
                "right before the bucket's parameters are first read",
            }
            lines.append(
                "reduce_scatter buckets: each rank updates its part after the wait; the updated parts are all-gathered, "
                + "; ".join(where.get(g, f"gather {g!r}") for g in gathers)
            )
        placement = self.placement
        if gathers and placement is not None and placement.hybrid:
            lines.append(
                f"placement: {placement.describe()}: each bucket reduce-scattered over its {placement.shard.size} shard ranks, "
                f"each part all-reduced over the {placement.replicate.size} replicas, gathered over the shard ranks"
            )
        if timeline:
            lines.append(
                f"predicted ({timeline.link}): backward compute "
                f"{timeline.compute_seconds * 1e3:.3f} ms, communication {timeline.comm_seconds * 1e3:.3f} ms, "
                f"step {timeline.step_seconds * 1e3:.3f} ms, exposed communication {timeline.exposed_seconds * 1e3:.3f} ms"
            )
        if self.optimizer:
            updated = sum(len(b.updates) for b in self.buckets)
            if self.max_grad_norm is None:
                lines.append(f"optimizer {self.optimizer}: {updated} of {len(self.param_names)} parameters updated in the graph, each right after its bucket's wait")
            else:
                lines.append(
                    f"optimizer {self.optimizer}: {updated} of {len(self.param_names)} parameters updated in the graph, clipped to a global "
                    f"L{self.grad_norm_type:g} norm of {self.max_grad_norm:g}: each bucket's gradient norms after its wait, every update after the last wait"
                )
            late = [n for b in self.buckets for n in b.param_names if n not in b.updates]
            if late:
                lines.append(f"updated after the backward instead (see graphddp.optim.attached): {', '.join(late)}")
        if self.unreduced:
            lines.append(f"no gradient in this graph (not reduced): {', '.join(self.unreduced)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()
