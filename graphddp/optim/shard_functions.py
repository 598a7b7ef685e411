"""A sharded bucket's layout on this rank and its update, traced between the bucket's reduce-scatter
and all-gather (:mod:`graphddp.optim.insert_shard` places them): here, not beside the other bucket
functions, because its rules and state are the optimizer's. Every node is tagged with its role,
which the pass and the verifier read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from graphddp.graph.bucket_function import chunks, flat_view, gather_fn, issue_columns, receive
from graphddp.graph.trace import fresh_copy, role
from graphddp.hooks import builtin as hooks
from graphddp.optim import clip
from graphddp.optim.attached import UPDATES, UpdateRule, cut, fake_hyper, fake_state
from graphddp.values.placement import Placement
from graphddp.values.schedule import Bucket
from graphddp.values.shards import part

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What a sharded bucket's update reads, for this rank: per slot its part and rule."""

    bucket: Bucket
    parts: tuple[tuple[int, int], ...]  # per slot: [lo, hi) of the parameter's flat view
    rules: tuple[UpdateRule, ...]  # per slot
    group_of: tuple[int, ...]  # per slot
    placement: Placement  # the groups its collectives run on

    @property
    def world(self) -> int:
        return self.placement.shard.size

    @property
    def groups(self) -> list[int]:
        return sorted(set(self.group_of))

    @property
    def chunks(self) -> list[int]:
        return chunks(self.bucket, self.world)

    def owned(self) -> list[int]:
        return [i for i, (lo, hi) in enumerate(self.parts) if hi > lo]

    def hyper(self, group: int) -> tuple[str, ...]:
        return self.rules[self.group_of.index(group)].hyper


def shard_layout(bucket: Bucket, rules: Mapping[str, UpdateRule], groups: Mapping[str, int], placement: Placement, rank: int) -> ShardLayout:
    """``rank``: this rank's index in the shard group."""
    names = bucket.param_names
    return ShardLayout(
        bucket, tuple(part(s.numel, placement.shard.size, rank) for s in bucket.slots), tuple(rules[n] for n in names),
        tuple(groups[n] for n in names), placement,
    )


def layout(shard: ShardLayout) -> list[str]:
    """Placeholder names of one sharded bucket's inputs: parameters, owned parts' state, hyperparameters."""
    b = shard.bucket.index
    names = [f"shard{b}_param_{k}" for k in range(len(shard.bucket.slots))]
    for k in shard.owned():
        names.extend(f"shard{b}_{s}_{k}" for s in shard.rules[k].state)
    for g in shard.groups:
        names.extend(f"shard{b}_group{g}_{h}" for h in shard.hyper(g))
    return names


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy inductor's ``remove_noop_ops`` folds into the parameter, so the update writes its part in
    place: only where nothing reads the old values after the update (``insert_shard._reads_after``)."""
    return aten.clone.default(t)


def _copies(shard: ShardLayout, params: Sequence[torch.Tensor], private: bool) -> list[torch.Tensor]:
    """The copies of this rank's parts the update writes; ``private``: copies no pass folds into the
    parameters, whose old values are read after the update (by the backward, or with
    ``gather="forward"`` until the next forward writes them)."""
    copy = fresh_copy if private else _clone
    with role("update"):
        return [copy(aten.slice.Tensor(flat_view(p, s.numel), 0, lo, hi)) for p, s, (lo, hi) in zip(params, shard.bucket.slots, shard.parts)]


def _step(shard: ShardLayout, grad_part: torch.Tensor, work: list[torch.Tensor], rest: list[torch.Tensor]) -> torch.Tensor:
    """The optimizer's math on each owned part; returns the all-gather of the updated parts, not
    waited, or with ``gather="forward"`` the parts themselves."""
    owned = shard.owned()
    runs = cut(rest, [len(shard.rules[k].state) for k in owned] + [len(shard.hyper(g)) for g in shard.groups])
    states, hyper = dict(zip(owned, runs)), dict(zip(shard.groups, runs[len(owned):]))
    with role("update"):
        at = 0
        for k, c in enumerate(shard.chunks):
            lo, hi = shard.parts[k]
            if k in states:
                rule = shard.rules[k]
                UPDATES[rule.kind](rule, work[k], aten.slice.Tensor(grad_part, 0, at, at + hi - lo), states[k], hyper[shard.group_of[k]])
            at += c
        mine = aten.cat.default([aten.constant_pad_nd.default(w, [0, c - w.numel()]) for w, c in zip(work, shard.chunks)])
    if shard.bucket.gather == "forward":
        return mine
    return gather_fn(shard.placement)(mine)


def update_fn(shard: ShardLayout, hook: hooks.CommHook, private: bool, carry: bool) -> Callable[..., torch.Tensor]:
    """(grads[, carried], params, states, hypers) -> :func:`_step`'s result: a bucket updated as soon
    as its average arrives."""
    n = len(shard.bucket.slots)
    m = 2 * n if carry else n

    def run(*args: torch.Tensor) -> torch.Tensor:
        grads, carried, params, rest = args[:n], args[n:m], args[m:m + n], list(args[m + n:])
        pending = issue_columns(shard.placement, hook, shard.bucket, grads, carried)
        work = _copies(shard, params, private)
        return _step(shard, receive(shard.placement, hook, shard.bucket, pending), work, rest)

    return run


def reduce_fn(
    shard: ShardLayout, hook: hooks.CommHook, norm_type: float,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``max_grad_norm``, first half: (grads[, carried]) -> (this rank's part of the average, its
    :func:`~graphddp.optim.clip.part_norms`); the update waits for every bucket's shares."""
    n = len(shard.bucket.slots)

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grads, carried = args[:n], args[n:]
        pending = issue_columns(shard.placement, hook, shard.bucket, grads, carried)
        grad_part = receive(shard.placement, hook, shard.bucket, pending)
        return grad_part, clip.part_norms(grad_part, [hi - lo for lo, hi in shard.parts], shard.chunks, norm_type)

    return run


def clipped_update_fn(shard: ShardLayout, private: bool) -> Callable[..., torch.Tensor]:
    """``max_grad_norm``, second half: (part, params, states, hypers, coefficient) -> as
    :func:`update_fn`, from the part times the coefficient."""
    n = len(shard.bucket.slots)

    def run(grad_part: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        params, rest, coef = args[:n], list(args[n:-1]), args[-1]
        work = _copies(shard, params, private)
        with role(clip.CLIP):
            grad_part = aten.mul.Tensor(grad_part, coef)
        return _step(shard, grad_part, work, rest)

    return run


def state_values(shard: ShardLayout, fake_mode: Any, values: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    vals: list[torch.Tensor] = []
    with fake_mode:
        for k in shard.owned():
            p = values[shard.bucket.slots[k].param_name]
            lo, hi = shard.parts[k]
            vals.extend(fake_state(shard.rules[k], p, lambda: torch.empty(hi - lo, dtype=p.dtype, device=p.device)))
        return vals + fake_hyper(shard.rules[shard.group_of.index(g)] for g in shard.groups)
