"""The Schedule and its parts: the one artifact that passes from planning to rewriting, to users and tests.

Everything here is immutable and holds only plain values (names, ints, strings), so it can be compared
across ranks, hashed, serialised and rendered without touching a graph.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping

import torch

from graphddp.values.prediction import BucketTiming, CostModel, Span, Timeline  # noqa: F401
from graphddp.values.choice import PlacementChoice
from graphddp.values.placement import Placement
from graphddp.values.schedule_table import ScheduleTable, fields_of, plain, set_only

# The value types, and the cost model's that this module re-exports: every value type keeps this import path.
__all__ = [
    "SCHEMA_VERSION", "WAIT_AT_OUTPUT", "Bucket", "BucketTiming", "CostModel", "GradSlot", "GraphFacts", "NodeFact",
    "Schedule", "Span", "Timeline", "dtype_name", "production_order",
]

SCHEMA_VERSION = 1


def dtype_name(dtype: object) -> str:
    """How every value here spells a dtype: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """One gradient output of a backward graph that belongs to a parameter."""

    output_index: int
    param_name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nbytes: int
    producer: str  # name of the node that finalises this gradient
    position: int  # topological index of ``producer``: the production order
    # Backward-graph inputs (positions) of the output gradients this gradient is computed from: when every
    # one was None at run time (an output left out of the loss), the parameter went unused (runtime.usage).
    sources: tuple[int, ...] = ()

    @property
    def zero_filled(self) -> bool:
        """This graph produces no gradient for the parameter, but its bucket keeps its place and carries
        zeros there, as DDP's bucket does for a parameter unused in a step: a recompile that stopped a
        parameter's gradient (``requires_grad`` toggled) keeps the buckets a traced hook and its state
        were made for. No gradient is returned for it."""
        return self.output_index < 0

    def zero_filled_copy(self) -> "GradSlot":
        """This slot in a graph that produces no gradient for it (:attr:`zero_filled`)."""
        return dataclasses.replace(self, output_index=-1, producer="", position=-1)


def production_order(slot: GradSlot) -> tuple[int, int]:
    """The order gradients are produced in: the producer's topological position, then the output index."""
    return (slot.position, slot.output_index)


