"""Cost model behind every Schedule: node times, alpha-beta all-reduce times, and a simulated
timeline of one backward pass with its communication.

* Compute: a node costs ``max(flops / compute rate, bytes moved / memory bandwidth)`` plus a
  fixed per-op overhead; the FLOPs and bytes are read off the graph by
  :mod:`graphddp.capture` into each ``NodeFact``. Measured times override estimates.
* Communication: ring all-reduce, ``2 (p-1) alpha + 2 (p-1)/p * bytes / bandwidth``.
* Timeline: backward nodes run back to back on the compute lane; a bucket's all-reduce starts
  once its last gradient is produced and the link is free (one bucket on the wire at a time).
  Whatever communication ends after the last compute node is *exposed*.

Everything here is pure arithmetic on Schedule values, so a user can ask "what if the link
were 100 Gbit/s" without re-tracing.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from graphddp.schedule import BucketTiming, Schedule, Span, Timeline


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine parameters. Defaults describe a modest CPU rank on a 10 Gbit/s link."""

    bandwidth_gbps: float = 10.0  # link bandwidth, gigabits per second
    latency_us: float = 20.0  # alpha: per ring step
    compute_tflops: float = 0.05  # sustained dense compute, TFLOP/s
    memory_gbps: float = 20.0  # memory bandwidth, gigabytes per second
    op_overhead_us: float = 2.0  # launch / dispatch cost per op

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and f.name != "op_overhead_us" and f.name != "latency_us"):
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    def compute_seconds(self, flops: int, nbytes: int) -> float:
        return max(flops / (self.compute_tflops * 1e12), nbytes / (self.memory_gbps * 1e9)) + self.op_overhead_us * 1e-6

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        steps = 2 * (world_size - 1)
        wire = steps / world_size * nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return steps * self.latency_us * 1e-6 + wire


def simulate(schedule: Schedule, cost: CostModel | None = None, measured: Mapping[str, float] | None = None) -> Timeline:
    """Predict the backward pass of ``schedule`` under ``cost`` (see module docstring).

    ``measured`` maps node names to seconds and overrides the estimate of those nodes.
    """
    cost = cost or CostModel()
    measured = measured or {}
    clock = 0.0
    finished: dict[str, float] = {}
    spans = []
    for node in schedule.nodes:
        if node.is_compute:
            seconds = measured.get(node.name, cost.compute_seconds(node.flops, node.nbytes))
            spans.append(Span(node.name, clock, clock + seconds))
            clock += seconds
        finished[node.name] = clock
    link_free = 0.0
    timings = []
    for bucket in schedule.buckets:
        ready = finished.get(bucket.issue_after, clock)
        start = max(ready, link_free)
        end = start + cost.allreduce_seconds(bucket.wire_nbytes, schedule.world_size)
        link_free = end
        timings.append(BucketTiming(bucket.index, ready, start, end, bucket.wire_nbytes))
    link = f"{cost.bandwidth_gbps:g} Gbit/s, {cost.latency_us:g} us"
    return Timeline(tuple(spans), tuple(timings), clock, max([clock] + [t.end for t in timings]), link)
