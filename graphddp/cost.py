"""Cost model behind every Schedule: compute estimates per node, alpha-beta all-reduce times,
and a simulated timeline of one backward pass with its communication.

* Compute: a node costs ``max(flops / compute rate, bytes moved / memory bandwidth)`` plus a
  fixed per-op overhead; FLOPs come from torch's flop-counter formulas (matmul, conv,
  attention), bytes from the sizes of inputs and outputs. Measured times override estimates.
* Communication: ring all-reduce, ``2 (p-1) alpha + 2 (p-1)/p * bytes / bandwidth``.
* Timeline: backward nodes run back to back on the compute lane; a bucket's all-reduce starts
  once its last gradient is produced and the link is free (one bucket on the wire at a time).
  Whatever communication ends after the last compute node is *exposed*.

Everything here is pure arithmetic on Schedule values, so a user can ask "what if the link
were 100 Gbit/s" without re-tracing.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map_only

if TYPE_CHECKING:
    from graphddp.schedule import Schedule


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


def node_flops_and_bytes(node: fx.Node) -> tuple[int, int]:
    """FLOPs (torch's flop-counter formulas) and bytes read + written by one graph node."""
    if node.op != "call_function":
        return 0, 0
    try:
        return _flops_and_bytes(node)
    except Exception:  # symbolic sizes (dynamic shapes): no estimate rather than a guard
        return 0, 0


def _concrete(x: Any) -> int:
    """An int without specialising: symbolic values raise instead of adding a guard."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and x.node.is_constant():
        return int(x)
    raise TypeError("symbolic")


def _flops_and_bytes(node: fx.Node) -> tuple[int, int]:
    val = node.meta.get("val")
    args_vals = tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    nbytes = sum(_concrete(t.numel()) * t.element_size() for t in tree_leaves((args_vals, val)) if isinstance(t, torch.Tensor))
    flops = 0
    packet = getattr(node.target, "overloadpacket", None)
    from torch.utils.flop_counter import flop_registry

    if packet in flop_registry:
        flops = _concrete(flop_registry[packet](*args_vals[0], out_val=val, **args_vals[1]))
    return flops, nbytes


@dataclasses.dataclass(frozen=True)
class Span:
    name: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class BucketTiming:
    index: int
    ready: float  # seconds from backward start: its last gradient is produced
    start: float  # the link picks it up
    end: float
    nbytes_on_wire: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Predicted backward pass: compute spans, bucket transfers, step time, exposed comm."""

    compute: tuple[Span, ...]
    buckets: tuple[BucketTiming, ...]
    compute_seconds: float
    step_seconds: float

    @property
    def exposed_seconds(self) -> float:
        return self.step_seconds - self.compute_seconds

    @property
    def comm_seconds(self) -> float:
        return sum(b.end - b.start for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "step_seconds": self.step_seconds,
            "exposed_seconds": self.exposed_seconds,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
        }


def simulate(schedule: "Schedule", cost: CostModel, measured: Mapping[str, float] | None = None) -> Timeline:
    """Predict the backward pass of ``schedule`` under ``cost`` (see module docstring)."""
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
    return Timeline(tuple(spans), tuple(timings), clock, max([clock] + [t.end for t in timings]))
