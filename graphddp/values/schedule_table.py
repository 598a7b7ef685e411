"""Every mode's schedule as a terminal table, and what every schedule value answers.

The table is the longest reader of a schedule and the only one that is prose; it lives apart from the
value types so that ``schedule.py`` and ``part_schedule.py`` hold what a schedule *is*. Both schedules
derive from :class:`ScheduleValue` through their table, so the log, the CLI, ``graphddp.explain`` and
:mod:`graphddp.render` read every mode's the same way.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from graphddp.values.prediction import Timeline

MB = 2**20  # bytes in a MB, wherever graphddp counts or shows them (graphddp.config re-exports it)


class ScheduleValue:
    """What a schedule of any mode answers: ``graph_index``, ``world_size``, ``to_table(timeline)``,
    ``to_dict()`` in JSON's types, ``fingerprint()`` (equal on ranks and runs with the same plan), and
    ``predicted``: whether the cost model can time it."""

    predicted: bool

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ScheduleValue:
        """The schedule :meth:`to_json` wrote (each class's ``from_dict`` reads its ``to_dict``)."""
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        return self.to_table()


class ScheduleTable(ScheduleValue):
    """:class:`~graphddp.values.schedule.Schedule`'s table (module docstring)."""

    predicted = True

    def _agreement(self) -> str:
        """Where a gated schedule's agreement goes (graphddp.runtime.steady)."""
        if self.agreement_in_bucket:
            return "agreement in bucket 0's all-reduce once steady"
        return "agreement read at bucket 0's issue"

    def to_table(self, timeline: Timeline | None = None) -> str:
        """A terminal table: one row per bucket, in issue order. With ``timeline``
        (``graphddp.simulate(schedule, cost)``) each row gets its predicted ready, start and end times,
        and a last line sums the step up."""
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
            f"graph {self.graph_index}: {self.num_buckets} buckets, {self.nbytes / MB:.2f} MB, "
            f"world_size={self.world_size}, {policy}"
            + (f", {self._agreement()} (gated)" if self.gated else ""),
            head,
            "-" * len(head),
        ]
        for b in self.buckets:
            names = clip(", ".join(b.param_names), 60, "...")
            row = (
                f"{b.index:>6}  {b.dtype:<9} {b.device:<7} {len(b.slots):>6} {b.numel:>10} "
                f"{b.nbytes / MB:>8.3f}  {b.issue_after:<22} {len(b.overlap):>7}"
            )
            if hooked:
                row += f" {b.wire_nbytes / MB:>8.3f}  {(b.hook or 'allreduce')[:12]:<12}"
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
            when = "each right after its bucket's wait" if self.max_grad_norm is None else (
                f"clipped to a global L{self.grad_norm_type:g} norm of {self.max_grad_norm:g}: each bucket's gradient norms "
                "after its wait, every update after the last wait")
            lines.append(f"optimizer {self.optimizer}: {updated} of {len(self.param_names)} parameters updated in the graph, {when}")
            late = [n for b in self.buckets for n in b.param_names if n not in b.updates]
            if late:
                lines.append(f"updated after the backward instead (see graphddp.optim.attached): {', '.join(late)}")
        if self.unreduced:
            lines.append(f"no gradient in this graph (not reduced): {', '.join(self.unreduced)}")
        return "\n".join(lines)


