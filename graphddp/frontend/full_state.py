"""Whole tensors in and out of a fully sharded module: its state dicts and its optimizer's.

Checkpoints must not see the parts: ``state_dict()`` gathers every parameter whole under the
module's own keys, and ``load_state_dict`` keeps this rank's part, so checkpoints move between
world sizes and to plain models. Hooks on the module itself make both forms (and a pipeline's
``model.state_dict()`` under ``graphddp.backend``) behave alike. Every rank calls them: they gather.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.frontend.parts import Part, cut_state
from graphddp.optim.shard import ELEMENTWISE
from graphddp.values.comm import gather_flat
from graphddp.values.shards import padded_part


class WholeTensors:

    def __init__(self, parts: Mapping[int, Part], shard_group: Any) -> None:
        self.parts = dict(parts)
        self.by_name = {name: part for part in self.parts.values() for name in part.names}
        self.group = shard_group
        self.world = dist.get_world_size(shard_group)
        self.rank = dist.get_rank(shard_group)

    def install(self, module: nn.Module) -> None:
        """Make ``module.state_dict()`` whole and ``module.load_state_dict`` cut (module docstring)."""
        # Plain functions: torch marks a state-dict hook by setting an attribute on it, which a bound method refuses.
        module.register_state_dict_post_hook(lambda *args: self._whole_state(*args))
        module.register_load_state_dict_pre_hook(lambda *args: self._cut_state(*args))

    def whole(self, value: torch.Tensor, part: Part) -> torch.Tensor:
        """``value`` (a part, or a part-sized entry of its state) gathered into ``part``'s shape."""
        out = torch.empty(value.numel() * self.world, dtype=value.dtype, device=value.device)
        gather_flat(out, value.detach().contiguous(), self.group)
        return out[: part.numel].view(part.shape)

    def _whole_state(self, module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        done: dict[int, torch.Tensor] = {}  # a tied weight: gathered once
        for name, part in self.by_name.items():
            if prefix + name in state:
                if id(part) not in done:
                    done[id(part)] = self.whole(part.part, part)
                state[prefix + name] = done[id(part)]

    def _cut_state(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, part in self.by_name.items():
            value = state.get(prefix + name)
            if isinstance(value, torch.Tensor):
                if tuple(value.shape) != part.shape:
                    raise ValueError(f"graphddp: {name!r} has shape {list(value.shape)} in the state dict, {list(part.shape)} in the model")
                state[prefix + name] = padded_part(value.to(part.part.device), self.world, self.rank)

    # -- the optimizer's whole state ------------------------------------------------------------

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state dict a plain optimizer of the same class over the whole parameters would
        have: every elementwise entry gathered and cut to its parameter's shape (the padding
        dropped)."""
        out = optimizer.state_dict()
        by_index = self._by_index(optimizer)
        for index, state in out["state"].items():
            part = by_index[index]
            out["state"][index] = {
                k: self.whole(v, part) if k in ELEMENTWISE and isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        return out

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load a whole optimizer state (from :meth:`optimizer_state_dict` on any world size, or a
        plain optimizer's ``state_dict()``): this rank keeps its part of every entry."""
        by_index = self._by_index(optimizer)
        if len(state["state"]) > len(by_index) or any(int(i) >= len(by_index) for i in state["state"]):
            raise ValueError(f"load_full_optimizer_state_dict: the state holds entries for {len(state['state'])} parameters "
                             f"(indices up to {max(int(i) for i in state['state'])}), the optimizer steps {len(by_index)}")
        cut = {**state, "state": {i: cut_state(st, self.world, self.rank, by_index[int(i)]) for i, st in state["state"].items()}}
        optimizer.load_state_dict(cut)

    def _by_index(self, optimizer: torch.optim.Optimizer) -> list[Part]:
        """The parts in the optimizer's order: what a state dict's index names."""
        parts = {id(part.part): part for part in self.parts.values()}
        return [parts[id(p)] for g in optimizer.param_groups for p in g["params"]]