@dataclasses.dataclass(frozen=True)
class NodeFact:
    """One backward-graph node: its order, whether it computes, its cost inputs and edges."""

    name: str
    position: int
    is_compute: bool
    flops: int = 0
    nbytes: int = 0
    inputs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What the planner may know about one backward graph: ordered nodes and gradient slots."""

    nodes: tuple[NodeFact, ...]
    slots: tuple[GradSlot, ...]


# Bucket.wait_before when the bucket is waited for at the end of the backward: the graph's output node.
WAIT_AT_OUTPUT = "output"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Gradients reduced by one collective, in the order they are laid out in the flat buffer.

    ``issue_after`` is the node that finalises the bucket's last gradient: the collective is issued
    right after it. ``wait_before`` is the first node that reads a reduced gradient; the wait sits just
    before it. ``overlap`` names the compute nodes in between, the work that can hide this bucket's
    communication.
    """

    index: int
    slots: tuple[GradSlot, ...]
    dtype: str
    device: str
    issue_after: str
    wait_before: str
    overlap: tuple[str, ...]
    comm_dtype: str | None = None  # set by a compression hook: the dtype on the wire
    collective: str = "all_reduce"  # the kind that merges the bucket (graphddp.values.collectives)
    # A sharded bucket (collective "reduce_scatter"): where the all-gather of its updated parts
    # completes, "backward" or "forward" (before its parameters are first read); None for every other bucket.
    gather: str | None = None
    # Parameters whose optimizer update runs in the graph right after this bucket's wait
    # (``graphddp.compile(..., optimizer=)``); their gradients are not returned.
    updates: tuple[str, ...] = ()
    # A user's traced hook (graphddp.hooks.traced) replaces the all-reduce: its name, and the
    # bytes its collectives put on the wire per rank, read from the rewritten graph.
    hook: str | None = None
    hook_wire_nbytes: int | None = None

    def wire(self) -> tuple:
        """What this bucket puts on the wire (:meth:`Schedule.wire_layout`): dtype, device type (the index
        may differ per rank), wire dtype, hook, bytes and the ordered (parameter name, shape) list."""
        kind = () if self.collective == "all_reduce" else (self.collective,)  # the default kind goes unnamed
        if self.gather is not None:  # ranks must gather at the same point: part of what they agree on
            kind += (self.gather,)
        return (
            self.dtype, self.device.split(":")[0], self.comm_dtype, self.hook, self.wire_nbytes,
            tuple((s.param_name, s.shape) for s in self.slots), *kind,
        )

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(s.param_name for s in self.slots)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def wire_nbytes(self) -> int:
        """Bytes each rank contributes to the all-reduce (what the link carries)."""
        if self.hook_wire_nbytes is not None:
            return self.hook_wire_nbytes
        if self.comm_dtype is None:
            return self.nbytes
        return self.numel * getattr(torch, self.comm_dtype).itemsize

    def offsets(self) -> tuple[int, ...]:
        """Element offset of each slot in the flat bucket buffer."""
        out, acc = [], 0
        for s in self.slots:
            out.append(acc)
            acc += s.numel
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class Schedule(ScheduleTable):
    """The communication plan for one compiled backward graph (its table: :class:`ScheduleTable`)."""

    graph_index: int
    world_size: int
    group_name: str
    bucket_cap_mb: float | None  # None: planned by cost_model ("auto")
    first_bucket_cap_mb: float | None
    buckets: tuple[Bucket, ...]
    unreduced: tuple[str, ...] = ()  # parameters in this graph that get no gradient
    nodes: tuple[NodeFact, ...] = ()  # the backward graph, in order, with cost inputs
    last_bucket_cap_mb: float | None = None  # cap of the exposed tail bucket (None: off)
    optimizer: str | None = None  # the update compiled after the waits (graphddp.optim.attached), if any
    # The updates clip the gradients to this global norm first (update_after says where they then run).
    max_grad_norm: float | None = None
    grad_norm_type: float = 2.0  # the p of that norm (clip_grad_norm_'s norm_type); inf: the largest |g|
    # bucket_cap_mb="auto": the cost model whose predicted backward these buckets minimise; the caps are then None.
    cost_model: CostModel | None = None
    # The agreement is read at the first bucket's issue, not before the backward (graphddp.runtime.gate):
    # each all-reduce runs on the gate of group_name, which divides by world_size (so the graph does
    # not), adds what was carried from no_sync, or holds the bucket when the ranks' steps differ.
    gated: bool = False
    # Where the sharded buckets' parts live, set with the sharding; None without one.
    placement: Placement | None = None
    # sharding="auto": what it weighed and chose (graphddp.plan.choose); None when sharding was given.
    choice: PlacementChoice | None = None

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def update_after(self, index: int) -> int:
        """The bucket whose wait bucket ``index``'s in-graph update follows: its own, so that it runs
        while later buckets are still on the wire; with ``max_grad_norm`` the last one, since the clip
        coefficient needs every bucket's average. The one place that decides it: the update pass places
        updates by it and the verifier checks them against it."""
        return self.buckets[-1].index if self.max_grad_norm is not None and self.buckets else index

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for b in self.buckets for n in b.param_names)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def structure_error(self) -> str | None:
        """Why this schedule is malformed on its own (no graph needed), or None.

        Bucket ``i`` must sit at position ``i`` (the rewrite tags its nodes ``i``), and no output may be
        planned into two buckets (it would be reduced twice). The rewrite refuses such a schedule
        before editing, and the verifier checks it again after.
        """
        seen: dict[int, int] = {}
        for position, bucket in enumerate(self.buckets):
            if bucket.index != position:
                return f"bucket {bucket.index} is at position {position} of the schedule"
            for slot in bucket.slots:
                if slot.zero_filled:
                    continue
                if slot.output_index in seen:
                    return (
                        f"output {slot.output_index} ({slot.param_name!r}) is in bucket {seen[slot.output_index]} "
                        f"and bucket {bucket.index}: it would be reduced twice"
                    )
                seen[slot.output_index] = bucket.index
        return None

    def to_dict(self) -> dict:
        data = set_only(plain(self), max_grad_norm=None, grad_norm_type=2.0, gated=False, placement=None, choice=None)
        if "grad_norm_type" in data:
            data["grad_norm_type"] = str(self.grad_norm_type)  # "inf": JSON has none
        data["buckets"] = [
            {**set_only(plain(b), collective="all_reduce", gather=None), "numel": b.numel, "nbytes": b.nbytes, "wire_nbytes": b.wire_nbytes}
            for b in self.buckets
        ]
        return {"schema_version": SCHEMA_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"unsupported schedule schema_version {data.get('schema_version')!r}")
        buckets = tuple(
            Bucket(**{
                **fields_of(Bucket, b), "overlap": tuple(b["overlap"]), "updates": tuple(b.get("updates", ())),
                "slots": tuple(GradSlot(**{**s, "shape": tuple(s["shape"]), "sources": tuple(s.get("sources", ()))}) for s in b["slots"]),
            })
            for b in data["buckets"]
        )
        return cls(**{
            **fields_of(cls, data), "buckets": buckets, "unreduced": tuple(data["unreduced"]),
            "grad_norm_type": float(data.get("grad_norm_type", 2.0)), "placement": Placement.from_dict(data.get("placement")),
            "choice": PlacementChoice.from_dict(data.get("choice")),
            "cost_model": CostModel.from_dict(data["cost_model"]) if data.get("cost_model") else None,
            "nodes": tuple(NodeFact(**{**n, "inputs": tuple(n["inputs"])}) for n in data.get("nodes", [])),
        })

    def wire_layout(self) -> tuple[int, tuple]:
        """What goes on the wire, and nothing else: what ranks must agree on.

        ``(world_size, buckets)`` with each bucket's :meth:`Bucket.wire`, in issue order. Node names,
        positions and overlap windows are left out: two ranks whose compute differs but whose layouts
        are equal reduce the same gradients.
        """
        placed = () if self.placement is None or not self.placement.hybrid else (self.placement.shape(),)
        return (self.world_size, *placed), tuple(b.wire() for b in self.buckets)

    def renamed(self, names: Mapping[str, str]) -> "Schedule":
        """This plan for other parameters of the same shapes: Dynamo runs one compiled graph for several
        modules of one class when their parent's frame runs eagerly (a graph break in a loop), each call
        with that module's parameters."""
        buckets = tuple(
            dataclasses.replace(
                b, slots=tuple(dataclasses.replace(s, param_name=names.get(s.param_name, s.param_name)) for s in b.slots),
                updates=tuple(names.get(n, n) for n in b.updates),
            )
            for b in self.buckets
        )
        return dataclasses.replace(self, buckets=buckets)

    def fingerprint(self) -> str:
        """Stable hash of the plan: equal across ranks and runs for the same model and options.

        The process-group name is left out (it is a per-process registry key); the world size and
        everything that decides what goes on the wire is in.
        """
        data = self.to_dict()
        data.pop("group_name")
        if self.placement is not None:
            data["placement"] = self.placement.shape()  # group names are per rank
        data.pop("nodes")  # cost inputs, not the plan
        data.pop("cost_model")  # calibrated numbers vary run to run; the buckets they chose are in
        if self.choice is not None:
            data["choice"] = self.choice.chosen  # its predictions come from those numbers too
        for bucket in data["buckets"]:
            for slot in bucket["slots"]:
                slot.pop("sources")  # what a gradient is computed from: a run-time fact, not the plan
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def agreement_in_bucket(self) -> bool:
        """Does this gated schedule's agreement ride in its bucket's all-reduce once the step is steady
        (graphddp.runtime.steady): one plain all-reduce bucket on the CPU? The one answer the runtime,
        the cost model and the table read."""
        if not self.gated or len(self.buckets) != 1:
            return False
        (b,) = self.buckets
        return (
            b.device.split(":")[0] == "cpu" and b.comm_dtype is None and b.hook is None
            and b.collective == "all_reduce" and not b.updates
        )
