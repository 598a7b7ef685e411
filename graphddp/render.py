"""Renderers for a schedule: its table with predicted times, Chrome/Perfetto trace, Graphviz dot,
and a timeline plot.

All work from the schedule value alone (no graph, no process group), so they run on a schedule
loaded from JSON as well as on a live one, in every mode: a backward's
:class:`~graphddp.values.schedule.Schedule` (one timeline, :func:`~graphddp.plan.cost.simulate`),
or ``sharding="full"``'s :class:`~graphddp.values.part_schedule.FullSchedule` (one per placed graph,
forward and backward, :func:`~graphddp.plan.cost.simulate_full`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from graphddp.plan.cost import CostModel, simulate, simulate_full
from graphddp.values.part_schedule import FullSchedule, PartBucket, PartGraph
from graphddp.values.prediction import Timeline
from graphddp.values.schedule import Schedule
from graphddp.values.schedule_table import ScheduleValue

COMPUTE_TID, COMM_TID = 0, 1
_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


@dataclasses.dataclass(frozen=True)
class _Lane:
    """One predicted graph as the renderers draw it: its name, a trace process id, its buckets
    (a backward's ``Bucket``s or a placed graph's ``PartBucket``s) and their timeline (bucket ``k``
    at ``timeline.buckets[k]``)."""

    name: str
    pid: int
    buckets: tuple[Any, ...]
    timeline: Timeline


def _described(bucket: Any) -> tuple[str, str, tuple[str, ...], str]:
    """A bucket's label, collective, parameters and the node it is issued after."""
    if isinstance(bucket, PartBucket):
        return f"{bucket.kind} {bucket.index} ({bucket.whole_bytes / 2**20:.2f} MB)", bucket.kind, bucket.params, bucket.issued_after
    label = f"bucket {bucket.index} ({bucket.wire_nbytes / 2**20:.2f} MB)"
    return label, bucket.collective, bucket.param_names, bucket.issue_after


def _lanes(schedule: ScheduleValue, what: str, cost: CostModel | None) -> list[_Lane]:
    """``schedule``'s predicted graphs, refused by name where it has no nodes to time (a loaded
    schedule written without them)."""
    _refuse_unpredicted(schedule, what)
    index, predicted = schedule.graph_index, _predicted(schedule, cost)  # type: ignore[attr-defined]
    if isinstance(schedule, FullSchedule):
        return [
            _Lane(f"graphddp {g.kind} graph {index}", 2 * index + (g.kind == "backward"), g.buckets, t)
            for g, t in zip(schedule.graphs, predicted)
        ]
    return [_Lane(f"graphddp backward graph {index}", index, schedule.buckets, predicted)]  # type: ignore[attr-defined]


def _predicted(schedule: ScheduleValue, cost: CostModel | None) -> Any:
    """What ``schedule.to_table`` takes: a backward's timeline, or one per placed graph of a ``FullSchedule``."""
    if isinstance(schedule, FullSchedule):
        return simulate_full(schedule, cost)
    assert isinstance(schedule, Schedule)
    return simulate(schedule, cost)


def _refuse_unpredicted(schedule: ScheduleValue, what: str) -> None:
    if not schedule.predicted:
        raise ValueError(f"graphddp.render.{what}: this schedule has no predicted timeline (no graph nodes); render.table shows it")


def _colour(bucket: Any) -> str:
    """A bucket's colour by its index; a placed graph's reduces half the palette away from its gathers of the same index."""
    shift = len(_PALETTE) // 2 if isinstance(bucket, PartBucket) and bucket.kind != "gather" else 0
    return _PALETTE[(bucket.index + shift) % len(_PALETTE)]


def table(schedule: ScheduleValue, cost: CostModel | None = None) -> str:
    """``schedule.to_table()``, with each bucket's predicted times where the cost model times the
    schedule (``schedule.predicted``)."""
    return schedule.to_table(_predicted(schedule, cost) if schedule.predicted else None)


