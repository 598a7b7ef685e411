"""The release-time bound's link: graphddp's own cost model, fitted to what comm_only measured.

Two pieces, both thin over :mod:`graphddp.plan.cost`, so the project has one link model:

* ``fit_link`` (graphddp.plan.cost's, which calibration uses too): the alpha-beta ``CostModel``
  (latency, bandwidth) whose all-reduce times are closest, in least squares, to comm_only's per-bucket medians.
* ``release_timeline``: ``graphddp.plan.cost.simulate`` over the run's buckets, each released when
  its gradients were measured ready. The backward is reduced to one compute step per bucket,
  in ready order, ending at that bucket's ready time; the simulated link then takes one bucket
  at a time, each as soon as it is ready and the link is free (no collective overhead on the
  compute lane: the measured ready times hold it). Earliest-ready-first is the best
  order for one link, so no schedule of these buckets finishes its communication sooner.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from graphddp.plan.cost import CostModel, fit_link, simulate  # noqa: F401 - fit_link is used from here
from graphddp.values.schedule import NodeFact, Schedule


def release_timeline(schedules: Sequence[Schedule], ready_ms: Sequence[float], link: CostModel) -> list[dict]:
    """Per bucket (all schedules' buckets, in their order): ready, start and end of its transfer, ms."""
    buckets = [b for s in schedules for b in s.buckets]
    if len(buckets) != len(ready_ms):
        raise ValueError(f"{len(ready_ms)} ready times for {len(buckets)} buckets")
    order = sorted(range(len(buckets)), key=lambda i: ready_ms[i])
    nodes, released, measured, clock = [], [], {}, 0.0
    for k, i in enumerate(order):
        name = f"bucket{i}_ready"
        nodes.append(NodeFact(name=name, position=k, is_compute=True))
        measured[name] = ready_ms[i] / 1e3 - clock
        clock = ready_ms[i] / 1e3
        released.append(dataclasses.replace(buckets[i], index=k, issue_after=name))
    plan = dataclasses.replace(schedules[0], buckets=tuple(released), nodes=tuple(nodes))
    # The ready times are measured: whatever issuing a collective costs the compute is in them
    # already, so the simulated lane charges no collective overhead on top.
    timings = simulate(plan, dataclasses.replace(link, collective_overhead_us=0.0), measured).buckets
    return [{"bucket": order[t.index], "ready_ms": ready_ms[order[t.index]], "start_ms": t.start * 1e3,
             "end_ms": t.end * 1e3} for t in timings]
