"""Renderers for a schedule: its table with predicted times, Chrome/Perfetto trace, Graphviz dot,
and a timeline plot.

All work from the schedule value alone (no graph, no process group), so they run on a schedule
loaded from JSON as well as on a live one. The trace, dot and plot take a backward's
:class:`~graphddp.values.schedule.Schedule`: they need the cost model's timeline.
"""
from __future__ import annotations

import json
from typing import Any

from graphddp.plan.cost import CostModel, simulate
from graphddp.values.schedule import Schedule
from graphddp.values.schedule_table import ScheduleValue

COMPUTE_TID, COMM_TID = 0, 1
_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


def _colour(bucket: Any) -> str:
    return _PALETTE[bucket.index % len(_PALETTE)]


def table(schedule: ScheduleValue, cost: CostModel | None = None) -> str:
    """``schedule.to_table()``, with each bucket's predicted ready, start and end times where the
    cost model times the schedule (``schedule.predicted``)."""
    return schedule.to_table(simulate(schedule, cost) if schedule.predicted else None)


def _timed(schedule: ScheduleValue, what: str) -> Schedule:
    """``schedule``, refused by name where the cost model does not time it (full sharding's)."""
    if not schedule.predicted:
        raise ValueError(f"graphddp.render.{what}: this schedule has no predicted timeline (sharding='full'); render.table shows it")
    return schedule  # type: ignore[return-value]


def chrome_trace(schedule: Schedule, cost: CostModel | None = None, path: str | None = None) -> dict[str, Any]:
    """Trace Event Format: a compute lane (one event per node) and a communication lane (one
    event per bucket). Opens in Perfetto and chrome://tracing. Written to ``path`` if given."""
    timeline = simulate(_timed(schedule, "chrome_trace"), cost)
    pid = schedule.graph_index
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"graphddp backward graph {pid}"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID, "args": {"name": "communication"}},
    ]
    for span in timeline.compute:
        events.append({"ph": "X", "name": span.name, "cat": "compute", "pid": pid, "tid": COMPUTE_TID,
                       "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6})
    for bucket, t in zip(schedule.buckets, timeline.buckets):
        events.append({
            "ph": "X", "name": f"bucket {bucket.index} ({bucket.wire_nbytes / 2**20:.2f} MB)", "cat": bucket.collective,
            "pid": pid, "tid": COMM_TID, "ts": t.start * 1e6, "dur": (t.end - t.start) * 1e6,
            "args": {"params": list(bucket.param_names), "ready_us": t.ready * 1e6, "issue_after": bucket.issue_after},
        })
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"fingerprint": schedule.fingerprint(), **timeline.to_dict()}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def dot(schedule: Schedule) -> str:
    """The backward graph as Graphviz dot: each bucket's gradient producers filled in the
    bucket's colour, and the inserted all-reduce (box) and wait (octagon) nodes marked."""
    schedule = _timed(schedule, "dot")
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


def plot(schedule: Schedule, path: str, cost: CostModel | None = None) -> None:
    """PNG/SVG (by extension) of the predicted compute and communication lanes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the timeline plot needs matplotlib: pip install 'graphddp[plot]'") from e
    timeline = simulate(_timed(schedule, "plot"), cost)
    link = timeline.link
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.broken_barh([(s.start * 1e3, (s.end - s.start) * 1e3) for s in timeline.compute], (10, 8), facecolors="#888888")
    for b, t in zip(schedule.buckets, timeline.buckets):
        c = _colour(b)
        ax.broken_barh([(t.start * 1e3, (t.end - t.start) * 1e3)], (0, 8), facecolors=c, edgecolor="black")
        ax.text((t.start + t.end) / 2 * 1e3, 4, str(b.index), ha="center", va="center", fontsize=8)
        ax.axvline(t.ready * 1e3, ymin=0.0, ymax=0.95, color=c, linestyle=":", linewidth=1)
    ax.set_yticks([4, 14], labels=["communication", "compute"])
    ax.set_xlabel("ms from backward start (predicted)")
    ax.set_title(
        f"graph {schedule.graph_index}: {schedule.num_buckets} buckets, world {schedule.world_size}, "
        f"{link}; exposed comm {timeline.exposed_seconds * 1e3:.2f} ms"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
