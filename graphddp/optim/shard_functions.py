"""A sharded bucket's layout on this rank and the functions traced around its update, between the
bucket's reduce-scatter and all-gather (:mod:`graphddp.optim.insert_shard` places them): here, not
beside the other bucket functions, because its rules and state are the optimizer's. Each part's
update itself is spliced apart, from one trace per signature
(:func:`graphddp.optim.insert_update.splice_update`). Every node is tagged with its role, which
the pass and the verifier read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from graphddp.graph.bucket_function import chunks, flat_view, gather_fn, issue_columns, receive
from graphddp.graph.trace import fresh_copy, role
from graphddp.hooks import builtin as hooks
from graphddp.optim import clip
from graphddp.optim.attached import UpdateRule, cut, fake_hyper, fake_state
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


def _shares(shard: ShardLayout, grad_part: torch.Tensor) -> list[torch.Tensor]:
    """Per owned part (:meth:`ShardLayout.owned`), its share of this rank's row of the average."""
    shares, at = [], 0
    with role("update"):
        for k, c in enumerate(shard.chunks):
            lo, hi = shard.parts[k]
            if hi > lo:
                shares.append(aten.slice.Tensor(grad_part, 0, at, at + hi - lo))
            at += c
    return shares


def part_update_args(shard: ShardLayout, shares: Sequence[Any], work: Sequence[Any], rest: Sequence[Any]) -> list[tuple[int, list[Any]]]:
    """Per owned part ``k``, the arguments of its update (:func:`~graphddp.optim.attached.param_update_fn`):
    its share, its copy, its state, its group's hyperparameters; from :func:`update_fn`'s outputs
    and the bucket's inputs after the parameters (:func:`layout`)."""
    owned = shard.owned()
    runs = cut(rest, [len(shard.rules[k].state) for k in owned] + [len(shard.hyper(g)) for g in shard.groups])
    hyper = dict(zip(shard.groups, runs[len(owned):]))
    return [(k, [share, work[k], *state, *hyper[shard.group_of[k]]]) for k, share, state in zip(owned, shares, runs)]


def update_fn(shard: ShardLayout, hook: hooks.CommHook, private: bool, carry: bool) -> Callable[..., list[torch.Tensor]]:
    """(grads[, carried], params) -> [per owned part its share of the average, per slot the copy
    of this rank's part its update writes]: the bucket reduce-scattered and ready to update. Each
    part's update is spliced apart (:func:`~graphddp.optim.insert_update.splice_update`, traced once
    per signature), then :func:`pack_fn`."""
    n = len(shard.bucket.slots)
    m = 2 * n if carry else n

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        grads, carried, params = args[:n], args[n:m], args[m:]
        pending = issue_columns(shard.placement, hook, shard.bucket, grads, carried)
        work = _copies(shard, params, private)
        return [*_shares(shard, receive(shard.placement, hook, shard.bucket, pending)), *work]

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


def clipped_update_fn(shard: ShardLayout, private: bool) -> Callable[..., list[torch.Tensor]]:
    """``max_grad_norm``, second half: (part, params, coefficient) -> as :func:`update_fn`, the
    shares cut from the part times the coefficient."""

    def run(grad_part: torch.Tensor, *args: torch.Tensor) -> list[torch.Tensor]:
        params, coef = args[:-1], args[-1]
        work = _copies(shard, params, private)
        with role(clip.CLIP):
            grad_part = aten.mul.Tensor(grad_part, coef)
        return [*_shares(shard, grad_part), *work]

    return run


def pack_fn(shard: ShardLayout) -> Callable[..., torch.Tensor]:
    """(the updated copies) -> their all-gather, not waited, or with ``gather="forward"`` the
    padded parts themselves."""

    def run(*work: torch.Tensor) -> torch.Tensor:
        with role("update"):
            mine = aten.cat.default([aten.constant_pad_nd.default(w, [0, c - w.numel()]) for w, c in zip(work, shard.chunks)])
        if shard.bucket.gather == "forward":
            return mine
        return gather_fn(shard.placement)(mine)

    return run


def state_values(shard: ShardLayout, fake_mode: Any, values: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    vals: list[torch.Tensor] = []
    with fake_mode:
        for k in shard.owned():
            p = values[shard.bucket.slots[k].param_name]
            lo, hi = shard.parts[k]
            vals.extend(fake_state(shard.rules[k], p, lambda: torch.empty(hi - lo, dtype=p.dtype, device=p.device)))
        return vals + fake_hyper(shard.rules[shard.group_of.index(g)] for g in shard.groups)
