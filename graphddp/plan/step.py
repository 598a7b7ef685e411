"""The step each placement would take, predicted from the facts of one trace.

Why from one trace: ``sharding="auto"`` compares placements before the first step, and tracing the
model once per placement would cost a compile each. A placement changes the collectives and the
optimizer's share, not the model's compute, so every placement's step is read off the same
:class:`StepFacts` (one per Dynamo graph), with the collectives that placement would run.

Per graph, a step counts the forward and the backward on the cost model's two lanes (compute, and one
link where collectives run one at a time; each collective takes :func:`graphddp.plan.cost.host_seconds`
of the compute lane), and the optimizer's update over the parameters a rank updates (every one
replicated, its parts sharded) on the backward's compute lane, each bucket's after its reduce, so
that only the last bucket's is sure to be exposed.

* Replicated and ``sharding="optimizer"``: the buckets the planner would make
  (``bucket_cap_mb="auto"``); with ``gather="forward"`` the all-gathers of the updated parts are
  issued at the backward's end and each waited for where the next forward first reads its bucket,
  which it reads in the reverse of the backward's order.
* ``sharding="full"``: buckets under :func:`graphddp.plan.parts.planned_cap_bytes`. The forward reads
  the parameters in the reverse of their gradients' order, its compute spread over them by bytes;
  each bucket's all-gather is issued :data:`PREFETCH` buckets ahead and must end before its compute
  starts. The backward reduce-scatters each bucket once its last gradient is produced and, with
  ``reshard_after_forward``, gathers the bucket again before the compute that produces its
  gradients, as far ahead.

Node estimates miss what a rank's cores really do with the model's ops (one thread, the other ranks'
processes beside it): where the run's compute was measured (:func:`compute_scale`), each lane's
compute is scaled by measured over estimated, and the update is the measured seconds per byte of
graphddp's update (else a memory-bound pass).

Not counted: the compiled code's own temporaries, the agreement (the same for every placement), and a
GPU's launch gaps.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from graphddp.config import DDPConfig
from graphddp.plan.cost import agreement_seconds, bucket_seconds, compute_timeline, host_seconds, pays_agreement
from graphddp.plan.greedy import bucket_by_size
from graphddp.plan.parts import PREFETCH, SCATTER_LAG, planned_cap_bytes
from graphddp.plan.planner import plan, with_sharding
from graphddp.values.collectives import ALL_REDUCE
from graphddp.values.placement import Placement, flat
from graphddp.values.shards import GATHER_LAG
from graphddp.values.prediction import CostModel
from graphddp.values.schedule import GradSlot, GraphFacts, NodeFact, production_order


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """One Dynamo graph as every placement sees it."""

    backward: GraphFacts
    forward: tuple[NodeFact, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """A placement's predicted step, in seconds, and its parts."""

    seconds: float
    forward: float
    backward: float
    update: float  # inside the backward, each bucket's after its reduce: the last one's is exposed
    collectives: int  # per step: each costs the host its issue

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def update_seconds(nbytes: int, state_entries: int, cost: CostModel) -> float:
    """A memory-bound update of ``nbytes`` of parameters: each read and written, its gradient read, and
    ``state_entries`` state tensors of its size read and written."""
    return nbytes * (3 + 2 * state_entries) / (cost.memory_gbps * 1e9)


def compute_scale(graphs: Sequence[StepFacts], cost: CostModel, measured: tuple[float, float]) -> tuple[float, float]:
    """The ``measured`` forward's and backward's seconds over their node estimates under ``cost``, to two
    significant figures (a rerun's noise then rarely moves it)."""
    estimated = (sum(compute_timeline(g.forward, cost)[2] for g in graphs),
                 sum(compute_timeline(g.backward.nodes, cost)[2] for g in graphs))
    return tuple(float(f"{m / e:.2g}") if e > 0 and m > 0 else 1.0 for m, e in zip(measured, estimated))  # type: ignore[return-value]


