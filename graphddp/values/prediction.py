"""The cost model's values: the machine a prediction assumes, and the backward it predicts.

Plain immutable values, like the Schedule that records the cost model it was planned under, so they
live in the bottom layer; a module of their own because neither needs a bucket or a graph
(:mod:`graphddp.values.schedule` re-exports them). This module imports nothing from graphddp.
"""
from __future__ import annotations

import dataclasses
from typing import Any

_MAY_BE_ZERO = ("latency_us", "op_overhead_us", "collective_overhead_us", "collective_host_share", "inter_latency_us")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine parameters. Defaults describe a modest CPU rank on a 10 Gbit/s link.

    ``source`` says where the numbers came from ("given", "default", or what
    :func:`graphddp.runtime.calibrate.calibrate` measured them on); a Schedule planned with
    ``bucket_cap_mb="auto"`` records its cost model, source included.
    """

    bandwidth_gbps: float = 10.0  # link bandwidth, gigabits per second
    latency_us: float = 20.0  # alpha: per ring step
    compute_tflops: float = 0.05  # sustained dense compute, TFLOP/s
    memory_gbps: float = 20.0  # memory bandwidth, gigabytes per second
    op_overhead_us: float = 2.0  # launch / dispatch cost per op
    collective_overhead_us: float = 20.0  # compute-lane time to issue and wait for one collective
    # compute-lane seconds per second a collective is on the link: 0 where the transport runs beside
    # the compute (a GPU's); on CPU ranks gloo's threads and the network stack share the compute's cores
    collective_host_share: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string, got {self.source!r}")
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and f.name not in _MAY_BE_ZERO):
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """The value ``to_dict`` wrote: a :class:`Topology` when it has the inter-node fields."""
        if cls is CostModel and "gpus_per_node" in data:
            return Topology(**data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def compute_seconds(self, flops: int, nbytes: int) -> float:
        return max(flops / (self.compute_tflops * 1e12), nbytes / (self.memory_gbps * 1e9)) + self.op_overhead_us * 1e-6

    @property
    def numbers(self) -> dict[str, float]:
        """The machine parameters without ``source``: what a plan depends on."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}

    def describe(self) -> str:
        """One line for tables and logs."""
        return (f"{self.bandwidth_gbps:.3g} Gbit/s, {self.latency_us:.3g} us per ring step, "
                f"{self.compute_tflops:.3g} TFLOP/s, {self.memory_gbps:.3g} GB/s, {self.op_overhead_us:.3g} us per op, "
                f"{self.collective_overhead_us:.3g} us per collective"
                + (f", {self.collective_host_share:.2g} of its link time on the host" if self.collective_host_share else "")
                + f" ({self.source})")

    def ring_seconds(self, steps: int, wire_nbytes: float) -> float:
        """A ring collective of ``steps`` latency-bound steps that puts ``wire_nbytes`` on each rank's
        link: the alpha-beta time every collective kind is priced with."""
        return steps * self.latency_us * 1e-6 + wire_nbytes * 8 / (self.bandwidth_gbps * 1e9)

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        """A ring all-reduce of ``nbytes`` per rank, as ``ALL_REDUCE.seconds`` prices it."""
        if world_size <= 1:
            return 0.0
        steps = 2 * (world_size - 1)
        return self.link(world_size).ring_seconds(steps, steps / world_size * nbytes)

    def link(self, size: int, stride: int = 1) -> "CostModel":
        """The one link a ring over ``size`` ranks, ``stride`` ranks apart, runs at: this model's own,
        for a single link; :class:`Topology` says which of its two levels the ring crosses."""
        return self

    def scaled(self, compute: float, link: float) -> "CostModel":
        """This machine with its compute ``compute`` times and its links ``link`` times as fast."""
        return dataclasses.replace(
            self, compute_tflops=self.compute_tflops * compute, memory_gbps=self.memory_gbps * compute,
            op_overhead_us=self.op_overhead_us / compute, bandwidth_gbps=self.bandwidth_gbps * link,
            latency_us=self.latency_us / link,
        )


@dataclasses.dataclass(frozen=True)
class Topology(CostModel):
    """Two levels of link: ``gpus_per_node`` ranks joined by the inherited link (``bandwidth_gbps``,
    ``latency_us``: NVLink, say), nodes joined by ``nics_per_node`` NICs of ``inter_bandwidth_gbps``
    each (InfiniBand, Ethernet). :mod:`graphddp.values.links` has named ones, with their sources.

    Why a ring is priced as :meth:`link` prices it: ranks are laid out node by node and a group's
    ranks ``stride`` apart (a flat group: 1; hybrid sharding's replicate group: the shard size).
    A ring within one node runs on the node's link. A ring across nodes is bounded by its slowest
    hop: each node's NICs carry the ring traffic of every group of the kind that crosses them at
    once. NCCL runs one ring per NIC, so a flat ring leaves a node through all of them and gets
    ``nics_per_node x inter_bandwidth_gbps``; when every rank of a node is in another group (a
    replicate group with one rank per node) each gets ``1 / gpus_per_node`` of that. Its latency
    per step mixes the two levels as NCCL's own model does (``src/graph/tuning.cc``): of a ring's
    ``p - 1`` hops, ``nodes - 1`` cross nodes.
    """

    gpus_per_node: int = 8
    nics_per_node: int = 1
    inter_bandwidth_gbps: float = 100.0  # one NIC, gigabits per second
    inter_latency_us: float = 10.0  # per ring step that crosses nodes

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def link(self, size: int, stride: int = 1) -> CostModel:
        """A single-link :class:`CostModel` for a ring over ``size`` ranks ``stride`` apart (class docstring)."""
        node = {f.name: getattr(self, f.name) for f in dataclasses.fields(CostModel)}
        gpus = self.gpus_per_node
        if size * stride <= gpus:
            return CostModel(**node)
        per_node = max(1, min(size, gpus // stride))  # the group's ranks on one node
        nodes = -(-size // per_node)
        shared = self.nics_per_node * self.inter_bandwidth_gbps * per_node / gpus
        hops = max(size - 1, 1)
        latency = ((size - nodes) * self.latency_us + (nodes - 1) * self.inter_latency_us) / hops
        return CostModel(**{**node, "bandwidth_gbps": min(self.bandwidth_gbps, shared), "latency_us": latency})

    def scaled(self, compute: float, link: float) -> "Topology":
        faster = super().scaled(compute, link)
        return dataclasses.replace(  # type: ignore[return-value]
            faster, inter_bandwidth_gbps=self.inter_bandwidth_gbps * link, inter_latency_us=self.inter_latency_us / link,
        )

    def describe(self) -> str:
        return (f"{self.gpus_per_node} per node on {self.bandwidth_gbps:.4g} Gbit/s, {self.latency_us:.3g} us per ring step; "
                f"nodes on {self.nics_per_node} x {self.inter_bandwidth_gbps:.4g} Gbit/s, {self.inter_latency_us:.3g} us; "
                f"{self.compute_tflops:.4g} TFLOP/s, {self.memory_gbps:.4g} GB/s ({self.source})")


# -- a predicted backward pass (graphddp.plan.cost.simulate makes these) ------------------------------


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
    link: str = ""  # the cost model's link, for people: "10 Gbit/s, 20 us"

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
