"""Pure bucket planning: ``plan(facts, config) -> Schedule``.

No graph edits and no process-group calls: the output depends on the :class:`GraphFacts` and the
:class:`DDPConfig` only, so every rank that traced the same graph computes the same plan.

Algorithm (DDP's ``compute_bucket_assignment_by_size``, as its reducer runs it when it rebuilds
buckets in gradient-ready order, applied to the static production order): walk the gradients in
production order (the topological position of the node that finalises each, then the output index)
and pack them by :func:`graphddp.plan.greedy.bucket_by_size`, one open bucket per (dtype, device),
buckets never mixing the two. Each (dtype, device) walks ``config.bucket_size_limits`` one cap per
bucket, the last repeating (DDP's defaults: 1 MB, then 25 MB). With ``last_bucket_cap_mb`` the
gradients produced last (a suffix of at most that many bytes, at least one gradient) form a bucket of
their own: that bucket can only start once the backward has no compute left, so its whole transfer is
exposed and should be small. Buckets are issued in the order they became ready (the position of
their last gradient), the order the rewrite inserts them.

With ``bucket_cap_mb="auto"`` :func:`graphddp.plan.auto.auto_partition` partitions the same order
instead, minimising the backward ``config.cost`` predicts (its defaults when none was resolved); the
Schedule records that cost model instead of caps.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

import torch

from graphddp.config import DDPConfig
from graphddp.plan.auto import auto_partition
from graphddp.plan.greedy import bucket_by_size
from graphddp.values.collectives import SHARDED
from graphddp.values.placement import Placement, flat
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, CostModel, GradSlot, GraphFacts, NodeFact, Schedule, production_order

DtypeDevice = tuple[str, str]  # buckets never mix either


def partition(
    slots: tuple[GradSlot, ...], config: DDPConfig, nodes: tuple[NodeFact, ...] = (), world_size: int = 1,
    like: tuple[tuple[GradSlot, ...], ...] | None = None, fill: bool = False, gated: bool = False,
    placement: Placement | None = None,
) -> list[tuple[GradSlot, ...]]:
    """Group production-ordered slots into buckets; returns buckets in ready order.

    ``nodes`` and ``world_size`` matter only to ``bucket_cap_mb="auto"``: the compute the all-reduces
    overlap with, and the ring they run on. ``like`` and ``fill``: :func:`plan`'s ``like``, with ``fill``
    keeping a gradient this graph lacks as a zero-filled slot."""
    ordered = sorted(slots, key=production_order)
    if like is not None:  # in like's order: what a hook's random draws and state follow, as in DDP
        return _as_like(ordered, like, fill)
    if config.auto:
        done = auto_partition(
            ordered, nodes, cost_of(config), world_size, _wire_ratios(ordered, config.comm_dtype),
            sharding=config.sharding, gather=config.gather, gated=gated, placement=placement,
        )
    else:
        tails = _tails(ordered, config.last_bucket_cap_bytes) if config.last_bucket_cap_mb is not None else {}
        in_tail = {id(s) for tail in tails.values() for s in tail}
        body = [s for s in ordered if id(s) not in in_tail]
        done = _assign_by_size(body, config.bucket_size_limits) + [tuple(t) for t in tails.values()]
    return sorted(done, key=lambda b: production_order(b[-1]))


def _as_like(ordered: list[GradSlot], like: tuple[tuple[GradSlot, ...], ...], fill: bool) -> list[tuple[GradSlot, ...]]:
    """``like``'s buckets over this graph's slots."""
    current = {s.param_name: s for s in ordered}
    missing = sorted(set(current) - {s.param_name for b in like for s in b})
    if missing:
        raise ValueError(f"like= does not hold the gradients of {missing}")
    done = []
    for bucket in like:
        slots = tuple(
            current[s.param_name] if s.param_name in current else s.zero_filled_copy()
            for s in bucket if fill or s.param_name in current
        )
        if slots:
            done.append(slots)
    return done


def cost_of(config: DDPConfig) -> CostModel:
    """The cost model an auto plan minimises: the resolved one, else the defaults, saying so."""
    return config.cost if config.cost is not None else CostModel(source="default: no cost model was given or calibrated")


def _wire_ratios(slots: list[GradSlot], comm_dtype: str | None) -> dict[tuple[str, str], float]:
    """Bytes on the wire per byte of gradient, per (dtype, device): a compression hook's dtype over the gradient's."""
    if comm_dtype is None:
        return {}
    size = lambda name: torch.empty((), dtype=getattr(torch, name)).element_size()  # noqa: E731
    return {(s.dtype, s.device): size(comm_dtype) / size(s.dtype) for s in slots}


def _assign_by_size(ordered: list[GradSlot], limits: tuple[int, ...]) -> list[tuple[GradSlot, ...]]:
    """DDP's ``compute_bucket_assignment_by_size`` over slots already in production order (module docstring)."""
    key, limit = (lambda s: (s.dtype, s.device)), (lambda closed: limits[min(closed, len(limits) - 1)])
    return [tuple(b) for b in bucket_by_size(ordered, key, lambda s: s.nbytes, limit)]


def _tails(ordered: list[GradSlot], cap: int) -> dict[DtypeDevice, list[GradSlot]]:
    """Per (dtype, device): the last-produced gradients, at most ``cap`` bytes (at least one)."""
    tails: dict[DtypeDevice, list[GradSlot]] = {}
    sizes: dict[DtypeDevice, int] = {}
    full: set[DtypeDevice] = set()
    for slot in reversed(ordered):
        key = (slot.dtype, slot.device)
        tail = tails.setdefault(key, [])
        if key in full or (tail and sizes[key] + slot.nbytes > cap):
            full.add(key)
            continue
        tail.insert(0, slot)
        sizes[key] = sizes.get(key, 0) + slot.nbytes
    return tails


