"""What a bucket does, as Python functions traced into a graph: flatten, the hook, the collective
through the bucket's placement, the wait, and the unflatten or (sharded) the parameters' writes.

After ``no_sync`` a traced hook runs eagerly on the accumulated gradients instead
(:func:`run_hook_eagerly`), with the same ``GradBucket`` and the same check of its result. A sharded
bucket's flat layout, and full sharding's, is rank-major ``[world, chunk]`` columns
(:func:`rank_major`). Nothing here reads or edits a graph.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from graphddp.graph.trace import fresh_copy, role
from graphddp.hooks import builtin as hooks
from graphddp.hooks.traced import GradBucket, HookState, TracedHook
from graphddp.values.collectives import ALL_GATHER, SHARDED
from graphddp.values.comm import gate_name
from graphddp.values.placement import Level, Placement, Whole
from graphddp.values.schedule import Bucket, Schedule
from graphddp.values.shards import chunk

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
    """Each gradient plus its slot's accumulated under ``no_sync``: DDP averages the sum once."""
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


def chunks(bucket: Bucket, world: int) -> list[int]:
    """Per slot, the width of its column in a sharded bucket's ``[world, chunk]`` layout."""
    return [chunk(s.numel, world) for s in bucket.slots]


def rank_major(columns: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per member its ``[world, width]`` column -> one flat buffer, rank-major (rank 0's chunks of
    every member, then rank 1's, ...): a collective's rank ``r`` share is one contiguous row."""
    return aten.view.default(aten.cat.default(list(columns), 1) if len(columns) > 1 else columns[0], [-1])


def columns_of(flat: torch.Tensor, world: int, widths: Sequence[int]) -> Iterator[torch.Tensor]:
    """The inverse of :func:`rank_major`: per member its ``[world, width]`` column of ``flat``, a
    strided view. Yielded one at a time, so what a caller traces from a column follows its slice."""
    rows = aten.view.default(flat, [world, sum(widths)])
    at = 0
    for c in widths:
        yield aten.slice.Tensor(rows, 1, at, at + c)
        at += c


def row_parts(row: torch.Tensor, widths: Sequence[int], sizes: Sequence[int]) -> Iterator[torch.Tensor]:
    """One rank's row of the layout (what its reduce-scatter returns): per member the first
    ``sizes[k]`` elements of its chunk (all, or what the rank owns), one at a time."""
    at = 0
    for c, size in zip(widths, sizes, strict=True):
        yield row[at:at + size]
        at += c


def issue_columns(
    placement: Placement, hook: hooks.CommHook, bucket: Bucket, grads: Sequence[torch.Tensor], carried: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The bucket's gradients (plus ``carried``) flattened, compressed, divided by the placement's
    world and reduce-scattered; returns what to wait on."""
    world = placement.shard.size
    grads = carry_in(grads, carried)
    # Cast and divide each gradient's columns before they are concatenated (elementwise, so the
    # same values): inductor then writes the concatenation in one pass, not a second whole buffer.
    columns = []
    for grad, slot, c in zip(grads, bucket.slots, chunks(bucket, world)):
        with role("flatten"):
            flat = flat_view(grad, slot.numel)
            column = aten.view.default(aten.constant_pad_nd.default(flat, [0, world * c - slot.numel]), [world, c])
        with role("compress"):
            column = hook.compress(column, bucket)
        with role("scale"):
            columns.append(aten.div.Tensor(column, placement.world))
    with role("flatten"):
        scaled = rank_major(columns)
    with role(SHARDED):
        return placement.issue_reduce(scaled)


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
    bucket: Bucket, hook: TracedHook, schedule: Schedule, ctx: HookContext, dry: bool = False
) -> Callable[..., list[torch.Tensor]]:
    """gradients -> flatten (fresh memory) -> the user's hook -> views; ``dry``: a run that only
    learns the hook's state tensors (its ``learned``)."""
    n = len(bucket.slots)
    params = [ctx.parameters[name] for name in bucket.param_names if name in ctx.parameters]

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        grads, states = args[:n], args[n:]
        with role("flatten"):
            flat = _flatten(grads, bucket)
            if n == 1:  # the hook may write its buffer in place: never the gradient's own memory
                flat = fresh_copy(flat)
        is_last = bucket.index == schedule.num_buckets - 1
        gb = GradBucket(bucket, flat, ctx.group, schedule.world_size, is_last, params, None if dry else states)
        with role("hook"):
            done = hook(gb)
        if dry:
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
    """``hook`` on one bucket's local flat gradients, now: the averaged flat tensor."""
    params = [ctx.parameters[name] for name in bucket.param_names]
    is_last = bucket.index == schedule.num_buckets - 1
    gb = GradBucket(bucket, flat, ctx.group, schedule.world_size, is_last, params, states.of(schedule.graph_index, bucket.index))
    with torch.no_grad():
        done = hook(gb)
    _check_result(bucket, hook.name, done)
    return done


def gather_fn(placement: Placement) -> Callable[[torch.Tensor], torch.Tensor]:

    def run(parts: torch.Tensor) -> torch.Tensor:
        with role(ALL_GATHER.key):
            return placement.issue_gather(parts)

    return run


def write_fn(bucket: Bucket, placement: Placement) -> Callable[..., list[torch.Tensor]]:
    """(the all-gather, params) -> wait, then every parameter written from its gathered chunks;
    returns the written parameters, which later reads must read."""
    world, widths = placement.shard.size, chunks(bucket, placement.shard.size)

    def run(gathered: torch.Tensor, *params: torch.Tensor) -> list[torch.Tensor]:
        with role("wait"):
            full = placement.finish_gather(gathered)
        with role("write"):
            written = []
            for p, slot, c, column in zip(params, bucket.slots, widths, columns_of(full, world, widths)):
                column = aten.clone.default(column, memory_format=torch.contiguous_format)
                value = aten.view.default(aten.slice.Tensor(aten.view.default(column, [world * c]), 0, 0, slot.numel), list(slot.shape))
                written.append(aten.copy_.default(p, value))
        return written

    return run


def gathered_value(bucket: Bucket, placement: Placement, fake_mode: Any, like: torch.Tensor) -> torch.Tensor:
    with fake_mode:
        return torch.empty(placement.shard.size * sum(chunks(bucket, placement.shard.size)), dtype=like.dtype, device=like.device)
