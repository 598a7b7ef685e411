"""What ``sharding="full"`` put in each compiled graph, and what each rank holds: its Schedule.

In full sharding the collectives are in the graphs before graphddp sees them (every parameter
read is a gather of the ranks' parts, and AOTAutograd derives each reduce-scatter). Their facts
(:class:`PartCollective`, read by :mod:`graphddp.graph.part_facts`) are what its buckets are
planned from (:mod:`graphddp.plan.parts`), as the other modes'
:class:`~graphddp.values.schedule.Schedule` is planned from its graph's facts: the plan is a
:class:`PartGraph` of :class:`PartBucket` values, which :mod:`graphddp.graph.part_collectives`
lowers and :mod:`graphddp.graph.describe_parts` then completes with where the rewrite put each
bucket, checking that the graph does what was planned. The same value is the schedule: per
compiled graph, every bucket's collective, its parameters, its bytes, and where it is issued
and waited; and per rank, the memory the parts, their gradients, the optimizer's state and the
gathers in flight take. ``graphddp.explain(..., sharding="full")`` returns it for any world
size, a run's ``model.schedules`` for its own.

Plain values only, like :mod:`graphddp.values.schedule`: comparable across ranks,
serialisable, printable; it imports nothing from graphddp.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

MB = 1024 * 1024
GATHER, REDUCE_SCATTER = "gather", "reduce_scatter"
PART_KINDS = (GATHER, REDUCE_SCATTER)


@dataclasses.dataclass(frozen=True)
class PartCollective:
    """One gather of a part, or one reduce-scatter of a gradient, as the graph has it before the
    rewrite (the order of a graph's collectives of one kind is the order the rewrite takes them)."""

    kind: str  # GATHER | REDUCE_SCATTER
    sends: str  # the node it sends: a gather's part (a graph input), a reduce-scatter's gradient
    params: tuple[str, ...]  # graph inputs it is of: a gather's part; the inputs a reduce-scatter's gradient becomes
    whole_bytes: int  # the full tensor: gathered, or the gradient sent
    dtype: str  # what travels
    device: str
    group: str  # the process group's name
    replicated: bool  # its part goes on to an all-reduce over a replicate group (hybrid sharding)

    def key(self) -> tuple[str, str, str, bool]:
        """What the collectives of one bucket share: one collective carries them all."""
        return self.group, self.dtype, self.device, self.replicated


@dataclasses.dataclass(frozen=True)
class PartBucket:
    """One collective of a compiled graph: a gather of parts, or a reduce-scatter of gradients.
    Planned with its first six fields; the rest say where the rewrite put it, filled in from the
    rewritten graph (:func:`graphddp.graph.describe_parts.describe_part_collectives`)."""

    kind: str  # GATHER | REDUCE_SCATTER
    index: int  # the bucket's index among the graph's buckets of this kind
    members: tuple[int, ...]  # positions in the graph's collectives of this kind, before the rewrite
    params: tuple[str, ...]  # graph inputs, or once placed parameter names (a tied weight under its first name), each once
    dtype: str  # what travels
    whole_bytes: int  # gathered (or the whole gradients reduce-scattered), padding included
    part_bytes: int = 0  # this rank's share: what it sends in a gather, receives from a reduce-scatter
    issue_at: int = -1  # position of the collective among the graph's nodes
    wait_at: int = -1  # position of its wait
    issued_after: str = ""  # the last node before the issue that is not part of a bucket
    waited_before: str = ""  # the first node after the wait that reads what it brought

    def to_dict(self) -> dict:
        found = dataclasses.asdict(self)
        del found["members"]
        return {**found, "params": list(self.params)}

@dataclasses.dataclass(frozen=True)
class PartCap:
    """The cap a graph's buckets closed at, and where it came from: ``"bucket_cap_mb"`` (given),
    or ``"planned (<the cost model's source>)"`` (:mod:`graphddp.plan.parts`)."""

    nbytes: int
    source: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PartGraph:
    """The collectives of one compiled forward or backward graph: as planned, each kind's buckets
    in index order; once placed, in graph order."""

    kind: str  # "forward" | "backward"
    buckets: tuple[PartBucket, ...]
    cap: PartCap | None = None  # what the buckets closed at
    nodes: int = 0  # the rewritten graph's, once placed
    updates: tuple[str, ...] = ()  # the parts a backward updates inside (the optimizer inside the backward)
    kept_bytes: int = 0  # a forward's gathered parameters it keeps for its backward (its outputs hold them)

    def of(self, kind: str) -> tuple[PartBucket, ...]:
        return tuple(b for b in self.buckets if b.kind == kind)

    def in_flight_bytes(self, prefetch: int) -> int:
        """The most gathered bytes in flight at once: ``prefetch + 1`` consecutive gather buckets
        (the one being read, and those issued ahead of it)."""
        sizes = [b.whole_bytes for b in self.of("gather")]
        return max((sum(sizes[i:i + prefetch + 1]) for i in range(len(sizes))), default=0)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "nodes": self.nodes, "buckets": [b.to_dict() for b in self.buckets], "updates": list(self.updates),
                "cap": None if self.cap is None else self.cap.to_dict(), "kept_bytes": self.kept_bytes}


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes: the parts, their gradients and state for the whole model,
    the gathers for one compiled graph's forward and backward."""

    parameters: int  # its parts, padding included
    whole_parameters: int  # the parameters whole: what each rank of DDP holds
    gradients: int  # the gradients of the parts no backward updates inside, from the backward until zero_grad
    optimizer_state: int  # its parts' state, as the optimizer holds it now (none before its first step)
    gathered_in_flight: int  # the most gathered bytes in flight at once (PartGraph.in_flight_bytes)
    kept_to_backward: int  # gathered in the forward and kept for the backward (PartGraph.kept_bytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class FullSchedule:
    """``sharding="full"``'s schedule of one Dynamo graph: its compiled forward and backward
    (None until compiled: the backward compiles at its first call) and the rank's memory."""

    graph_index: int
    world_size: int
    reshard_after_forward: bool
    prefetch: int
    forward: PartGraph | None
    backward: PartGraph | None
    memory: RankMemory
    # Hybrid sharding (graphddp.values.placement): the shard groups' count; world_size is one
    # group's, the parts' count. 1 without a 2-D device_mesh=.
    replicas: int = 1

    @property
    def graphs(self) -> tuple[PartGraph, ...]:
        return tuple(g for g in (self.forward, self.backward) if g is not None)

    def to_dict(self) -> dict:
        return {
            "sharding": "full", "graph_index": self.graph_index, "world_size": self.world_size,
            "reshard_after_forward": self.reshard_after_forward, "prefetch": self.prefetch,
            "forward": None if self.forward is None else self.forward.to_dict(),
            "backward": None if self.backward is None else self.backward.to_dict(),
            "memory": self.memory.to_dict(),
            **({"replicas": self.replicas} if self.replicas > 1 else {}),
        }

    def fingerprint(self) -> str:
        """A hash of the plan: per graph, its buckets in issue order (which interleaves gathers
        and reduce-scatters), each one's kind, parameters, dtype and sizes. Equal on ranks that
        compiled the same graphs, and between ``graphddp.explain`` and a run: node names and
        positions are left out (gloo's lowering of a collective takes more nodes than NCCL's,
        and explain's fake group takes NCCL's), and so is memory (the optimizer's state appears
        at its first step)."""
        plan = [
            [graph.kind, list(graph.updates)] + [[b.kind, b.index, list(b.params), b.dtype, b.whole_bytes, b.part_bytes] for b in graph.buckets]
            for graph in self.graphs
        ]
        head = [self.graph_index, self.world_size, self.reshard_after_forward, self.prefetch] + ([self.replicas] if self.replicas > 1 else [])
        return hashlib.sha256(json.dumps([head, plan]).encode()).hexdigest()[:16]

    def to_table(self) -> str:
        m = self.memory
        state = size_text(m.optimizer_state) if m.optimizer_state else "none (not stepped yet, or an optimizer that keeps none)"
        ranks = f"{self.world_size} ranks" if self.replicas == 1 else (
            f"{self.world_size * self.replicas} ranks: sharded over {self.world_size}, each part's gradient all-reduced "
            f"over its {self.replicas} replicas"
        )
        lines = [
            f"sharding='full', graph {self.graph_index}, {ranks}, "
            f"reshard_after_forward={self.reshard_after_forward}, gathers issued up to {self.prefetch} bucket(s) "
            "ahead of the one being read",
            f"each rank holds: parameters {size_text(m.parameters)} (whole: {size_text(m.whole_parameters)}), "
            f"gradients {size_text(m.gradients)} after a backward, optimizer state {state}",
            f"this graph's gathers: at most {size_text(m.gathered_in_flight)} in flight at once, "
            f"{size_text(m.kept_to_backward)} kept from the forward to the backward",
        ]
        for graph in self.graphs:
            updates = f"; updates {len(graph.updates)} part(s) inside, each after its gradient's wait" if graph.updates else ""
            cap = f", capped at {size_text(graph.cap.nbytes)}: {graph.cap.source}" if graph.cap is not None else ""
            lines.append(
                f"{graph.kind} ({graph.nodes} nodes): {len(graph.of('gather'))} gather bucket(s), "
                f"{len(graph.of('reduce_scatter'))} reduce-scatter bucket(s){updates}{cap}"
            )
            lines.append(f"  {'collective':<18}{'whole':>10}{'per rank':>10}  {'issued after':<24}{'waited before':<24}parameters")
            for b in graph.buckets:
                lines.append(
                    f"  {b.kind + ' ' + str(b.index):<18}{size_text(b.whole_bytes):>10}{size_text(b.part_bytes):>10}  "
                    f"{_short(b.issued_after):<24}{_short(b.waited_before):<24}{', '.join(b.params)}"
                )
        if self.backward is None:
            lines.append("backward: not compiled yet")
        return "\n".join(lines)


def size_text(nbytes: int) -> str:
    """Bytes for people: ``"512 B"``, ``"12.5 KB"``, ``"3.20 MB"``, ``"1.50 GB"``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < MB:
        return f"{nbytes / 1024:.1f} KB"
    if nbytes < 1024 * MB:
        return f"{nbytes / MB:.2f} MB"
    return f"{nbytes / (1024 * MB):.2f} GB"


def _short(name: str, width: int = 22) -> str:
    return name if len(name) <= width else name[: width - 1] + "~"
