"""What a bucket does, as one Python function: flatten, the hook, the collective, unflatten.

:mod:`graphddp.graph.insert_comm` traces these on a graph's fake gradients; after ``no_sync`` a
traced hook runs eagerly on the accumulated gradients instead (:func:`run_hook_eagerly`), with the
same ``GradBucket`` and the same check of its result. Nothing here reads or edits a graph.

A replicated bucket is reduced through its placement (:class:`~graphddp.values.placement.Whole`) with
the :func:`carry_in` and :func:`receive` of a sharded one (:mod:`graphddp.optim.shard_functions`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from graphddp.graph.trace import fresh_copy, role
from graphddp.hooks import builtin as hooks
from graphddp.hooks.traced import GradBucket, HookState, StateSpec, TracedHook
from graphddp.values.comm import gate_name
from graphddp.values.placement import Level, Placement, Whole
from graphddp.values.schedule import Bucket, Schedule

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class HookContext:
    """What a user hook's ``GradBucket`` offers beyond the schedule: the group and the parameters."""

    group: Any
    parameters: Mapping[str, torch.nn.Parameter] = dataclasses.field(default_factory=dict)


def flat_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    if not t.is_contiguous():  # a view can only flatten contiguous memory
        t = aten.clone.default(t, memory_format=torch.contiguous_format)
    return aten.view.default(t, [numel])


def _flatten(grads: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    flats = [flat_view(grad, slot.numel) for grad, slot in zip(grads, bucket.slots, strict=True)]
    return flats[0] if len(flats) == 1 else aten.cat.default(flats)


def _unflatten(done: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """One view per slot into the reduced buffer: DDP's gradient_as_bucket_view, no copy."""
    with role("unflatten"):
        return [
            aten.view.default(aten.slice.Tensor(done, 0, off, off + slot.numel), list(slot.shape))
            for slot, off in zip(bucket.slots, bucket.offsets())
        ]


def _check_result(bucket: Bucket, hook_name: str, done: Any, verb: str = "returns") -> None:
    dtype = getattr(torch, bucket.dtype)
    if not isinstance(done, torch.Tensor):
        raise TypeError(
            f"graphddp: comm hook {hook_name!r} returned {type(done).__name__} for bucket {bucket.index}; a traced hook "
            "returns the averaged flat tensor (not a Future: collectives come from torch.distributed._functional_collectives)"
        )
    if done.dtype != dtype or tuple(done.shape) != (bucket.numel,):
        raise RuntimeError(
            f"graphddp: bucket {bucket.index}: hook {hook_name!r} {verb} {done.dtype} "
            f"{list(done.shape)}, the bucket's gradients need {dtype} [{bucket.numel}]"
        )


def carry_in(grads: Sequence[torch.Tensor], carried: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Each gradient plus its slot's accumulated under ``no_sync`` (DDP's bucket after ``no_sync``
    holds the sum, and averages it once)."""
    if not carried:
        return grads
    with role("carry"):
        return [aten.add.Tensor(g, acc) for g, acc in zip(grads, carried, strict=True)]


def receive(placement: Placement, hook: hooks.CommHook, bucket: Bucket, pending: torch.Tensor) -> torch.Tensor:
    """The reduce issued through ``placement``, waited, finished and decompressed: this rank's average."""
    with role("wait"):
        done = placement.finish_reduce(pending, tag=role)
    with role("decompress"):
        return hook.decompress(done, bucket)


def _builtin_fn(bucket: Bucket, hook: hooks.CommHook, schedule: Schedule) -> Callable[..., list[torch.Tensor]]:
    """gradients[, carried] -> flatten -> compress -> divide -> all-reduce -> wait -> decompress -> views;
    gated, the all-reduce runs on the gate's group, which divides."""
    wire = getattr(torch, bucket.comm_dtype or bucket.dtype)
    group = gate_name(schedule.group_name) if schedule.gated else schedule.group_name
    placement = Whole(Level(group, schedule.world_size), reduce_kind=bucket.collective)
    n = len(bucket.slots)

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        grads = carry_in(args[:n], args[n:])
        with role("flatten"):
            flat = _flatten(grads, bucket)
        with role("compress"):
            sent = hook.compress(flat, bucket)
        if sent.dtype != wire:  # the schedule's bytes on the wire (and the cost model) assume `wire`
            raise RuntimeError(
                f"graphddp: bucket {bucket.index}: hook {hook.name!r} sends {sent.dtype}, the schedule plans {wire}"
            )
        if schedule.gated:  # the gate divides, or holds the bucket local (graphddp.runtime.gate)
            with role("flatten"):
                scaled = sent if n > 1 else fresh_copy(sent)  # the gate writes it in place
        else:
            with role("scale"):
                scaled = aten.div.Tensor(sent, schedule.world_size)  # DDP pre-divides, after compressing
        with role(placement.reduce_kind):
            reduced = placement.issue_reduce(scaled)
        done = receive(placement, hook, bucket, reduced)
        _check_result(bucket, hook.name, done, "decompresses to")
        return _unflatten(done, bucket)

    return run


def _user_fn(
    bucket: Bucket, hook: TracedHook, schedule: Schedule, ctx: HookContext, declared: list[StateSpec] | None
) -> Callable[..., list[torch.Tensor]]:
    """gradients -> flatten (fresh memory) -> the user's hook -> views; ``declared`` None: a
    dry run that only learns the hook's state tensors (appended to ``learned``)."""
    n = len(bucket.slots)
    params = [ctx.parameters[name] for name in bucket.param_names if name in ctx.parameters]

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        grads, states = args[:n], args[n:]
        with role("flatten"):
            flat = _flatten(grads, bucket)
            if n == 1:  # the hook may write its buffer in place: never the gradient's own memory
                flat = fresh_copy(flat)
        is_last = bucket.index == schedule.num_buckets - 1
        gb = GradBucket(bucket, flat, ctx.group, schedule.world_size, is_last, params, None if declared is None else states)
        with role("hook"):
            done = hook(gb)
        if declared is None:
            run.learned = gb.declared  # type: ignore[attr-defined]
        _check_result(bucket, hook.name, done)
        return _unflatten(done, bucket)

    return run


def run_hook_eagerly(hook: TracedHook, schedule: Schedule, ctx: HookContext, states: HookState) -> None:
    """Run ``hook`` on every bucket now, on the parameters' ``.grad``, and write its average back
    (the step after ``no_sync``); its state is the graph's."""
    for bucket in schedule.buckets:
        params = [ctx.parameters[name] for name in bucket.param_names]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        done = hook_bucket_eagerly(hook, schedule, bucket, flat, ctx, states)
        with torch.no_grad():
            for p, slot, off in zip(params, bucket.slots, bucket.offsets()):
                if slot.zero_filled:
                    continue
                value = done[off:off + slot.numel].view(slot.shape)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)


def hook_bucket_eagerly(
    hook: TracedHook, schedule: Schedule, bucket: Bucket, flat: torch.Tensor, ctx: HookContext, states: HookState
) -> torch.Tensor:
    """``hook`` on one bucket's local flat gradients ``flat``, now: the averaged flat tensor."""
    params = [ctx.parameters[name] for name in bucket.param_names]
    is_last = bucket.index == schedule.num_buckets - 1
    gb = GradBucket(bucket, flat, ctx.group, schedule.world_size, is_last, params, states.of(schedule.graph_index, bucket.index))
    with torch.no_grad():
        done = hook(gb)
    _check_result(bucket, hook.name, done)
    return done
