"""``bucket_cap_mb="auto"``: the bucket partition that minimises the predicted backward.

Pure: production-ordered gradients, the backward's nodes and a cost model in, buckets out. No rank is
asked anything, so ranks with the same graph and cost model (calibration gives every rank the same
numbers) plan the same buckets.

The model is the one :func:`graphddp.plan.cost.simulate` predicts with:

* compute nodes run back to back; gradient ``k`` (in production order) is ready at ``r_k``, when the
  node that finalises it ends;
* a bucket is a run of consecutive gradients (one dtype and device); issuing its collective takes
  ``c`` of the compute lane (``collective_overhead_us``), pushing back everything after it; its
  collectives (:class:`Pricing`) take ``T(B) = A + beta * B`` for ``B`` bytes on the wire (``A``: their
  ring steps' latency; ``beta``: their bytes on the ring over the bandwidth) and start once its last
  gradient is ready, it is issued, and the link has finished the bucket before it;
* the backward ends when the compute (``C``, plus ``c`` per bucket) or the link's last bucket ends,
  whichever is later.

Algorithm (the optimal merge of MG-WFBP, Shi et al. 2019, over a static order, with the bucket count
in the state because every bucket costs compute time). Let ``F_k(j)`` be the earliest time the link
can have finished gradients ``1..j`` sent as exactly ``k`` buckets::

    F_0(0) = 0
    F_k(j) = min over k <= i <= j of  max(r_j + k c, F_{k-1}(i-1)) + T(bytes(i..j))
    best   = min over k of  max(C + k c, F_k(n))

``max(x, y) + t`` never decreases in ``y``, so an optimal partition's prefix can be swapped for any
prefix with as many buckets that finishes no later: the recurrence is exact for the model, and the
argmins rebuild the partition. Ties go to fewer buckets. Once ``max(C + k c, k A + beta B_total)``
(the compute's end, or the link's lower bound) reaches the best found, no partition with more buckets
can win, since both terms grow with ``k``; that ends the search. Each ``k`` is one vectorised
``n x n`` step: ``O(K n^2)`` arithmetic and ``O(n^2)`` memory for ``n`` gradients and at most ``K``
(:data:`MAX_BUCKETS`) buckets. Dtypes and devices are planned one after the other, each as if it had
the link alone.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphddp.plan.cost import CostModel, agreement_seconds, compute_timeline
from graphddp.plan.greedy import bucket_by_size
from graphddp.values.placement import Placement
from graphddp.values.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, CollectiveKind
from graphddp.values.schedule import GradSlot, NodeFact

# Partitions into more buckets than this are not considered (bounds time and memory; at DDP's
# 25 MB cap that is 3 GB of gradients per dtype and device).
MAX_BUCKETS = 128


@dataclasses.dataclass(frozen=True)
class Pricing:
    """The collectives a plan's buckets will run, so that the plan minimises what runs: ``backward``, each
    bucket's collective on its bytes on the wire, and ``alongside``, the sharded optimizer's all-gather
    of the bucket's updated parts on the parameters' own bytes, or None. The graph issues that
    all-gather after the next bucket's reduce-scatter (:data:`graphddp.values.shards.GATHER_LAG`); the
    model puts it right after its own. Every bucket is priced alike: a sharded plan cannot know which
    buckets will hold a parameter the graph cannot update, which stay all-reduces."""

    backward: CollectiveKind = ALL_REDUCE
    alongside: CollectiveKind | None = None
    # A gated plan of one CPU bucket carries the step's agreement in that bucket's all-reduce once the
    # step is steady (graphddp.runtime.steady); a plan of more pays a collective for it.
    agreement_in_one_bucket: bool = False
    # Hybrid sharding prices its reduce-scatter and all-gather over the shard group, the part's
    # all-reduce over the replicate group.
    placement: Placement | None = None

    def agreement(self, cost: CostModel, buckets: int, world_size: int) -> float:
        """What a plan of ``buckets`` buckets pays for the agreement beyond a one-bucket plan."""
        return agreement_seconds(cost, world_size) if self.agreement_in_one_bucket and buckets > 1 else 0.0

    @classmethod
    def of(cls, sharding: str | None, gather: str = "backward", placement: Placement | None = None) -> Pricing:
        """What ``DDPConfig.sharding`` and ``gather`` will run, over ``placement``'s groups: all-reduces
        replicated, else reduce-scatters, and all-gathers unless ``gather="forward"`` (the next forward's)."""
        if sharding is None:
            return REPLICATED
        return cls(REDUCE_SCATTER, ALL_GATHER if gather == "backward" else None, placement=placement)

    def seconds(self, cost: CostModel, wire_nbytes: float, gathered_nbytes: float, world_size: int) -> float:
        """One bucket's link time: its collective on ``wire_nbytes``, ``alongside`` on ``gathered_nbytes``. Bytes
        only, not yet a Bucket: every bucket priced alike, and without a placement each kind over every rank."""
        if self.placement is not None:
            return sum(self.placement.link_seconds(cost, int(wire_nbytes), None if self.alongside is None else int(gathered_nbytes)))
        alongside = 0.0 if self.alongside is None else self.alongside.seconds(cost, gathered_nbytes, world_size)
        return self.backward.seconds(cost, wire_nbytes, world_size) + alongside


REPLICATED = Pricing()


def best_partition(
    ready: Sequence[float], wire_nbytes: Sequence[int], cost: CostModel, world_size: int, compute_end: float,
    pricing: Pricing = REPLICATED, gathered_nbytes: float | None = None,
) -> tuple[list[int], float]:
    """Optimal runs of consecutive gradients: (index where each bucket starts, predicted end of the
    backward). ``ready`` is nondecreasing (production order); ``compute_end`` is when the compute ends
    without any collective issued. ``gathered_nbytes``: the bytes the ``alongside`` collectives carry
    in all (default: the bytes on the wire; a compression hook halves those, not the all-gathered
    parameters), spread over the gradients as their bytes on the wire are (one dtype: one ratio)."""
    n = len(ready)
    if n == 0:
        return [], compute_end
    f64 = torch.float64
    ratio = _gathered_ratio(wire_nbytes, gathered_nbytes)
    latency = pricing.seconds(cost, 0, 0, world_size)
    per_byte = (pricing.seconds(cost, 1 << 20, ratio * (1 << 20), world_size) - latency) / (1 << 20)
    issue = cost.collective_overhead_us * 1e-6
    r = torch.tensor(ready, dtype=f64)
    prefix = torch.cat([torch.zeros(1, dtype=f64), torch.tensor(wire_nbytes, dtype=f64).cumsum(0)])
    # send[j, i]: link time of the bucket of gradients i..j (0-based, i <= j); inf above j.
    send = latency + per_byte * (prefix[1:, None] - prefix[None, :-1])
    send = send.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("inf"))
    total = float(prefix[-1])
    before = torch.full((n,), float("inf"), dtype=f64)  # F_{k-1}(i-1) for i = 0..n-1
    before[0] = 0.0
    choices: list[torch.Tensor] = []
    best, best_k = float("inf"), 0
    for k in range(1, min(n, MAX_BUCKETS) + 1):
        if max(compute_end + k * issue, k * latency + per_byte * total) >= best:
            break  # k buckets' issues alone, or their latencies and bytes, take as long as the best plan
        link = torch.maximum((r + k * issue)[:, None], before[None, :]) + send
        done, start = link.min(dim=1)  # F_k(j) for j = 1..n, and where its last bucket starts
        choices.append(start)
        step = max(compute_end + k * issue, done[-1].item()) + pricing.agreement(cost, k, world_size)
        if step < best * (1 - 1e-9):  # a float-noise gain does not buy a bucket
            best, best_k = step, k
        before = torch.cat([torch.full((1,), float("inf"), dtype=f64), done[:-1]])
    starts, j = [], n
    for k in range(best_k, 0, -1):
        i = int(choices[k - 1][j - 1])
        starts.append(i)
        j = i
    return starts[::-1], best