class FullScheduleTable(ScheduleValue):
    """:class:`~graphddp.values.part_schedule.FullSchedule`'s table (module docstring)."""

    @property
    def predicted(self) -> bool:
        """Whether its graphs carry their nodes (placed, or loaded from JSON that has them): the cost model times them."""
        return bool(self.graphs) and all(g.facts for g in self.graphs)

    def to_table(self, timeline: Sequence[Timeline] | None = None) -> str:
        """A terminal table: the rank's memory, then per compiled graph one row per bucket, in graph
        order. With ``timeline``, one per graph (``graphddp.plan.cost.simulate_full``), each row gets
        its predicted issue, start and end times, and each graph a line that sums it up."""
        m = self.memory
        state = size_text(m.optimizer_state) if m.optimizer_state else "none (not stepped yet, or an optimizer that keeps none)"
        ranks = f"{self.world_size} ranks" if self.replicas == 1 else (
            f"{self.world_size * self.replicas} ranks: sharded over {self.world_size}, each part's gradient all-reduced "
            f"over its {self.replicas} replicas"
        )
        lines = [
            f"sharding='full', graph {self.graph_index}, {ranks}, "
            f"reshard_after_forward={self.reshard_after_forward}, gathers issued up to {self.prefetch} bucket(s) "
            "ahead of the one being read",
            f"each rank holds: parameters {size_text(m.parameters)} (whole: {size_text(m.whole_parameters)}), "
            f"gradients {size_text(m.gradients)} after a backward, optimizer state {state}",
            f"this graph's gathers: at most {size_text(m.gathered_in_flight)} in flight at once, "
            f"{size_text(m.kept_to_backward)} kept from the forward to the backward",
        ]
        for n, graph in enumerate(self.graphs):
            t = timeline[n] if timeline else None
            updates = f"; updates {len(graph.updates)} part(s) inside, each after its gradient's wait" if graph.updates else ""
            cap = f", capped at {size_text(graph.cap.nbytes)}: {graph.cap.source}" if graph.cap is not None else ""
            lines.append(
                f"{graph.kind} ({graph.nodes} nodes): {len(graph.of('gather'))} gather bucket(s), "
                f"{len(graph.of('reduce_scatter'))} reduce-scatter bucket(s)"
                + (f", {len(graph.of('all_reduce'))} all-reduce bucket(s) of parameters held whole" if graph.of("all_reduce") else "")
                + f"{updates}{cap}"
            )
            times = f"{'issue ms':>9}{'start ms':>9}{'end ms':>9}  " if t else ""
            lines.append(f"  {'collective':<18}{'whole':>10}{'per rank':>10}  {'issued after':<24}{'waited before':<24}{times}parameters")
            for k, b in enumerate(graph.buckets):
                at = f"{t.buckets[k].ready * 1e3:>9.3f}{t.buckets[k].start * 1e3:>9.3f}{t.buckets[k].end * 1e3:>9.3f}  " if t else ""
                lines.append(
                    f"  {b.kind + ' ' + str(b.index):<18}{size_text(b.whole_bytes):>10}{size_text(b.part_bytes):>10}  "
                    f"{clip(b.issued_after, 22, '~'):<24}{clip(b.waited_before, 22, '~'):<24}{at}{', '.join(b.params)}"
                )
            if t:
                lines.append(
                    f"  predicted ({t.link}): {graph.kind} compute {t.compute_seconds * 1e3:.3f} ms, communication "
                    f"{t.comm_seconds * 1e3:.3f} ms, graph {t.step_seconds * 1e3:.3f} ms, exposed communication {t.exposed_seconds * 1e3:.3f} ms"
                )
        if self.backward is None:
            lines.append("backward: not compiled yet")
        return "\n".join(lines)


def size_text(nbytes: int) -> str:
    """Bytes for people: ``"512 B"``, ``"12.5 KB"``, ``"3.20 MB"``, ``"1.50 GB"``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < MB:
        return f"{nbytes / 1024:.1f} KB"
    if nbytes < 1024 * MB:
        return f"{nbytes / MB:.2f} MB"
    return f"{nbytes / (1024 * MB):.2f} GB"


def clip(text: str, width: int, mark: str) -> str:
    """``text`` cut to ``width`` characters, ``mark`` ending it where it was cut: a column keeps its width."""
    return text if len(text) <= width else text[: width - len(mark)] + mark


def plain(value: Any) -> Any:
    """A value of dataclasses, as JSON has it: a dict per dataclass, a list per tuple."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


def set_only(data: dict, **unset: Any) -> dict:
    """``data`` without the keys that hold their ``unset`` value: a field added to a schedule is
    written only when set, so the plans made before it keep their JSON and fingerprint."""
    return {k: v for k, v in data.items() if k not in unset or v != unset[k]}


def fields_of(kind: type, data: dict) -> dict:
    """The entries of ``data`` that are fields of the dataclass ``kind``: what ``to_dict`` derived
    (a bucket's sizes) is left for the value to compute again; a field not written takes its default."""
    names = {f.name for f in dataclasses.fields(kind)}
    return {k: v for k, v in data.items() if k in names}
