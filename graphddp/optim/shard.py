"""The optimizer on a shard (``sharding="optimizer"``): each rank keeps and updates its part only.

Parameters stay whole on every rank between steps (ZeRO-2); ``opt.state[p]`` holds this rank's part
of ``p``'s state only, flat (:mod:`graphddp.values.shards` says which), and nothing where another
rank owns all of ``p``. A part is updated with the same math by two routes: inside the backward
(:mod:`graphddp.optim.insert_shard`), or at its end (:meth:`ShardedState.step`) for what the graphs
leave to torch's step, each rank updating its part and one all-gather per dtype and device
rebuilding the parameters. Checkpoints hold the whole state (:mod:`graphddp.optim.whole_state`),
so they move between world sizes.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.optim.attached import UPDATES, UpdateRule, hyper_tensors, init_adam_state
from graphddp.optim.whole_state import WholeState
from graphddp.values.comm import group_name_of
from graphddp.values.placement import Placement, flat
from graphddp.values.shards import part, whole


class ShardedState:

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter], rules: Sequence[UpdateRule],
                 group_of: Mapping[str, int], group: Any, placement: Placement | None = None) -> None:
        """``group``: the shard group; ``placement``: the sharded buckets' (default: over ``group``)."""
        self.optimizer = optimizer
        self.params = dict(params)
        self.rules = rules
        self.group_of = dict(group_of)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.placement = placement or flat(group_name_of(group), self.world)
        names = {id(p): n for n, p in self.params.items()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]  # a state dict's indices
        self.whole_state = WholeState(tuple(order), tuple(tuple(self.params[n].shape) for n in order), group, padded=False)
        self.whole_state.cut_held(optimizer, [self.params[n] for n in order])  # the parameters stay whole: the same keys

    def part(self, name: str) -> tuple[int, int]:
        return part(self.params[name].numel(), self.world, self.rank)

    # -- state -------------------------------------------------------------------------------
    def state_of(self, name: str) -> dict[str, Any] | None:
        """``opt.state[p]`` for this rank's part of ``name`` (None: it owns no element of it)."""
        p = self.params[name]
        lo, hi = self.part(name)
        if hi <= lo:
            return None
        state = self.optimizer.state[p]
        rule = self.rules[self.group_of[name]]
        if rule.kind == "adam":
            init_adam_state(rule, state, p, lambda: p.new_zeros(hi - lo))
        return state

    def update_tensors(self, name: str) -> list[torch.Tensor]:
        """The state tensors of ``name``'s part in :attr:`UpdateRule.state` order."""
        rule = self.rules[self.group_of[name]]
        state = self.state_of(name)
        if state is None or not rule.state:
            return []
        if rule.kind == "adam":
            return [state[k] for k in rule.state]
        buf = state.get("momentum_buffer")
        first = buf is None
        if first:  # torch starts it at the first step, from the first gradient
            lo, hi = self.part(name)
            buf = state["momentum_buffer"] = self.params[name].new_zeros(hi - lo)
        return [buf, torch.tensor(first)]

    # -- the eager sharded step ----------------------------------------------------------------
    @torch.no_grad()
    def step(self, names: Iterable[str]) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for name in names:
            p = self.params[name]
            if p.grad is not None:
                by_kind.setdefault((p.dtype, p.device), []).append(name)
        used = {self.group_of[n] for names_ in by_kind.values() for n in names_}  # groups with a gradient this step
        hyper = {g: hyper_tensors(self.optimizer.param_groups[g], self.rules[g]) for g in used}
        for names_ in by_kind.values():
            parts = []
            for name in names_:
                p = self.params[name]
                lo, hi = self.part(name)
                work = p.detach().reshape(-1)[lo:hi].clone()
                if hi > lo:
                    rule = self.rules[self.group_of[name]]
                    grad = p.grad.detach().reshape(-1)[lo:hi]
                    UPDATES[rule.kind](rule, work, grad, self.update_tensors(name)[:len(rule.state)], hyper[self.group_of[name]])
                parts.append(work)
            for name, new in zip(names_, whole(parts, [self.params[n].shape for n in names_], self.group)):
                self.params[name].detach().copy_(new)
