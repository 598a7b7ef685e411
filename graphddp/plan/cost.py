"""Cost model behind every Schedule: node times, alpha-beta collective times, and a simulated
timeline of one backward pass with its communication.

* Compute: a node costs ``max(flops / compute rate, bytes moved / memory bandwidth)`` plus a fixed
  per-op overhead, from the FLOPs and bytes each ``NodeFact`` holds. Measured times override estimates.
* Communication: each bucket's collective kind (:mod:`graphddp.values.collectives`) on the ring; an
  all-reduce is ``2 (p-1) alpha + 2 (p-1)/p * bytes / bandwidth``.
* Timeline: backward nodes run back to back on the compute lane, and issuing a collective takes a
  fixed time there too, plus ``collective_host_share`` of its link time (on CPU ranks the transport's
  threads share the compute's cores); a bucket's collective starts once its last gradient is produced,
  its issue is done and the link is free (one bucket on the wire at a time). Whatever communication
  ends after the last compute node is *exposed*.
* Sharded buckets (``Bucket.collective == "reduce_scatter"``): the reduce over the placement's groups
  (:meth:`~graphddp.values.placement.Placement.link_seconds`) and, unless ``Bucket.gather`` is
  ``"forward"`` (the all-gather then completes in the next forward), the all-gather of the updated
  parts, on the link in the backward one bucket early (:mod:`graphddp.plan.auto` prices it so).
* ``sharding="full"`` (:func:`simulate_full`): each placed graph as it runs, forward and backward:
  its nodes in order on the compute lane, each bucket on the link from its issue (a gather over the
  shard group; a reduce-scatter, hybrid then the all-reduce of its part; a whole parameter's
  all-reduce over every rank), and the compute stopped at a bucket's wait until it ends.
* The agreement (:mod:`graphddp.runtime.steady`): a gated schedule's one CPU bucket carries it in its
  all-reduce once the step is steady; a gated schedule of more buckets pays a collective of its own
  every step (:func:`agreement_seconds`). Schedules that are not gated agree before the backward: the
  same for every plan, left out.

Everything here is pure arithmetic on Schedule values, so a user can ask "what if the link were
100 Gbit/s" without re-tracing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from graphddp.values.collectives import ALL_GATHER, ALL_REDUCE, SHARDED, kind
from graphddp.values.part_schedule import GATHER, REDUCE_SCATTER, FullSchedule, PartBucket, PartGraph
from graphddp.values.placement import Level, Placement
from graphddp.values.schedule import Bucket, BucketTiming, CostModel, NodeFact, Schedule, Span, Timeline

__all__ = [
    "LATENCY_FLOOR_US", "CostModel", "agreement_seconds", "bucket_seconds", "compute_timeline", "fit_link", "floor_latency", "host_seconds",
    "link_noise", "pays_agreement", "simulate", "simulate_full",
]


def agreement_seconds(cost: CostModel, world_size: int) -> float:
    """What a step pays for the agreement as a collective of its own: its issue on the host and the
    latency of its all-gather of a few integers."""
    if world_size <= 1:
        return 0.0
    return cost.collective_overhead_us * 1e-6 + ALL_GATHER.seconds(cost, 64, world_size)


def pays_agreement(schedule: Schedule) -> bool:
    """Does this gated schedule's agreement need a collective of its own once the step is steady?"""
    return schedule.gated and not schedule.agreement_in_bucket


def compute_timeline(
    nodes: Sequence[NodeFact], cost: CostModel, measured: Mapping[str, float] | None = None,
    lane_after: Mapping[str, float] | None = None,
) -> tuple[list[Span], dict[str, float], float]:
    """The compute lane: compute nodes back to back, at their ``measured`` time or else ``cost``'s
    estimate; after a node, ``lane_after[node]`` seconds (the collectives issued there). Returns
    (spans, when each node and the issues after it end, when the compute ends)."""
    measured = measured or {}
    lane_after = lane_after or {}
    clock = 0.0
    finished: dict[str, float] = {}
    spans = []
    for node in nodes:
        if node.is_compute:
            seconds = measured.get(node.name, cost.compute_seconds(node.flops, node.nbytes))
            spans.append(Span(node.name, clock, clock + seconds))
            clock += seconds
        clock += lane_after.get(node.name, 0.0)
        finished[node.name] = clock
    return spans, finished, clock


