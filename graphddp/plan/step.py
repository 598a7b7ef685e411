"""The step each placement would take, predicted from the facts of one trace.

Why from one trace: ``sharding="auto"`` compares placements before the first step, and tracing
the model once per placement would cost a compile each. A placement changes the collectives and
the optimizer's share, not the model's compute: every placement's step is read off the same
:class:`StepFacts` (one per Dynamo graph: the backward's nodes and gradients in production order,
and the forward's compute nodes), with the collectives each placement would run.

What a step counts, per graph: the forward's compute; the backward as the cost model's two lanes
(compute, and one link where collectives run one at a time), each collective's issue taking
``collective_overhead_us`` of the compute lane; the optimizer's update as a memory-bound pass
over the parameters a rank updates (every one replicated, its parts sharded).

* Replicated and ``sharding="optimizer"``: the backward is :func:`graphddp.plan.cost.simulate` of
  the buckets the planner would make (``bucket_cap_mb="auto"``); with ``gather="forward"`` the
  all-gathers of the updated parts run on the link during the next forward instead.
* ``sharding="full"``: buckets by :func:`graphddp.plan.parts.planned_cap_bytes`. The forward reads
  the parameters in the reverse of their gradients' order, its compute spread over them by bytes;
  each bucket's all-gather is issued :data:`PREFETCH` buckets ahead and must end before its
  compute starts. The backward reduce-scatters each bucket once its last gradient is produced and,
  with ``reshard_after_forward``, gathers the bucket again before the compute that produces its
  gradients, as far ahead.

Not counted: the compiled code's own temporaries, the agreement (the same for every placement),
and a GPU's launch gaps (what the host costs is ``collective_overhead_us`` and ``op_overhead_us``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from graphddp.config import DDPConfig
from graphddp.plan.cost import compute_timeline, simulate
from graphddp.plan.greedy import bucket_by_size
from graphddp.plan.parts import PREFETCH, planned_cap_bytes
from graphddp.plan.planner import plan, with_sharding
from graphddp.values.placement import Placement, flat
from graphddp.values.prediction import CostModel
from graphddp.values.schedule import GradSlot, GraphFacts, NodeFact



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
    update: float
    collectives: int  # per step: each costs the host its issue

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def update_seconds(nbytes: int, state_entries: int, cost: CostModel) -> float:
    """A memory-bound update of ``nbytes`` of parameters: each read and written, its gradient read,
    and ``state_entries`` state tensors of its size read and written."""
    return nbytes * (3 + 2 * state_entries) / (cost.memory_gbps * 1e9)


def predict_step(
    graphs: Sequence[StepFacts], cost: CostModel, world_size: int, sharding: str | None = None, *, gather: str = "backward",
    reshard_after_forward: bool = True, placement: Placement | None = None, state_entries: int = 0,
) -> StepPrediction:
    """The step of ``graphs`` on ``world_size`` ranks under ``sharding`` (None: replicated;
    ``"optimizer"``; ``"full"``), ``placement`` the parts' groups (default: over every rank).
    ``state_entries``: the optimizer's state tensors per parameter (AdamW 2, SGD with momentum 1)."""
    placement = placement or flat("", world_size)
    forward = backward = update = 0.0
    collectives = 0
    for graph in graphs:
        fwd = compute_timeline(graph.forward, cost)[2]
        params = sum(s.nbytes for s in graph.backward.slots)
        share = params / placement.shard.size if sharding else params
        update += update_seconds(share, state_entries, cost)
        if sharding == "full":
            fwd, bwd, count = _full(graph, cost, placement, reshard_after_forward)
        else:
            fwd, bwd, count = _bucketed(graph, cost, world_size, sharding, gather, placement, fwd)
        forward, backward, collectives = forward + fwd, backward + bwd, collectives + count
    return StepPrediction(forward + backward + update, forward, backward, update, collectives)


