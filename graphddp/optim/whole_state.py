"""Whole optimizer state in and out of this rank's parts, for both sharded modes.

A sharded optimizer holds this rank's part of each parameter's elementwise state
(:data:`ELEMENTWISE`), cut as :mod:`graphddp.values.shards` cuts. A checkpoint holds the whole
state, a plain optimizer's over the whole parameters, so that it loads into a plain optimizer and
into any world size: :meth:`WholeState.state_dict` gathers the parts whole, :meth:`WholeState.load`
checks a whole state and cuts it. The modes differ only in what a part keeps: ``sharding="full"``
its padding (its parameters are the padded parts, which torch steps), ``sharding="optimizer"``
none, and no state where the rank owns no element (its parameters stay whole).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from graphddp.values.shards import padded_part, part, whole

# Per-element state a part holds; every other entry ("step") is one value for the whole parameter.
ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _elementwise(key: str, value: Any) -> bool:
    return key in ELEMENTWISE and isinstance(value, torch.Tensor)


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def check_whole_state(name: str, state: Mapping[str, Any], numel: int) -> None:
    """Every elementwise entry of a state about to be cut must be the whole parameter's: one rank's
    part (a sharded optimizer's own ``state_dict()``), cut again, would silently give wrong values."""
    for key, value in state.items():
        if _elementwise(key, value) and value.numel() != numel:
            raise ValueError(
                f"graphddp: optimizer state {key!r} of {name!r} has {value.numel()} elements, the parameter {numel}: a state "
                "saved from a sharded run's optimizer.state_dict() holds one rank's part; save "
                "graphddp.full_optimizer_state_dict(model) on every rank, and load it with graphddp.load_full_optimizer_state_dict"
            )


@dataclasses.dataclass(frozen=True)
class WholeState:
    """The parameters a sharded optimizer steps, in its order (a state dict's index): each one's
    name (for messages) and whole shape, cut over ``group``; ``padded``: ``sharding="full"``'s
    parts (module docstring); ``held_whole``: the indices of parameters every rank holds whole."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group: Any
    padded: bool
    held_whole: frozenset[int] = frozenset()

    def _group(self, index: int) -> Any:
        """What parameter ``index`` is cut over: the group, or None where every rank holds it whole."""
        return None if index in self.held_whole else self.group

    def cut(self, index: int, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """Parameter ``index``'s whole ``state`` as this rank holds it: elementwise entries cut to its
        part, other tensors copied (a step count is the whole parameter's); None where it holds
        none. An elementwise entry of another size is refused (:func:`check_whole_state`)."""
        numel = math.prod(self.shapes[index])
        check_whole_state(self.names[index], state, numel)
        group = self._group(index)
        world, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        lo, hi = part(numel, world, rank)
        if not self.padded and hi <= lo:
            return None

        def cut(value: torch.Tensor) -> torch.Tensor:
            return padded_part(value, world, rank) if self.padded else value.detach().reshape(-1)[lo:hi].clone()

        return {k: cut(v) if _elementwise(k, v) else _copied(v) for k, v in state.items()}

    def _cut_all(self, states: Mapping[int, Mapping[str, Any] | None]) -> dict[int, dict[str, Any]]:
        return {i: cut for i, s in states.items() if s and (cut := self.cut(i, s)) is not None}  # None: no element here

    def cut_held(self, optimizer: torch.optim.Optimizer, stepped: Sequence[torch.Tensor]) -> None:
        """The whole state ``optimizer`` holds at wrap time (a resume's plain ``state_dict()``) cut as a
        loaded one is, every entry checked first, keyed by what steps parameter ``i`` now: ``stepped[i]``."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        cut = self._cut_all({i: optimizer.state.get(p) for i, p in enumerate(params)})
        optimizer.state.clear()
        optimizer.state.update({stepped[i]: s for i, s in cut.items()})

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state dict a plain optimizer of the same class over the whole parameters would have
        (every rank of the group calls it: it gathers)."""
        own = optimizer.state_dict()
        mine = own["state"]
        # Each parameter's entries, an elementwise one by its dtype: its parts are gathered below.
        entries = {i: {k: v.dtype if _elementwise(k, v) else v for k, v in s.items()} for i, s in mine.items()}
        if not self.padded:
            # A rank owning no element of a parameter holds no state for it: every rank takes the
            # entries of the first rank that does (rank 0, whose part is never empty), tensors on the CPU.
            everyone: list[Any] = [None] * dist.get_world_size(self.group)
            sent = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in entries.items()}
            dist.all_gather_object(everyone, sent, group=self.group)
            entries = {i: s for held in reversed(everyone) for i, s in held.items()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for i in sorted(entries):
            held = mine.get(i, {})
            state[i] = {
                k: whole([held.get(k, torch.zeros(0, dtype=v, device=params[i].device))], [self.shapes[i]], self._group(i))[0]
                if isinstance(v, torch.dtype) else _copied(v) for k, v in entries[i].items()
            }
        return {"state": state, "param_groups": copy.deepcopy(own["param_groups"])}

    def load(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        """Load a whole optimizer state (from :meth:`state_dict` on any world size, or a plain
        optimizer's ``state_dict()``, indices as ints or strings): this rank keeps its part of
        every entry. Checked before anything changes: the param groups, the indices, each entry."""
        if len(full["param_groups"]) != len(optimizer.param_groups):
            raise ValueError("load_full_optimizer_state_dict: the state dict has a different number of param groups")
        if any(len(saved["params"]) != len(g["params"]) for saved, g in zip(full["param_groups"], optimizer.param_groups)):
            raise ValueError("load_full_optimizer_state_dict: a param group holds a different number of parameters")
        states = {int(i): s for i, s in full["state"].items()}
        if any(not 0 <= i < len(self.shapes) for i in states):
            raise ValueError(f"load_full_optimizer_state_dict: the state holds entries for {len(states)} parameters "
                             f"(indices up to {max(states)}), the optimizer steps {len(self.shapes)}")
        optimizer.load_state_dict({**full, "state": self._cut_all(states)})