def chrome_trace(schedule: ScheduleValue, cost: CostModel | None = None, path: str | None = None) -> dict[str, Any]:
    """Trace Event Format: per predicted graph a compute lane (one event per node) and a
    communication lane (one event per bucket). Opens in Perfetto and chrome://tracing. Written to
    ``path`` if given."""
    lanes = _lanes(schedule, "chrome_trace", cost)
    events: list[dict[str, Any]] = []
    for lane in lanes:
        pid, timeline = lane.pid, lane.timeline
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": lane.name}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID, "args": {"name": "communication"}},
        ]
        for span in timeline.compute:
            events.append({"ph": "X", "name": span.name, "cat": "compute", "pid": pid, "tid": COMPUTE_TID,
                           "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6})
        for bucket, t in zip(lane.buckets, timeline.buckets):
            label, kind, params, after = _described(bucket)
            events.append({
                "ph": "X", "name": label, "cat": kind, "pid": pid, "tid": COMM_TID, "ts": t.start * 1e6, "dur": (t.end - t.start) * 1e6,
                "args": {"params": list(params), "ready_us": t.ready * 1e6, "issue_after": after},
            })
    summary = lanes[0].timeline.to_dict() if len(lanes) == 1 else {"graphs": {lane.name: lane.timeline.to_dict() for lane in lanes}}
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"fingerprint": schedule.fingerprint(), **summary}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def dot(schedule: ScheduleValue) -> str:
    """Each predicted graph as Graphviz dot. A backward's: each bucket's gradient producers filled
    in the bucket's colour, and the inserted all-reduce (box) and wait (octagon) nodes marked; a
    placed graph's (``sharding="full"``): each bucket's collective (box) and wait (octagon) in its colour."""
    _refuse_unpredicted(schedule, "dot")
    if isinstance(schedule, FullSchedule):
        return "\n".join(_placed_dot(schedule.graph_index, g) for g in schedule.graphs)
    assert isinstance(schedule, Schedule)
    colour = {s.producer: _colour(b) for b in schedule.buckets for s in b.slots}
    lines = [f'digraph "graphddp_backward_{schedule.graph_index}" {{', "  rankdir=TB;", '  node [shape=ellipse, fontsize=10];']
    for n in schedule.nodes:
        attrs = f'label="{n.name}"'
        if n.name in colour:
            attrs += f', style=filled, fillcolor="{colour[n.name]}"'
        elif not n.is_compute:
            attrs += ", color=gray"
        lines.append(f'  "{n.name}" [{attrs}];')
        lines.extend(f'  "{i}" -> "{n.name}";' for i in n.inputs)
    for b in schedule.buckets:
        c = _colour(b)
        ar, wait = f"all_reduce[{b.index}]", f"wait[{b.index}]"
        lines.append(f'  "{ar}" [shape=box, style="filled,bold", fillcolor="{c}", label="all_reduce bucket {b.index}\\n{b.wire_nbytes / 2**20:.2f} MB"];')
        lines.append(f'  "{wait}" [shape=octagon, style="filled,bold", fillcolor="{c}", label="wait bucket {b.index}"];')
        for s in b.slots:
            lines.append(f'  "{s.producer}" -> "{ar}" [color="{c}"];')
        lines.append(f'  "{ar}" -> "{wait}" [style=dashed, color="{c}"];')
        lines.append(f'  "{wait}" -> "{b.wait_before}" [color="{c}"];')
    lines.append("}")
    return "\n".join(lines)


def _placed_dot(index: int, graph: PartGraph) -> str:
    marks = {}
    for b in graph.buckets:
        c, (label, *_) = _colour(b), _described(b)
        marks[graph.facts[b.issue_at].name] = f'shape=box, style="filled,bold", fillcolor="{c}", label="{label}"'
        marks[graph.facts[b.wait_at].name] = f'shape=octagon, style="filled,bold", fillcolor="{c}", label="wait {b.kind} {b.index}"'
    lines = [f'digraph "graphddp_{graph.kind}_{index}" {{', "  rankdir=TB;", '  node [shape=ellipse, fontsize=10];']
    for n in graph.facts:
        attrs = marks.get(n.name) or f'label="{n.name}"' + ("" if n.is_compute else ", color=gray")
        lines.append(f'  "{n.name}" [{attrs}];')
        lines.extend(f'  "{i}" -> "{n.name}";' for i in n.inputs)
    lines.append("}")
    return "\n".join(lines)


def plot(schedule: ScheduleValue, path: str, cost: CostModel | None = None) -> None:
    """PNG/SVG (by extension) of the predicted compute and communication lanes, one pair per graph."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the timeline plot needs matplotlib: pip install 'graphddp[plot]'") from e
    lanes = _lanes(schedule, "plot", cost)
    fig, axes = plt.subplots(len(lanes), 1, figsize=(10, 2.6 * len(lanes)), squeeze=False)
    for ax, lane in zip(axes[:, 0], lanes):
        timeline = lane.timeline
        ax.broken_barh([(s.start * 1e3, (s.end - s.start) * 1e3) for s in timeline.compute], (10, 8), facecolors="#888888")
        for b, t in zip(lane.buckets, timeline.buckets):
            c = _colour(b)
            ax.broken_barh([(t.start * 1e3, (t.end - t.start) * 1e3)], (0, 8), facecolors=c, edgecolor="black")
            ax.text((t.start + t.end) / 2 * 1e3, 4, str(b.index), ha="center", va="center", fontsize=8)
            ax.axvline(t.ready * 1e3, ymin=0.0, ymax=0.95, color=c, linestyle=":", linewidth=1)
        ax.set_yticks([4, 14], labels=["communication", "compute"])
        ax.set_xlabel(f"ms from the {lane.name.split()[1]} graph's start (predicted)")
        ax.set_title(
            f"{lane.name.removeprefix('graphddp ')}: {len(lane.buckets)} buckets, world {schedule.world_size}, "  # type: ignore[attr-defined]
            f"{timeline.link}; exposed comm {timeline.exposed_seconds * 1e3:.2f} ms"
        )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