def predict_step(
    graphs: Sequence[StepFacts], cost: CostModel, world_size: int, sharding: str | None = None, *, gather: str = "backward",
    reshard_after_forward: bool = True, placement: Placement | None = None, state_entries: int = 0,
    compute: tuple[float, float] = (1.0, 1.0), update_per_byte: float | None = None, whole_below: int = 0,
    precision: tuple[float, float] = (1.0, 1.0),
) -> StepPrediction:
    """The step of ``graphs`` on ``world_size`` ranks under ``sharding`` (None: replicated), ``placement``
    the parts' groups (default: over every rank). ``whole_below``: under full sharding, parameters of
    fewer bytes are held whole (never gathered, their gradients all-reduced over every rank, their
    update whole). ``state_entries``: the optimizer's state tensors per parameter (AdamW 2, SGD with
    momentum 1); ``compute``: :func:`compute_scale`'s factors; ``update_per_byte``: the optimizer's
    step measured, seconds per byte of the parameters it updates (else :func:`update_seconds`).
    ``precision``: where ``graphs`` were traced in a mixed-precision policy's ``param_dtype``, the
    bytes a parameter holds and a gradient is reduced in per byte the graphs compute them in."""
    placement = placement or flat("", world_size)
    lanes = (cost.scaled(1 / compute[0], 1.0), cost.scaled(1 / compute[1], 1.0))
    forward = backward = update = 0.0
    collectives = 0
    whole = whole_below / precision[0] if sharding == "full" else 0  # as the graphs compute them
    for graph in graphs:
        params = sum(s.nbytes for s in graph.backward.slots) * precision[0]
        kept = sum(s.nbytes for s in graph.backward.slots if s.nbytes < whole) * precision[0]
        share = (params - kept) / placement.shard.size + kept if sharding else params
        upd = share * update_per_byte if update_per_byte is not None else update_seconds(share, state_entries, cost)
        if sharding == "full":
            fwd, bwd, count = _full(graph, cost, lanes, placement, reshard_after_forward, upd, world_size, whole, precision[1])
        else:
            fwd, bwd, count = _bucketed(graph, cost, lanes, world_size, sharding, gather, placement, upd)
        forward, backward, update, collectives = forward + fwd, backward + bwd, update + upd, collectives + count
    return StepPrediction(forward + backward, forward, backward, update, collectives)


def _bucketed(
    graph: StepFacts, planned: CostModel, lanes: tuple[CostModel, CostModel], world_size: int, sharding: str | None, gather: str,
    placement: Placement, update: float,
) -> tuple[float, float, int]:
    """Replicated or ``sharding="optimizer"``: the buckets a run plans with ``planned``, on the
    backward's lanes. Replicated buckets are waited for at the backward's end, each updated after its
    wait; sharded ones :data:`GATHER_LAG` buckets later, each then updated and its all-gather issued.
    Deferred gathers (``gather="forward"``) are issued at the backward's end, the bucket the forward
    reads first (the last) first."""
    cost = lanes[1]
    config = DDPConfig(cost=planned, sharding=sharding, gather=gather)
    schedule = plan(graph.backward, config, world_size=world_size, placement=placement if sharding else None)
    if sharding:
        schedule = with_sharding(schedule, {s.param_name for s in graph.backward.slots}, gather, placement)
    _, finished, end = compute_timeline(schedule.nodes, cost)
    order = sorted(schedule.buckets, key=lambda b: finished.get(b.issue_after, end))
    total = max(sum(b.nbytes for b in order), 1)
    # simulate's link times, the all-gather apart: it is issued after the bucket's update, GATHER_LAG buckets later
    buckets = [_Bucket(*bucket_seconds(schedule, b, cost), update=update * b.nbytes / total) for b in order]
    backward = _backward_lane(_segments([finished.get(b.issue_after, end) for b in order], end), buckets, cost,
                              GATHER_LAG if sharding else None)
    if pays_agreement(schedule):
        backward += agreement_seconds(cost, world_size)
    count = len(order) * (1 + (sharding is not None) + (sharding is not None and placement.hybrid))
    forward = compute_timeline(graph.forward, lanes[0])[2]
    if sharding and gather == "forward":
        sizes = [b.nbytes for b in reversed(order)]
        gathers = [placement.gather_seconds(cost, n) for n in sizes]
        forward = _gathered_lane([forward * n / total for n in sizes], gathers, cost, prefetch=len(sizes))
    return forward, backward, count


