"""Issue 12: the backward each mode's bucket layout should take, by graphddp's cost model.

The cost model is the one ``bucket_cap_mb="auto"`` plans with: ``graphddp.runtime.calibrate.calibrate``
on the benchmark's process group (link latency and bandwidth from a few all-reduces, compute
rates), called once per rank right after the group is up, so every rank has the same numbers;
the auto planner's own call later hits the same per-group cache.

* graphddp* modes: ``graphddp.plan.cost.simulate(schedule, cost).step_seconds`` summed over the
  mode's schedules: the backward's compute (graphddp's per-node estimates under the cost
  model's rates) plus the communication left exposed after it, the buckets as compiled.
* ddp_default / ddp_cap{c}: graphddp's model of that bucket layout, not of eager DDP's
  backward: ``graphddp.plan.planner.plan`` with DDP's caps (``DDPConfig(bucket_cap_mb=c)``; DDP's
  defaults for ddp_default) on the facts of graphddp's compiled backward (its nodes and
  gradient slots), simulated the same way. Eager DDP computes the same gradients, but its
  backward runs eager kernels and its reducer copies into buckets: the prediction is what
  that layout would cost inside graphddp's graph, and the measured/predicted ratio shows how
  far eager DDP is from it.

Each figure is comparable to the mode's measured ``bwd`` (``loss.backward()``, which holds
graphddp's waits, and DDP's too: its reducer finishes inside the backward).
"""
from __future__ import annotations

from typing import Any, Iterable

from graphddp.config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, DDPConfig
from graphddp.plan.cost import CostModel, simulate
from graphddp.plan.planner import plan
from graphddp.values.schedule import GraphFacts, Schedule
from tools.bench.workload import DDP_CAPS, MB


def cost_record(cost: CostModel | None) -> dict[str, Any] | None:
    """A cost model's fields, its ``source`` too (None for None)."""
    return cost.to_dict() if cost is not None else None


def ddp_config(mode: str) -> DDPConfig | None:
    """The caps an eager DDP mode runs with, as graphddp's options (None: not such a mode)."""
    if mode == "ddp_default":  # DDP's defaults, spelled out (whatever graphddp's own default)
        return DDPConfig(bucket_cap_mb=DEFAULT_BUCKET_CAP_MB, first_bucket_cap_mb=DEFAULT_FIRST_BUCKET_CAP_MB)
    for c in DDP_CAPS:
        if mode == f"ddp_cap{c}":
            return DDPConfig(bucket_cap_mb=c)
    return None


def facts_of(schedule: Schedule) -> GraphFacts:
    """The planner's input for ``schedule``'s backward graph: its nodes and every planned slot."""
    return GraphFacts(nodes=schedule.nodes, slots=tuple(s for b in schedule.buckets for s in b.slots))


def predict(schedules: Iterable[Schedule], cost: CostModel, model: str) -> dict[str, Any]:
    """``simulate(schedule, cost)`` of each schedule, summed: the predicted backward."""
    timelines = [(s, simulate(s, cost)) for s in schedules]
    return {
        "bwd_ms": sum(t.step_seconds for _, t in timelines) * 1e3,
        "compute_ms": sum(t.compute_seconds for _, t in timelines) * 1e3,
        "comm_ms": sum(t.comm_seconds for _, t in timelines) * 1e3,
        "exposed_ms": sum(t.exposed_seconds for _, t in timelines) * 1e3,
        "buckets": sum(len(s.buckets) for s, _ in timelines),
        "bucket_mb": [b.nbytes / MB for s, _ in timelines for b in s.buckets],
        "wire_mb": sum(b.wire_nbytes for s, _ in timelines for b in s.buckets) / MB,
        "nodes": sum(len(s.nodes) for s, _ in timelines),
        "model": model,
    }


def planned_like(facts: list[Schedule], config: DDPConfig) -> list[Schedule]:
    """graphddp's planner at ``config``'s caps on the backward graphs of ``facts``."""
    return [plan(facts_of(s), config, world_size=s.world_size, group_name=s.group_name, graph_index=s.graph_index,
                 unreduced=s.unreduced) for s in facts]


def layout(schedules: Iterable[Schedule]) -> list[list[str]]:
    """The buckets' parameter lists, in issue order: what two layouts must share to be one."""
    return [list(b.param_names) for s in schedules for b in s.buckets]


def predictions(cost: CostModel, graphddp_modes: dict[str, list[Schedule]], ddp_modes: Iterable[str],
                facts: tuple[str, list[Schedule]], ddp_buckets: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode, the predicted backward (see the module docstring).

    ``graphddp_modes``: each graphddp* mode's schedules as compiled; ``ddp_modes``: the eager
    DDP modes that ran; ``facts``: (mode, schedules) whose backward graphs the DDP layouts
    are planned on; ``ddp_buckets``: DDP's own buckets after its rebuild (``_ddp_buckets``),
    to say whether the modelled layout is the one DDP made.
    """
    out = {name: predict(s, cost, "graphddp.plan.cost.simulate of the mode's schedules")
           for name, s in graphddp_modes.items()}
    source, base = facts
    for name in ddp_modes:
        config = ddp_config(name)
        if config is None:
            continue
        planned = planned_like(base, config)
        default = name == "ddp_default"
        caps = "DDP's defaults (25 MB, first 1 MB)" if default else f"bucket_cap_mb={config.bucket_cap_mb:g}"
        rec = predict(planned, cost, f"graphddp's model of this bucket layout: graphddp.plan.planner.plan({caps}) on "
                                     f"{source}'s backward graph, simulated; not eager DDP's compute")
        rec["facts_from"] = source
        twin = None if default else f"graphddp_cap{config.bucket_cap_mb:g}"
        if twin in graphddp_modes:  # the same layout graphddp runs at that cap
            rec["same_layout_as"] = {twin: layout(planned) == layout(graphddp_modes[twin])}
        got = ddp_buckets.get(name)
        if got is not None:  # DDP's own buckets (rebuilt in its gradient-ready order)
            rec["ddp_bucket_mb"] = [b["nbytes"] / MB for b in got]
            rec["same_buckets_as_ddp"] = (sorted(sorted(b["params"]) for b in got)
                                          == sorted(sorted(p) for p in layout(planned)))
        out[name] = rec
    return out
