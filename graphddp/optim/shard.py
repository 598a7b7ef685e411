"""The optimizer on a shard (``sharding="optimizer"``): each rank keeps and updates its part only.

Parameters stay whole on every rank between steps (ZeRO-2); ``opt.state[p]`` holds this rank's part
of ``p``'s state only, flat (:mod:`graphddp.values.shards` says which), and nothing where another
rank owns all of ``p``. A part is updated with the same math by two routes: inside the backward
(:mod:`graphddp.optim.insert_shard`), or at its end (:meth:`ShardedState.step`) for what the graphs
leave to torch's step, each rank updating its part and one all-gather per dtype and device
rebuilding the parameters. Checkpoints hold the whole state (:meth:`ShardedState.full_state_dict`,
:meth:`ShardedState.load_full`), so they move between world sizes.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.optim.attached import F64, UPDATES, UpdateRule, hyper_values, init_adam_state
from graphddp.values.comm import gather_flat, group_name_of
from graphddp.values.placement import Placement, flat
from graphddp.values.shards import chunk, part

# Per-element state a part holds; every other entry ("step") is one value for the whole parameter.
ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def check_whole_state(name: str, state: Mapping[str, Any], numel: int) -> None:
    """Every elementwise entry of a state about to be cut must be the whole parameter's: one rank's
    part (a sharded optimizer's own ``state_dict()``), cut again, would silently give wrong values."""
    for key, value in state.items():
        if key in ELEMENTWISE and isinstance(value, torch.Tensor) and value.numel() != numel:
            raise ValueError(
                f"graphddp: optimizer state {key!r} of {name!r} has {value.numel()} elements, the parameter {numel}: a state "
                "saved from a sharded run's optimizer.state_dict() holds one rank's part; save "
                "graphddp.full_optimizer_state_dict(model) on every rank, and load it with graphddp.load_full_optimizer_state_dict"
            )


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
        self.pending: dict[str, dict[str, Any]] = {}  # loaded full state, cut into parts on first use
        self._adopt_existing()

    def _adopt_existing(self) -> None:
        """State the optimizer has at wrap time (a resume that loaded a plain ``state_dict()`` first,
        as nanoGPT does) is whole: cut at first use, as a loaded full state is."""
        held = {name: self.optimizer.state[p] for name, p in self.params.items() if self.optimizer.state.get(p)}
        for name, state in held.items():
            check_whole_state(name, state, self.params[name].numel())
        for name in held:
            self.pending[name] = dict(self.optimizer.state.pop(self.params[name]))

    def part(self, name: str) -> tuple[int, int]:
        return part(self.params[name].numel(), self.world, self.rank)

    # -- state -------------------------------------------------------------------------------
    def state_of(self, name: str) -> dict[str, Any] | None:
        """``opt.state[p]`` for this rank's part of ``name`` (None: it owns no element of it)."""
        p = self.params[name]
        lo, hi = self.part(name)
        if hi <= lo:
            return None
        self._cut_loaded(name)
        state = self.optimizer.state[p]
        rule = self.rules[self.group_of[name]]
        if rule.kind == "adam":
            init_adam_state(rule, state, p, lambda: p.new_zeros(hi - lo))
        return state

    def _cut_loaded(self, name: str) -> None:
        full = self.pending.pop(name, None)
        lo, hi = self.part(name)
        if full is None or hi <= lo:
            return
        p = self.params[name]
        state = self.optimizer.state[p]
        state.clear()
        for key, value in full.items():
            if key in ELEMENTWISE and isinstance(value, torch.Tensor):
                state[key] = value.detach().to(device=p.device, dtype=p.dtype).reshape(-1)[lo:hi].clone()
            elif isinstance(value, torch.Tensor):
                state[key] = value.detach().clone()
            elif value is not None:
                state[key] = value

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

    def hyper(self, group: int) -> list[torch.Tensor]:
        return [torch.tensor(v, dtype=F64) for v in hyper_values(self.optimizer.param_groups[group], self.rules[group])]

    # -- the eager sharded step ----------------------------------------------------------------
    @torch.no_grad()
    def step(self, names: Iterable[str]) -> None:
        by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for name in names:
            p = self.params[name]
            if p.grad is not None:
                by_kind.setdefault((p.dtype, p.device), []).append(name)
        hyper = {g: self.hyper(g) for g in {self.group_of[n] for names_ in by_kind.values() for n in names_}}
        for names_ in by_kind.values():
            chunks = []
            for name in names_:
                p = self.params[name]
                lo, hi = self.part(name)
                work = p.detach().reshape(-1)[lo:hi].clone()
                if hi > lo:
                    rule = self.rules[self.group_of[name]]
                    grad = p.grad.detach().reshape(-1)[lo:hi]
                    UPDATES[rule.kind](rule, work, grad, self.update_tensors(name)[:len(rule.state)], hyper[self.group_of[name]])
                chunks.append(torch.nn.functional.pad(work, (0, chunk(p.numel(), self.world) - (hi - lo))))
            self._gather_into(names_, torch.cat(chunks))

    def _gather_into(self, names: Sequence[str], mine: torch.Tensor) -> None:
        gathered = mine.new_empty(self.world * mine.numel())
        gather_flat(gathered, mine, self.group)
        rows = gathered.view(self.world, mine.numel())
        at = 0
        for name in names:
            p = self.params[name]
            c = chunk(p.numel(), self.world)
            p.detach().copy_(rows[:, at:at + c].reshape(-1)[: p.numel()].view_as(p))
            at += c

    # -- checkpoints ---------------------------------------------------------------------------
    def _order(self) -> list[str]:
        names = {id(p): n for n, p in self.params.items()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def full_state_dict(self) -> dict[str, Any]:
        order = self._order()
        for name in order:
            self._cut_loaded(name)  # a loaded state not stepped since is saved as loaded
        mine = {}
        for name in order:
            state = self.optimizer.state.get(self.params[name])
            if state and self.part(name)[1] > self.part(name)[0]:
                mine[name] = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        state: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(order):
            p = self.params[name]
            parts = [r[name] for r in everyone if name in r]  # rank order: parts in element order
            if not parts:
                continue
            full = {}
            for key, value in parts[0].items():
                if key in ELEMENTWISE:
                    full[key] = torch.cat([q[key] for q in parts]).view(p.shape).to(p.device)
                else:
                    full[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[index] = full
        groups = []
        at = 0
        for group in self.optimizer.param_groups:
            g = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            g["params"] = list(range(at, at + len(group["params"])))
            at += len(group["params"])
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def load_full(self, full: Mapping[str, Any]) -> None:
        """Take a plain optimizer's state dict; each parameter's state is cut when first used."""
        states = {name: full["state"].get(i, full["state"].get(str(i))) for i, name in enumerate(self._order())}
        if len(full["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError("load_full_optimizer_state_dict: the state dict has a different number of param groups")
        for name, saved in states.items():
            check_whole_state(name, saved or {}, self.params[name].numel())
        for group, saved in zip(self.optimizer.param_groups, full["param_groups"]):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("load_full_optimizer_state_dict: a param group holds a different number of parameters")
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        for p in self.params.values():
            self.optimizer.state.pop(p, None)
        self.pending = {name: dict(saved) for name, saved in states.items() if saved}