# The model's errors the plan must tolerate: each is (compute speed-up, link speed-up) against the
# cost model. A model-optimal plan is fragile exactly where the model is wrong: on a busy link it sends
# late gradients as one large last bucket, hidden only if the link never idles; if the link or the
# compute is faster than modelled, that bucket is exposed whole. So the plan is chosen against all of
# these, not the nominal model alone.
SCENARIOS = ((1.0, 1.0), (1.5, 1.0), (1.0, 1.5))

# Fixed-cap plans (DDP's rule) that compete with the scenarios' optima. Each optimum is extreme for
# its own scenario; a cap plan is often the better compromise, and with them among the candidates the
# chosen plan's worst regret is never above any of these caps' (DDP's default, 1 then 25 MB, included).
CANDIDATE_CAPS_MB = ((1.0,), (2.0,), (4.0,), (8.0,), (16.0,), (25.0,), (1.0, 25.0))

# Plans whose worst regret is within this fraction of the smallest are near-ties; of those the plan of
# fewest buckets is chosen, then the one whose cuts come latest (a smaller last bucket, as SCENARIOS
# favours): an order that no figure moves. Two calibrations of one link differ by their noise, and a
# plan chosen by the exact minimum would flip between near-equal plans with it, each flip a recompile
# and another plan on a rerun. A gain this small is below what the cost model can promise (see
# docs/auto-plan.md), and fewer buckets issue fewer collectives, whose cost is the noisiest figure. A
# link that really changed, or noise larger than this, still replans.
NEAR_TIE = 0.05


