"""What ``sharding="full"`` put in each compiled graph, and what each rank holds: its Schedule.

In full sharding the collectives are in the graphs before graphddp sees them (every parameter read is a
gather of the ranks' parts, and AOTAutograd derives each reduce-scatter). Their facts
(:class:`PartCollective`) are what its buckets are planned from, as the other modes' Schedule is planned
from its graph's facts: the plan is a :class:`PartGraph` of :class:`PartBucket` values, which the
rewrite lowers and then completes with where it put each bucket, checking that the graph does what was
planned. The same value is the schedule: per compiled graph, every bucket's collective, its
parameters, its bytes, and where it is issued and waited; and per rank, the memory the parts, their
gradients, the optimizer's state and the gathers in flight take. ``graphddp.explain(...,
sharding="full")`` returns it for any world size, a run's ``model.schedules`` for its own.

Plain values only, like :mod:`graphddp.values.schedule`: comparable across ranks, serialisable, printable.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from graphddp.values import collectives
from graphddp.values.choice import PlacementChoice
from graphddp.values.schedule import NodeFact
from graphddp.values.schedule_table import FullScheduleTable, fields_of, plain, set_only

# A part's gather; a part's gradient reduce-scattered; a gradient of a parameter every rank holds
# whole (replicate_below_mb) all-reduced. The last two are a backward's reduces, indexed together.
GATHER, REDUCE_SCATTER, ALL_REDUCE = "gather", collectives.REDUCE_SCATTER.key, collectives.ALL_REDUCE.key
PART_KINDS = (GATHER, REDUCE_SCATTER, ALL_REDUCE)
REDUCES = (REDUCE_SCATTER, ALL_REDUCE)
WAIT_OF = {k: f"{k}_wait" for k in PART_KINDS}  # in a rewritten graph: the ROLE_KEY of a bucket's wait (its issue's: its kind)
REDUCE_WAITS = tuple(WAIT_OF[k] for k in REDUCES)


@dataclasses.dataclass(frozen=True)
class PartCollective:
    """One gather of a part, or one reduce of a gradient, as the graph has it before the rewrite
    (the order of a graph's gathers, or of its reduces, is the order the rewrite takes them)."""

    kind: str  # GATHER | REDUCE_SCATTER | ALL_REDUCE
    sends: str  # the node it sends: a gather's part (a graph input), a reduce-scatter's gradient
    params: tuple[str, ...]  # graph inputs it is of: a gather's part; the inputs a reduce-scatter's gradient becomes
    whole_bytes: int  # the full tensor: gathered, or the gradient sent
    dtype: str  # what travels
    device: str
    group: str  # the process group's name
    replicated: bool  # its part goes on to an all-reduce over a replicate group (hybrid sharding)

    def key(self) -> tuple[str, str, str, str, bool]:
        """What the collectives of one bucket share: one collective carries them all."""
        return self.kind, self.group, self.dtype, self.device, self.replicated


@dataclasses.dataclass(frozen=True)
class PartBucket:
    """One collective of a compiled graph: a gather of parts, or a reduce of gradients (a reduce-scatter
    of parts', an all-reduce of whole parameters'). Planned with its first six fields; the rest say
    where the rewrite put it, filled in from the rewritten graph (:mod:`graphddp.graph.describe_parts`)."""

    kind: str  # GATHER | REDUCE_SCATTER | ALL_REDUCE
    index: int  # the bucket's index among the graph's gathers, or among its reduces (both kinds)
    members: tuple[int, ...]  # positions in the graph's collectives of this kind, before the rewrite
    params: tuple[str, ...]  # graph inputs, or once placed parameter names (a tied weight under its first name), each once
    dtype: str  # what travels
    whole_bytes: int  # gathered (or the whole gradients reduce-scattered), padding included
    part_bytes: int = 0  # this rank's share: what it sends in a gather, receives from a reduce-scatter
    issue_at: int = -1  # position of the collective among the graph's nodes
    wait_at: int = -1  # position of its wait
    issued_after: str = ""  # the last node before the issue that is not part of a bucket
    waited_before: str = ""  # the first node after the wait that reads what it brought


@dataclasses.dataclass(frozen=True)
class PartCap:
    """The cap a graph's buckets closed at, and where it came from: ``"bucket_cap_mb"`` (given),
    or ``"planned (<the cost model's source>)"`` (:mod:`graphddp.plan.parts`)."""

    nbytes: int
    source: str


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
    # Once placed: the graph's nodes, a collective and its wait not compute (what its timeline is predicted from)
    facts: tuple[NodeFact, ...] = ()

    def of(self, *kinds: str) -> tuple[PartBucket, ...]:
        return tuple(b for b in self.buckets if b.kind in kinds)

    def wire_layout(self) -> tuple[tuple[str, str, int, tuple[str, ...]], ...]:
        """What its buckets send, in issue order (each one's kind, dtype, bytes, parameters): what the
        ranks must agree on. Node names and positions are left out, as in the fingerprint: a rank
        that recompiled a graph for other input shapes sends the same."""
        return tuple((b.kind, b.dtype, b.whole_bytes, b.params) for b in self.buckets)

    def in_flight_bytes(self, prefetch: int) -> int:
        """The most gathered bytes in flight at once: ``prefetch + 1`` consecutive gather buckets
        (the one being read, and those issued ahead of it)."""
        sizes = [b.whole_bytes for b in self.of("gather")]
        return max((sum(sizes[i:i + prefetch + 1]) for i in range(len(sizes))), default=0)


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


@dataclasses.dataclass(frozen=True)
class FullSchedule(FullScheduleTable):
    """``sharding="full"``'s schedule of one Dynamo graph: its compiled forward and backward (None until
    compiled: the backward compiles at its first call) and the rank's memory."""

    graph_index: int
    world_size: int
    reshard_after_forward: bool
    prefetch: int
    forward: PartGraph | None
    backward: PartGraph | None
    memory: RankMemory
    # Hybrid sharding: the shard groups' count; world_size is one group's, the parts' count. 1 without
    # a 2-D device_mesh=.
    replicas: int = 1
    choice: PlacementChoice | None = None  # sharding="auto": what it weighed and chose

    @property
    def graphs(self) -> tuple[PartGraph, ...]:
        return tuple(g for g in (self.forward, self.backward) if g is not None)

    def to_dict(self) -> dict:
        data = set_only(plain(self), replicas=1, choice=None)  # written only for hybrid sharding: the other plans keep their JSON
        for graph in (data["forward"], data["backward"]):
            for bucket in graph["buckets"] if graph is not None else ():
                del bucket["members"]  # the planner's positions, before the rewrite
        return {"sharding": "full", **data}

    @classmethod
    def from_dict(cls, data: dict) -> FullSchedule:
        """The schedule :meth:`to_dict` wrote; its buckets' ``members``, the planner's, come back empty."""
        def graph(d: dict | None) -> PartGraph | None:
            if d is None:
                return None
            buckets = tuple(PartBucket(**{**b, "members": (), "params": tuple(b["params"])}) for b in d["buckets"])
            cap = PartCap(**d["cap"]) if d["cap"] is not None else None
            facts = tuple(NodeFact(**{**f, "inputs": tuple(f["inputs"])}) for f in d.get("facts", ()))
            return PartGraph(**{**d, "buckets": buckets, "cap": cap, "updates": tuple(d["updates"]), "facts": facts})

        return cls(**{**fields_of(cls, data), "forward": graph(data["forward"]), "backward": graph(data["backward"]),
                      "memory": RankMemory(**data["memory"]), "choice": PlacementChoice.from_dict(data.get("choice"))})

    def fingerprint(self) -> str:
        """A hash of the plan: per graph, its buckets in issue order, each one's kind, parameters, dtype
        and sizes. Equal on ranks that compiled the same graphs, and between ``graphddp.explain`` and a
        run: node names and positions are left out (gloo's lowering of a collective takes more nodes
        than NCCL's, and explain's fake group takes NCCL's), and so is memory (the optimizer's state
        appears at its first step)."""
        plan = [
            [graph.kind, list(graph.updates)] + [[b.kind, b.index, list(b.params), b.dtype, b.whole_bytes, b.part_bytes] for b in graph.buckets]
            for graph in self.graphs
        ]
        head = [self.graph_index, self.world_size, self.reshard_after_forward, self.prefetch] + ([self.replicas] if self.replicas > 1 else [])
        head += [self.choice.chosen] if self.choice is not None else []
        return hashlib.sha256(json.dumps([head, plan]).encode()).hexdigest()[:16]
