"""Pure bucket planning: ``plan(facts, config) -> Schedule``.

No graph edits and no process-group calls happen here. The input is :class:`GraphFacts`
(production order of every gradient) and :class:`DDPConfig`; the output depends on nothing
else, so every rank that traced the same graph computes the same plan.

Algorithm (DDP's ``_compute_bucket_assignment_by_size`` applied to the static production
order instead of registration order):

1. Walk gradients in production order (topological position of the node that finalises
   each gradient, ties broken by output index).
2. Keep one open bucket per (dtype, device); buckets never mix the two.
3. Add the gradient to its open bucket; once the bucket holds >= its cap, close it. The
   first bucket of each key uses ``first_bucket_cap_mb``, later ones ``bucket_cap_mb``.
   With ``last_bucket_cap_mb``, the gradients produced last (a suffix of at most that many
   bytes, at least one gradient) form a bucket of their own: that bucket can only start
   once the backward has no compute left, so its whole transfer is exposed and should be
   small. Without it the last bucket is whatever remains, up to a full cap (DDP's rule).
4. Close the remaining open buckets. Buckets are issued in the order they became ready
   (position of their last gradient), which is the order the rewrite inserts them.
"""
from __future__ import annotations

from graphddp.capture import GradSlot, GraphFacts
from graphddp.config import DDPConfig
from graphddp.schedule import Bucket, Schedule


def partition(slots: tuple[GradSlot, ...], config: DDPConfig) -> list[tuple[GradSlot, ...]]:
    """Group production-ordered slots into buckets; returns buckets in ready order."""
    ordered = sorted(slots, key=lambda s: (s.position, s.output_index))
    tails = _tails(ordered, config.last_bucket_cap_bytes) if config.last_bucket_cap_mb is not None else {}
    in_tail = {id(s) for tail in tails.values() for s in tail}
    open_buckets: dict[tuple[str, str], list[GradSlot]] = {}
    closed_count: dict[tuple[str, str], int] = {}
    done: list[tuple[GradSlot, ...]] = [tuple(t) for t in tails.values()]
    for slot in ordered:
        if id(slot) in in_tail:
            continue
        key = (slot.dtype, slot.device)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(slot)
        cap = config.first_bucket_cap_bytes if closed_count.get(key, 0) == 0 else config.bucket_cap_bytes
        if sum(s.nbytes for s in bucket) >= cap:
            done.append(tuple(bucket))
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key]
    done.extend(tuple(b) for b in open_buckets.values())  # dict order: first-opened first
    done.sort(key=lambda b: (b[-1].position, b[-1].output_index))
    return done


def _tails(ordered: list[GradSlot], cap: int) -> dict[tuple[str, str], list[GradSlot]]:
    """Per (dtype, device): the last-produced gradients, at most ``cap`` bytes (at least one)."""
    tails: dict[tuple[str, str], list[GradSlot]] = {}
    full: set[tuple[str, str]] = set()
    for slot in reversed(ordered):
        key = (slot.dtype, slot.device)
        tail = tails.setdefault(key, [])
        if key in full or (tail and sum(s.nbytes for s in tail) + slot.nbytes > cap):
            full.add(key)
            continue
        tail.insert(0, slot)
    return tails


def plan(
    facts: GraphFacts,
    config: DDPConfig,
    *,
    graph_index: int = 0,
    unreduced: tuple[str, ...] = (),
) -> Schedule:
    """Plan the buckets of one backward graph. Pure: same inputs, same Schedule."""
    compute = [n for n in facts.nodes if n.is_compute]
    output_position = len(facts.nodes) - 1
    buckets = []
    for index, slots in enumerate(partition(facts.slots, config)):
        ready = slots[-1]
        overlap = tuple(n.name for n in compute if ready.position < n.position < output_position)
        buckets.append(
            Bucket(
                index=index,
                slots=slots,
                dtype=ready.dtype,
                device=ready.device,
                issue_after=ready.producer,
                wait_before="output",
                overlap=overlap,
                comm_dtype=config.comm_dtype if config.comm_dtype not in (None, ready.dtype) else None,
            )
        )
    return Schedule(
        graph_index=graph_index,
        world_size=config.world_size,
        group_name=config.group_name,
        bucket_cap_mb=config.bucket_cap_mb,
        first_bucket_cap_mb=config.first_bucket_cap_mb,
        last_bucket_cap_mb=config.last_bucket_cap_mb,
        buckets=tuple(buckets),
        unreduced=unreduced,
        nodes=facts.nodes,
    )
