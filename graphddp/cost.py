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
from typing import Mapping, Sequence

from graphddp.schedule import BucketTiming, Schedule, Span, Timeline


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine parameters. Defaults describe a modest CPU rank on a 10 Gbit/s link.

    ``source`` says where the numbers came from ("given", "default", or what
    :func:`graphddp.calibrate.calibrate` measured them on); a Schedule planned with
    ``bucket_cap_mb="auto"`` records its cost model, source included.
    """

    bandwidth_gbps: float = 10.0  # link bandwidth, gigabits per second
    latency_us: float = 20.0  # alpha: per ring step
    compute_tflops: float = 0.05  # sustained dense compute, TFLOP/s
    memory_gbps: float = 20.0  # memory bandwidth, gigabytes per second
    op_overhead_us: float = 2.0  # launch / dispatch cost per op
    source: str = "given"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string, got {self.source!r}")
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and f.name != "op_overhead_us" and f.name != "latency_us"):
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    def compute_seconds(self, flops: int, nbytes: int) -> float:
        return max(flops / (self.compute_tflops * 1e12), nbytes / (self.memory_gbps * 1e9)) + self.op_overhead_us * 1e-6

    @property
    def numbers(self) -> dict[str, float]:
        """The machine parameters without ``source``: what a plan depends on."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}

    def describe(self) -> str:
        """One line for tables and logs."""
        return (f"{self.bandwidth_gbps:.3g} Gbit/s, {self.latency_us:.3g} us per ring step, "
                f"{self.compute_tflops:.3g} TFLOP/s, {self.memory_gbps:.3g} GB/s, {self.op_overhead_us:.3g} us per op "
                f"({self.source})")

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


def fit_link(nbytes: Sequence[int], seconds: Sequence[float], world_size: int, **rest: object) -> CostModel:
    """The CostModel whose ``allreduce_seconds(nbytes[i], world_size)`` best fits ``seconds[i]``.

    ``allreduce_seconds`` is ``a + b * nbytes`` with ``a = 2 (p-1) latency`` and
    ``b = 2 (p-1)/p * 8 / bandwidth``; the least-squares line is refitted through the origin
    when its intercept is negative, and flat when its slope is. Buckets of one size alone
    cannot split the two: the fit then puts everything on the bandwidth. ``rest`` are the
    other CostModel fields (compute rates, ``source``).
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