def _full(
    graph: StepFacts, planned: CostModel, lanes: tuple[CostModel, CostModel], placement: Placement, reshard: bool, update: float,
    world_size: int, whole_below: float = 0, reduce_scale: float = 1.0,
) -> tuple[float, float, int]:
    """``sharding="full"``'s lanes (module docstring); each reduce waited :data:`SCATTER_LAG` buckets
    later, its parameters then updated. Gradients of fewer than ``whole_below`` bytes are of
    parameters held whole: bucketed apart, never gathered, all-reduced over the ``world_size`` ranks;
    every reduce sends ``reduce_scale`` bytes per byte of gradient."""
    cost = lanes[1]
    slots = sorted(graph.backward.slots, key=production_order)
    total = sum(s.nbytes for s in slots)
    held = lambda s: s.nbytes < whole_below  # noqa: E731
    cap = planned_cap_bytes(planned, sum(s.nbytes for s in slots if not held(s)), placement.shard.size, reshard, placement)
    groups = [  # each kind bucketed apart, in the order their last gradients come (graphddp.plan.parts)
        group for whole in (True, False)
        for group in bucket_by_size([s for s in slots if held(s) == whole], key=lambda s: (s.dtype, s.device), nbytes=lambda s: s.nbytes,
                                    limit=lambda _: cap, consecutive=True)
    ]
    groups.sort(key=lambda group: production_order(_last(group)))
    sizes = [sum(s.nbytes for s in b) for b in groups]
    whole = [held(b[0]) for b in groups]
    gathers = [0.0 if w else placement.gather_seconds(cost, n) for n, w in zip(sizes, whole)]
    fwd_compute = compute_timeline(graph.forward, lanes[0])[2]
    forward = _gathered_lane([fwd_compute * n / max(total, 1) for n in reversed(sizes)], list(reversed(gathers)), cost, PREFETCH)
    _, finished, end = compute_timeline(graph.backward.nodes, cost)
    sent = [int(n * reduce_scale) for n in sizes]
    buckets = [_Bucket(ALL_REDUCE.seconds(cost, s, world_size) if w else placement.reduce_seconds(cost, s), 0.0,
                       update * n / max(total, 1), g if reshard else 0.0) for n, s, w, g in zip(sizes, sent, whole, gathers)]
    backward = _backward_lane(_segments([finished.get(_last(b).producer, end) for b in groups], end), buckets, cost, SCATTER_LAG)
    collectives = sum(1 if w else 2 + reshard + placement.hybrid for w in whole)
    return forward, backward, collectives


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One bucket on the backward's lanes: its link seconds (reduce; all-gather in the backward;
    gathered again before its gradients; 0: none) and its update's compute seconds."""

    reduce: float
    gather: float
    update: float
    regather: float = 0.0


def _segments(ready: list[float], end: float) -> list[float]:
    """The compute between consecutive buckets' ready times, then after the last one's."""
    return [r - p for r, p in zip(ready, [0.0] + ready[:-1])] + [end - (ready[-1] if ready else 0.0)]


def _last(bucket: list[GradSlot]) -> GradSlot:
    return max(bucket, key=production_order)


@dataclasses.dataclass
class _Lanes:
    """The compute lane's clock and the link's: a collective issued costs the compute lane
    :func:`host_seconds`, then runs on the link once the link is free, one at a time."""

    cost: CostModel
    clock: float = 0.0
    link: float = 0.0

    def issue(self, seconds: float) -> float:
        """Issue a collective of ``seconds`` on the link; returns when it ends."""
        self.clock += host_seconds(self.cost, seconds)
        self.link = max(self.link, self.clock) + seconds
        return self.link

    def issue_through(self, ends: list[float], seconds: Sequence[float], last: int) -> None:
        """Issue ``seconds[len(ends)..last]`` in order (0: nothing to issue), appending when each ends."""
        while len(ends) <= min(last, len(seconds) - 1):
            s = seconds[len(ends)]
            ends.append(self.issue(s) if s else 0.0)


def _gathered_lane(compute: list[float], gathers: list[float], cost: CostModel, prefetch: int) -> float:
    """Compute segments, each needing its bucket gathered first (``gathers``: its link seconds, 0 for
    nothing to gather), issued ``prefetch`` segments ahead. Returns when the last segment ends."""
    lanes = _Lanes(cost)
    ends: list[float] = []
    for i in range(len(gathers)):
        lanes.issue_through(ends, gathers, i + prefetch)
        lanes.clock = max(lanes.clock, ends[i]) + compute[i]
    return lanes.clock


def _backward_lane(segments: list[float], buckets: list[_Bucket], cost: CostModel, lag: int | None) -> float:
    """The backward: segment ``i`` produces bucket ``i``'s gradients (after its parameters are gathered
    again where it has a ``regather``, issued :data:`PREFETCH` buckets ahead), then its reduce is
    issued; ``lag`` buckets later (None: after the last segment) it is waited for, its update runs and
    its all-gather is issued. Returns when both lanes are done."""
    lanes = _Lanes(cost)
    reduced: list[float] = []
    regathered: list[float] = []
    regathers = [b.regather for b in buckets]

    def finish(j: int) -> None:
        lanes.clock = max(lanes.clock, reduced[j]) + buckets[j].update
        if buckets[j].gather:
            lanes.issue(buckets[j].gather)

    done = 0
    for i, seconds in enumerate(segments):
        if i < len(buckets) and buckets[i].regather:
            lanes.issue_through(regathered, regathers, i + PREFETCH)
            lanes.clock = max(lanes.clock, regathered[i])
        lanes.clock += seconds
        if i < len(buckets):
            reduced.append(lanes.issue(buckets[i].reduce))
            if lag is not None and i >= lag:
                finish(done)
                done += 1
    for j in range(done, len(buckets)):
        finish(j)
    return max(lanes.clock, lanes.link)