def simulate(schedule: Schedule, cost: CostModel | None = None, measured: Mapping[str, float] | None = None) -> Timeline:
    """Predict the backward pass of ``schedule`` under ``cost`` (module docstring).

    ``measured`` maps node names to seconds and overrides the estimate of those nodes. Without
    ``cost``, the cost model the schedule was planned with (``bucket_cap_mb="auto"``), else
    ``CostModel()``'s defaults. Several buckets issued after one node are issued in order, each ready
    when its own issue is done.
    """
    cost = cost or schedule.cost_model or CostModel()
    links = [sum(bucket_seconds(schedule, bucket, cost)) for bucket in schedule.buckets]  # the all-gather right behind the reduce
    lane: dict[str, float] = {}
    for bucket, seconds in zip(schedule.buckets, links):
        lane[bucket.issue_after] = lane.get(bucket.issue_after, 0.0) + host_seconds(cost, seconds)
    spans, finished, clock = compute_timeline(schedule.nodes, cost, measured, lane)
    link_free = 0.0
    timings = []
    for bucket, seconds in zip(schedule.buckets, links):
        lane[bucket.issue_after] -= host_seconds(cost, seconds)  # later buckets at the same node are issued after this one
        ready = finished.get(bucket.issue_after, clock) - lane[bucket.issue_after]
        start = max(ready, link_free)
        end = start + seconds
        link_free = end
        timings.append(BucketTiming(bucket.index, ready, start, end, bucket.wire_nbytes))
    step = max([clock] + [t.end for t in timings])
    if pays_agreement(schedule):
        step += agreement_seconds(cost, schedule.world_size)
    flat = cost.link(schedule.world_size)  # a topology's: the level a flat ring over the world crosses
    link = f"{flat.bandwidth_gbps:g} Gbit/s, {flat.latency_us:g} us"
    return Timeline(tuple(spans), tuple(timings), clock, step, link)


def simulate_full(schedule: FullSchedule, cost: CostModel | None = None) -> tuple[Timeline, ...]:
    """Predict each of a ``sharding="full"`` schedule's placed graphs (``schedule.graphs``) under
    ``cost`` (default ``CostModel()``'s), as :func:`simulate` does a backward (module docstring)."""
    cost = cost or CostModel()
    replicas = Level("", schedule.replicas) if schedule.replicas > 1 else None
    placement = Placement(Level("", schedule.world_size), replicas)
    return tuple(_simulate_placed(graph, cost, placement) for graph in schedule.graphs)


def _link_seconds(bucket: PartBucket, cost: CostModel, placement: Placement) -> float:
    if bucket.kind == GATHER:
        return placement.gather_seconds(cost, bucket.whole_bytes)
    if bucket.kind == REDUCE_SCATTER:
        return placement.reduce_seconds(cost, bucket.whole_bytes)
    return ALL_REDUCE.seconds(cost, bucket.whole_bytes, placement.world)  # a parameter every rank holds whole


def _simulate_placed(graph: PartGraph, cost: CostModel, placement: Placement) -> Timeline:
    """One placed graph: its nodes in order; at a bucket's issue node its issue's host time, then the
    bucket on the link once the link is free; at its wait node the compute waits for its end."""
    issued = {b.issue_at: k for k, b in enumerate(graph.buckets)}
    waited = {b.wait_at: k for k, b in enumerate(graph.buckets)}
    clock = busy = link_free = 0.0
    spans: list[Span] = []
    timings: dict[int, BucketTiming] = {}
    for node in graph.facts:
        k = waited.get(node.position)
        if k is not None and k in timings:
            clock = max(clock, timings[k].end)
        seconds = cost.compute_seconds(node.flops, node.nbytes) if node.is_compute else 0.0
        k = issued.get(node.position)
        if k is not None:
            bucket = graph.buckets[k]
            link = _link_seconds(bucket, cost, placement)
            seconds += host_seconds(cost, link)
            start = max(clock + seconds, link_free)
            link_free = start + link
            timings[k] = BucketTiming(bucket.index, clock + seconds, start, link_free, bucket.part_bytes)
        if seconds:
            spans.append(Span(node.name, clock, clock + seconds))
        clock += seconds
        busy += seconds
    flat = cost.link(placement.world)
    ordered = tuple(timings[k] for k in sorted(timings))
    return Timeline(tuple(spans), ordered, busy, max(clock, link_free), f"{flat.bandwidth_gbps:g} Gbit/s, {flat.latency_us:g} us")