def predicted_step(
    starts: Sequence[int], ready: Sequence[float], wire_nbytes: Sequence[int], cost: CostModel, world_size: int,
    compute_end: float, pricing: Pricing = REPLICATED, gathered_nbytes: float | None = None,
) -> float:
    """The backward the model predicts for buckets starting at ``starts``: what :func:`best_partition`
    minimises, with the same arguments."""
    issue = cost.collective_overhead_us * 1e-6
    ratio = _gathered_ratio(wire_nbytes, gathered_nbytes)
    bounds = list(starts) + [len(ready)]
    link = 0.0
    for k, (a, b) in enumerate(zip(bounds, bounds[1:]), start=1):
        wire = sum(wire_nbytes[a:b])
        link = max(ready[b - 1] + k * issue, link) + pricing.seconds(cost, wire, ratio * wire, world_size)
    return max(compute_end + (len(bounds) - 1) * issue, link) + pricing.agreement(cost, len(bounds) - 1, world_size)


def _gathered_ratio(wire_nbytes: Sequence[int], gathered_nbytes: float | None) -> float:
    """Bytes all-gathered per byte on the wire (2 under a half-precision hook, else 1)."""
    total = float(sum(wire_nbytes))
    return 1.0 if gathered_nbytes is None or total == 0 else gathered_nbytes / total


def capped_starts(nbytes: Sequence[int], caps_mb: Sequence[float]) -> tuple[int, ...]:
    """Where each bucket starts when gradients of ``nbytes`` (production order) are packed as DDP packs
    them, the last of ``caps_mb`` repeating."""
    limit = lambda closed: caps_mb[min(closed, len(caps_mb) - 1)] * (1 << 20)  # noqa: E731
    return tuple(group[0] for group in bucket_by_size(range(len(nbytes)), lambda _: 0, nbytes.__getitem__, limit))