def _bucketed(
    graph: StepFacts, cost: CostModel, world_size: int, sharding: str | None, gather: str, placement: Placement, fwd: float,
) -> tuple[float, float, int]:
    """Replicated or ``sharding="optimizer"``: the planner's buckets, simulated; deferred gathers
    (``gather="forward"``) run on the link while the next forward computes."""
    config = DDPConfig(cost=cost, sharding=sharding, gather=gather)
    schedule = plan(graph.backward, config, world_size=world_size, placement=placement if sharding else None)
    if sharding:
        schedule = with_sharding(schedule, {s.param_name for s in graph.backward.slots}, gather, placement)
    backward = simulate(schedule, cost).step_seconds
    count = len(schedule.buckets) * (1 + (sharding is not None) + (sharding is not None and placement.hybrid))
    if sharding and gather == "forward":
        link = sum(placement.gather_seconds(cost, b.nbytes) for b in schedule.buckets)
        fwd = max(fwd + len(schedule.buckets) * cost.collective_overhead_us * 1e-6, link)
    return fwd, backward, count


def _full(graph: StepFacts, cost: CostModel, placement: Placement, reshard: bool) -> tuple[float, float, int]:
    """``sharding="full"``: the forward's and the backward's two lanes (module docstring)."""
    slots = sorted(graph.backward.slots, key=lambda s: (s.position, s.output_index))
    total = sum(s.nbytes for s in slots)
    cap = planned_cap_bytes(cost, total, placement.shard.size, reshard, placement)
    buckets = bucket_by_size(slots, key=lambda s: (s.dtype, s.device), nbytes=lambda s: s.nbytes, limit=lambda _: cap, consecutive=True)
    sizes = [sum(s.nbytes for s in b) for b in buckets]
    issue = cost.collective_overhead_us * 1e-6
    fwd_compute = compute_timeline(graph.forward, cost)[2]
    forward = _gathered_lane([fwd_compute * n / max(total, 1) for n in reversed(sizes)], list(reversed(sizes)), cost, placement, issue)
    # The backward: compute segments end where each bucket's last gradient is produced.
    _, finished, end = compute_timeline(graph.backward.nodes, cost)
    ready = [finished.get(_last(b).producer, end) for b in buckets]
    segments = [r - p for r, p in zip(ready, [0.0] + ready[:-1])] + [end - (ready[-1] if ready else 0.0)]
    backward = _backward_lane(segments, sizes, cost, placement, issue, reshard)
    collectives = len(buckets) * (2 + reshard + placement.hybrid)
    return forward, backward, collectives


def _last(bucket: list[GradSlot]) -> GradSlot:
    return max(bucket, key=lambda s: (s.position, s.output_index))


def _gathered_lane(compute: list[float], sizes: list[int], cost: CostModel, placement: Placement, issue: float) -> float:
    """Compute segments, each needing its bucket gathered first; gathers issued ``PREFETCH``
    segments ahead, one at a time on the link. Returns when the last segment ends."""
    clock = link = 0.0
    ends: list[float] = []
    for i in range(len(sizes)):
        if i == 0:
            for j in range(min(PREFETCH + 1, len(sizes))):  # the first gathers, issued before any compute
                clock += issue
                link = max(link, clock) + placement.gather_seconds(cost, sizes[j])
                ends.append(link)
        elif i + PREFETCH < len(sizes):
            clock += issue
            link = max(link, clock) + placement.gather_seconds(cost, sizes[i + PREFETCH])
            ends.append(link)
        clock = max(clock, ends[i]) + compute[i]
    return clock


def _backward_lane(segments: list[float], sizes: list[int], cost: CostModel, placement: Placement, issue: float, reshard: bool) -> float:
    """The backward: segment ``i`` produces bucket ``i``'s gradients (with resharding, after its
    parameters are gathered again), then its reduce-scatter is issued; the last segment is the
    compute after the last gradient. Returns when both lanes are done."""
    clock = link = 0.0
    gathered: list[float] = []
    for i, seconds in enumerate(segments):
        if reshard and i < len(sizes):
            while len(gathered) <= min(i + PREFETCH, len(sizes) - 1):
                clock += issue
                link = max(link, clock) + placement.gather_seconds(cost, sizes[len(gathered)])
                gathered.append(link)
            clock = max(clock, gathered[i])
        clock += seconds
        if i < len(sizes):
            clock += issue
            link = max(link, clock) + placement.reduce_seconds(cost, sizes[i])
    return max(clock, link)