def plan(
    facts: GraphFacts,
    config: DDPConfig,
    *,
    world_size: int = 1,
    group_name: str = "",
    graph_index: int = 0,
    unreduced: tuple[str, ...] = (),
    hook: str | None = None,
    like: tuple[tuple[GradSlot, ...], ...] | None = None,
    gated: bool = False,
    placement: Placement | None = None,
) -> Schedule:
    """Plan the buckets of one backward graph. Pure: same inputs, same Schedule.

    ``config`` is the user's policy; ``world_size`` and ``group_name`` are facts of the job (the
    process group), recorded in the Schedule: the divisor and the group of every all-reduce. The
    buckets do not depend on them. ``hook`` names a user's traced hook (``graphddp.hooks.traced``) that
    every bucket runs instead of the all-reduce. ``like``: the buckets (their slots) of an earlier plan
    of these gradients or more, kept as they are and in their order: a recompiled graph puts the same
    buckets on the wire as the graph it replaces, on every rank, whatever its sizes or costs. With a
    ``hook`` a gradient the earlier plan had and this graph lacks keeps its place as zeros (DDP's hook
    sees the same bucket, zeros for an unused parameter); without one it leaves the bucket. ``gated``:
    the graph's all-reduces run gated (:mod:`graphddp.runtime.gate`), recorded in the Schedule and
    priced by an auto plan. ``placement``: where sharded buckets will live (:func:`with_sharding`
    records it), which an auto plan prices.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    compute = [n for n in facts.nodes if n.is_compute]
    output_position = len(facts.nodes) - 1
    buckets = []
    for index, slots in enumerate(partition(facts.slots, config, facts.nodes, world_size, like, fill=hook is not None, gated=gated, placement=placement)):
        ready = max(slots, key=lambda s: s.position)  # all zero-filled: ready when the backward starts
        issue_after = ready.producer if not ready.zero_filled else facts.nodes[0].name
        overlap = tuple(n.name for n in compute if ready.position < n.position < output_position)
        buckets.append(
            Bucket(
                index=index,
                slots=slots,
                dtype=ready.dtype,
                device=ready.device,
                issue_after=issue_after,
                wait_before=WAIT_AT_OUTPUT,
                overlap=overlap,
                comm_dtype=config.comm_dtype if config.comm_dtype not in (None, ready.dtype) else None,
                hook=hook,
            )
        )
    return Schedule(
        graph_index=graph_index,
        world_size=world_size,
        group_name=group_name,
        bucket_cap_mb=None if config.auto else config.effective_bucket_cap_mb,  # resolved: tables show real caps
        first_bucket_cap_mb=None if config.auto else config.effective_first_bucket_cap_mb,
        cost_model=cost_of(config) if config.auto else None,
        last_bucket_cap_mb=config.last_bucket_cap_mb,
        buckets=tuple(buckets),
        unreduced=unreduced,
        nodes=facts.nodes,
        gated=gated and bool(buckets),
    )


def with_updates(
    schedule: Schedule, updatable: Collection[str], optimizer: str, max_grad_norm: float | None = None, grad_norm_type: float = 2.0,
) -> Schedule:
    """``schedule`` with every bucket updating its ``updatable`` parameters in the graph
    (``Bucket.updates``, in slot order), ``optimizer`` recorded, and with ``max_grad_norm`` the
    gradients clipped first (by their ``grad_norm_type`` norm). Pure, like ``plan``: which parameters
    may be updated in the graph is the caller's fact (the optimizer holds them); where each update runs
    follows from the buckets and the clipping (:meth:`Schedule.update_after`).
    """
    buckets = tuple(
        dataclasses.replace(b, updates=tuple(n for n in b.param_names if n in updatable)) for b in schedule.buckets
    )
    return dataclasses.replace(schedule, buckets=buckets, optimizer=optimizer, max_grad_norm=max_grad_norm,
                               grad_norm_type=grad_norm_type if max_grad_norm is not None else 2.0)


def with_sharding(schedule: Schedule, updatable: Collection[str], gather: str = "backward", placement: Placement | None = None) -> Schedule:
    """``schedule`` with every bucket whose parameters can all be updated inside the graph
    reduce-scattered instead of all-reduced, for the optimizer on a shard (:mod:`graphddp.optim.shard`).
    A bucket holding a parameter the graph cannot update (tied across a graph break) stays an
    all-reduce: the parameter is stepped after the backward, on its shard too. ``gather``: where each
    sharded bucket's all-gather completes (``Bucket.gather``); ``placement``: where their parts live
    (default: sharded over the schedule's group, every rank). Pure, like ``plan``."""
    placement = placement or flat(schedule.group_name, schedule.world_size)
    if placement.world != schedule.world_size:
        raise ValueError(f"graphddp: a placement over {placement.world} ranks for a schedule of {schedule.world_size}")
    buckets = tuple(
        dataclasses.replace(b, collective=SHARDED, gather=gather) if b.slots and all(n in updatable for n in b.param_names) else b
        for b in schedule.buckets
    )
    return dataclasses.replace(schedule, buckets=buckets, placement=placement)


def with_wire_bytes(schedule: Schedule, wire: Mapping[int, int]) -> Schedule:
    """``schedule`` with each hooked bucket's bytes on the wire (bucket index -> bytes), as
    read from the rewritten graph: a user's hook decides them, not the plan."""
    buckets = tuple(
        dataclasses.replace(b, hook_wire_nbytes=wire.get(b.index, 0)) if b.hook else b for b in schedule.buckets
    )
    return dataclasses.replace(schedule, buckets=buckets)