def robust_partition(
    slots: Sequence[GradSlot], nodes: Sequence[NodeFact], cost: CostModel, world_size: int, ratio: float = 1.0,
    pricing: Pricing = REPLICATED,
) -> list[int]:
    """Where each bucket of ``slots`` (one dtype and device, production order) starts: of the optimal
    plans for every scenario in ``SCENARIOS`` and the plans of ``CANDIDATE_CAPS_MB``, the one whose
    worst ratio to each scenario's optimum is smallest, up to ``NEAR_TIE``. Under the nominal model
    alone (``SCENARIOS = ((1, 1),)``) this is within ``NEAR_TIE`` of :func:`best_partition`'s optimum."""
    wire = [int(s.nbytes * ratio) for s in slots]
    nbytes = [s.nbytes for s in slots]
    gathered = float(sum(nbytes))  # the all-gathers carry the parameters' own bytes
    cases = []
    for compute, link in SCENARIOS:
        scaled = cost.scaled(compute, link)
        _, finished, end = compute_timeline(nodes, scaled)
        ready = [finished.get(s.producer, end) for s in slots]
        starts, best = best_partition(ready, wire, scaled, world_size, end, pricing, gathered)
        cases.append((scaled, ready, end, best, tuple(starts)))

    def regret(starts: tuple[int, ...]) -> float:
        return round(max(
            predicted_step(starts, ready, wire, c, world_size, end, pricing, gathered) / max(best, 1e-12)
            for c, ready, end, best, _ in cases
        ), 9)

    capped = {capped_starts(nbytes, caps) for caps in CANDIDATE_CAPS_MB}
    worst = {starts: regret(starts) for starts in sorted({case[-1] for case in cases} | capped)}
    least = min(worst.values())
    near = [starts for starts, r in worst.items() if r <= least * (1 + NEAR_TIE)]
    return list(min(near, key=lambda starts: (len(starts), [-i for i in starts])))


def auto_partition(
    ordered: Sequence[GradSlot], nodes: Sequence[NodeFact], cost: CostModel, world_size: int,
    wire_ratio: Mapping[tuple[str, str], float] | None = None, *, sharding: str | None = None,
    gather: str = "backward", gated: bool = False, placement: Placement | None = None,
) -> list[tuple[GradSlot, ...]]:
    """Buckets of production-ordered ``ordered``, per (dtype, device) key, by :func:`robust_partition`;
    ``wire_ratio[key]`` scales bytes to bytes on the wire (a compression hook's half precision: 0.5).
    The plan prices what ``sharding`` and ``gather`` will run, since a reduce-scatter and the
    all-gathers favour other cuts than an all-reduce does. ``gated``: the all-reduces will run gated,
    so a plan of one CPU bucket saves the agreement's own collective (one dtype and device only: two
    are two buckets anyway).

    The arithmetic runs on real tensors even when the backward is compiled inside a fake mode (a
    dynamic-shape graph's backward is compiled at once, under it): there, turning a result into a float
    raised and torch hid the error, compiling the backward again later. Symbolic sizes cost nothing in
    ``nodes`` (:func:`graphddp.graph.capture.extract_facts`), never a rank's own size hint, so ranks
    planning dynamic graphs from different batches agree."""
    pricing = Pricing.of(sharding, gather, placement)
    keys = {(s.dtype, s.device.split(":")[0]) for s in ordered}
    if gated and len(keys) == 1 and next(iter(keys))[1] == "cpu":
        pricing = dataclasses.replace(pricing, agreement_in_one_bucket=True)
    by_key: dict[tuple[str, str], list[GradSlot]] = {}
    for slot in ordered:
        by_key.setdefault((slot.dtype, slot.device), []).append(slot)
    buckets: list[tuple[GradSlot, ...]] = []
    with unset_fake_temporarily():
        for key, slots in by_key.items():
            starts = robust_partition(slots, nodes, cost, world_size, (wire_ratio or {}).get(key, 1.0), pricing)
            bounds = starts + [len(slots)]
            buckets += [tuple(slots[a:b]) for a, b in zip(bounds, bounds[1:])]
    return buckets