def host_seconds(cost: CostModel, link_seconds: float) -> float:
    """The compute lane's time for one collective of ``link_seconds``: its issue, and
    ``collective_host_share`` of its link time."""
    return cost.collective_overhead_us * 1e-6 + cost.collective_host_share * link_seconds


def bucket_seconds(schedule: Schedule, bucket: Bucket, cost: CostModel) -> tuple[float, float]:
    """A bucket's time on the link (module docstring), as :meth:`~graphddp.values.placement.Placement.link_seconds`
    gives it: a sharded bucket's over the schedule's placement, any other's one collective over every rank."""
    placement = schedule.placement if bucket.collective == SHARDED else None
    if placement is None:
        return kind(bucket.collective).seconds(cost, bucket.wire_nbytes, schedule.world_size), 0.0
    return placement.link_seconds(cost, bucket.wire_nbytes, None if bucket.gather == "forward" else bucket.nbytes)


def fit_link(nbytes: Sequence[int], seconds: Sequence[float], world_size: int, **rest: object) -> CostModel:
    """The CostModel whose ``allreduce_seconds(nbytes[i], world_size)`` best fits ``seconds[i]``.

    ``allreduce_seconds`` is ``a + b * nbytes`` with ``a = 2 (p-1) latency`` and ``b = 2 (p-1)/p * 8 /
    bandwidth``; the least-squares line is refitted through the origin when its intercept is negative,
    and flat when its slope is. Buckets of one size alone cannot split the two: the fit then puts
    everything on the bandwidth. ``rest`` are the other CostModel fields (compute rates, ``source``).
    """
    if world_size < 2 or not nbytes or len(nbytes) != len(seconds):
        raise ValueError(f"need >= 1 bucket time on >= 2 ranks, got {len(seconds)} times, {len(nbytes)} sizes, "
                         f"world_size {world_size}")
    n = len(nbytes)
    mx, my = sum(nbytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sxx if sxx else my / mx
    intercept = my - slope * mx
    if slope <= 0:
        slope, intercept = 0.0, my
    elif intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(nbytes, seconds)) / sum(x * x for x in nbytes), 0.0
    steps = 2 * (world_size - 1)
    bandwidth_gbps = steps / world_size * 8 / (slope * 1e9) if slope > 0 else float("inf")
    return CostModel(bandwidth_gbps=bandwidth_gbps, latency_us=intercept / steps * 1e6, **rest)  # type: ignore[arg-type]


# The least latency per ring step a calibration plans with, per device type, where its fit is
# noise (:func:`link_noise`) twice. A collective's ring step is a message and a wake-up: over
# gloo's TCP, even on loopback, tens of microseconds; over NCCL within a node, a few.
LATENCY_FLOOR_US = {"cpu": 10.0, "cuda": 2.0}


def link_noise(fitted: CostModel, spread_s: float, world_size: int) -> str | None:
    """Why the link figures of ``fitted`` (:func:`fit_link`) are noise, or None when they are not.

    Noise: a bandwidth that is not finite and positive, a latency at or below 0 (on a busy machine the
    small all-reduce took longer than the line through the large ones allows), or a latency per ring
    step smaller than the spread of the repeats it was fitted from (``spread_s``: the smallest
    all-reduce's median repeat minus its fastest). A plan made from such a figure is a plan made from
    the machine's load, and the next run's differs."""
    steps = 2 * (world_size - 1)
    if not (math.isfinite(fitted.bandwidth_gbps) and fitted.bandwidth_gbps > 0):
        return f"a bandwidth of {fitted.bandwidth_gbps:g} Gbit/s"
    if not (math.isfinite(fitted.latency_us) and fitted.latency_us > 0):
        return f"a latency of {fitted.latency_us:g} us per ring step"
    spread_us = spread_s / steps * 1e6
    if spread_us > fitted.latency_us:
        return f"a latency of {fitted.latency_us:.3g} us per ring step, under its repeats' spread of {spread_us:.3g} us"
    return None


def floor_latency(cost: CostModel, device_type: str) -> CostModel:
    """``cost`` with its latency at least :data:`LATENCY_FLOOR_US` of ``device_type``."""
    floor = LATENCY_FLOOR_US.get(device_type, LATENCY_FLOOR_US["cuda"])
    kept = math.isfinite(cost.latency_us) and cost.latency_us >= floor
    return cost if kept else dataclasses.replace(cost, latency_us=floor)
