"""``graphddp.compile(model, optimizer=opt, sharding="full")``: parameters, gradients and optimizer
state held 1/N per rank, each parameter gathered where the forward and the backward read it.

The cut (parameters to parts, reads to gathers, gradients reduce-scattered back) is
:mod:`graphddp.frontend.parts`. With ``reshard_after_forward`` (default True) the backward gathers
again instead of keeping the gathered parameters (:mod:`graphddp.graph.reshard`). Which backward
updates its parts itself, and what it leaves to ``opt.step()``: :mod:`graphddp.compiler.full_updates`.

The parts are this mode's residency: the optimizer steps them, so its state is 1/N per rank, and
``model.module``'s own parameters are the parts, while the state dicts and ``named_parameters()``
stay whole (gathered, so **every rank calls them**: checkpoints move between world sizes and to
plain models). With a 2-D ``device_mesh=`` (FSDP2's HSDP) every "N" is the shard dim's size. Each
option in use, ``mp_policy=``, and what is refused by name (comm hooks, ``join()``): docs/full-sharding.md.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.compiler.full import Compiled, FullyShardedCompiler
from graphddp.compiler.full_updates import PartUpdates
from graphddp.compiler.model_trace import cast_floats
from graphddp.config import MB, DDPConfig
from graphddp.frontend.mesh import MeshGroups
from graphddp.frontend.parts import Part, install_whole_state_dicts, repoint_optimizer, shard_parameters
from graphddp.frontend.wrap import ModelState
from graphddp.plan.parts import PREFETCH
from graphddp.optim import clip, guards
from graphddp.runtime import agree
from graphddp.runtime.step import StepState
from graphddp.runtime.sync import broadcast_tensors
from graphddp.values.comm import group_name_of
from graphddp.values.part_schedule import FullSchedule, PartGraph, RankMemory
from graphddp.values.placement import Level, Whole


class FullyShardedState(ModelState):
    """One fully sharded model on this rank, cut into parts once the wrap's broadcast has made the
    parameters agree. With a 2-D ``device_mesh=`` the parts, the optimizer's state and the clip's norm
    are over the shard group (every replicate group holds the same averaged parts: a norm over every
    rank would count each part once per replica); the rest runs on every rank's group."""

    optimizer: torch.optim.Optimizer

    def __init__(self, module: nn.Module, groups: MeshGroups, config: DDPConfig, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(module, groups.whole, config, optimizer)
        guards.watch_gathered_copies()
        below = int((config.replicate_below_mb or 0) * MB)
        replicated = Whole(Level(group_name_of(groups.whole), dist.get_world_size(groups.whole))) if below else None
        parts = shard_parameters(module, groups.shard, config.mp_policy, groups.placement, replicated, below)
        for part in parts.values():
            # clip_grad_norm_ on parts is refused (graphddp.optim.guards), told whether max_grad_norm clips already
            setattr(part.part, guards.PART, True if config.max_grad_norm is None else (config.max_grad_norm, config.grad_norm_type))
        self.whole_state = repoint_optimizer(optimizer, parts, groups.shard)
        if config.max_grad_norm is not None:
            whole_parts = {id(p.part) for p in parts.values() if p.group is None}
            clip.clip_parts_before_step(optimizer, config.max_grad_norm, config.grad_norm_type, groups.shard, whole_parts)
        guards.agree_found_inf(optimizer, groups.whole)  # parts: one rank's inf must skip every rank's step
        self._groups = groups
        self._parts = parts
        self._by_name = {name: part for part in parts.values() for name in part.names}
        self.step = StepState()  # require_backward_grad_sync, read at the forward; the optimizer inside's runs and counts
        self._forwards = 0  # run by this rank: every rank runs every forward (_check_same_forward)
        updates = PartUpdates.of(optimizer, module, self.step, config.verify, config.max_grad_norm)
        self.record = Compiled(
            {id(p.part): p.names[0] for p in parts.values()}, self.world_size, updates, groups.whole, placement=groups.placement,
            replicated=replicated,
        )
        self.records = self.record.records  # every compiled graph's, in order
        install_whole_state_dicts(module, parts)
        self.compile_graph = FullyShardedCompiler(config, self.record)

    @property
    def world_size(self) -> int:
        """The ranks each parameter is cut over: the shard group's (every rank without a 2-D ``device_mesh=``)."""
        return dist.get_world_size(self._groups.shard)

    @property
    def parts(self) -> dict[str, Part]:
        return dict(self._by_name)

    @property
    def schedules(self) -> list[FullSchedule]:
        """One per Dynamo graph compiled so far: its forward's and backward's collectives as planned,
        placed as the compiled graphs have them, and what this rank holds."""
        by_index: dict[int, dict[str, PartGraph]] = {}
        for record in self.records:
            by_index.setdefault(record.index, {})[record.kind] = record.schedule
        return [
            FullSchedule(
                graph_index=index, world_size=self.world_size, reshard_after_forward=self.config.reshard_after_forward,
                prefetch=PREFETCH, forward=pair.get("forward"), backward=pair.get("backward"),
                memory=self._memory(pair.get("forward"), pair.get("backward")), replicas=self._groups.placement.shape()[0],
            )
            for index, pair in sorted(by_index.items())
        ]

    def _memory(self, forward: PartGraph | None, backward: PartGraph | None) -> RankMemory:
        """What this rank holds: the parts, their gradients and state (the whole model), the gathers
        of one graph in flight at once, and those its forward keeps for the backward (read off the
        compiled forward's outputs: those the backward reads, or with resharding its first bucket's)."""
        parts = [p.part for p in self._parts.values()]
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        states = [self.optimizer.state.get(p, {}) for p in parts]
        state = sum(size(v) for st in states for v in st.values() if isinstance(v, torch.Tensor))
        graphs = [g for g in (forward, backward) if g is not None]
        inside = {n for r in self.records for n in r.schedule.updates}
        kept = 0 if forward is None else forward.kept_bytes
        return RankMemory(
            parameters=sum(size(p) for p in parts),
            whole_parameters=sum(p.numel * p.part.element_size() for p in self._parts.values()),
            gradients=sum(size(p.part) for p in self._parts.values() if p.part.requires_grad and p.names[0] not in inside),
            optimizer_state=state,
            gathered_in_flight=max((g.in_flight_bytes(PREFETCH) for g in graphs), default=0),
            kept_to_backward=kept,
        )

    def before_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every forward's work before the compiled one: the check that every rank runs it, the
        buffers' broadcast (DDP's rule: :meth:`ModelState.buffers_to_broadcast`), a mixed-precision
        policy's input cast."""
        self._check_same_forward()
        buffers = self.buffers_to_broadcast()
        if buffers:
            broadcast_tensors(buffers, self.group)
        policy = self.config.mp_policy
        if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), policy.param_dtype)
        return args, kwargs

    def after_forward(self, out: Any) -> Any:
        """A mixed-precision policy's output cast."""
        self.forward_synchronised(self.step.sync and torch.is_grad_enabled())
        policy = self.config.mp_policy
        return cast_floats(out, policy.output_dtype) if policy is not None and policy.output_dtype is not None else out

    def _check_same_forward(self) -> None:
        """Every rank must run every forward, and the same graphs, as each gathers from all ranks: a
        forward one rank runs alone (nanoGPT's ``estimate_loss`` on rank 0) would pair its gathers
        with the others' next collectives, a hang or, where the sizes match, the wrong tensors; so
        would graphs that gather other parameters on other ranks. So before its first collective
        each forward agrees, in a fixed-size collective that pairs only with its own kind, on how
        many forwards this rank has run, whether autograd is on, and a hash of what the graphs
        called since the last forward sent (:meth:`Compiled.take_ran`: a forward that ran other
        graphs on other ranks is found at the next one, before another collective); ranks that
        differ raise on every rank, naming each side (its cost, one small all-gather:
        docs/full-sharding.md)."""
        if agree.nothing_to_agree(self.group):
            self.record.ran.clear()
            return
        self._forwards += 1
        layouts, digest = self.record.take_ran()
        mine = [self._forwards, int(torch.is_grad_enabled()), digest]
        if agree.same_on_every_rank(mine, self.group):
            return
        everyone = agree.gather((mine[:2], layouts), self.group)
        if all(counts == everyone[0][0] for counts, _ in everyone):
            raise agree.ScheduleMismatchError(_different_graphs([ran for _, ran in everyone], self._forwards - 1))
        sides = "; ".join(
            f"rank {r}: its forward {n}, {'with autograd' if grad else 'under no_grad'}" for r, ((n, grad), _) in enumerate(everyone)
        )
        raise agree.ScheduleMismatchError(
            f"graphddp: sharding='full': the ranks are not running the same forward ({sides}). Every forward gathers "
            "the parameters from every rank, so every rank runs every forward, evaluation included (nanoGPT's "
            "estimate_loss runs on rank 0 alone: run it on every rank)"
        )

    def join(self, view: Any, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("graphddp: join() is not supported with sharding='full' yet (every forward gathers)")

    def register_comm_hook(self, *_: Any) -> None:
        raise NotImplementedError("graphddp: register_comm_hook is not supported with sharding='full' yet")

    # -- whole tensors in and out (graphddp.frontend.parts.install_whole_state_dicts: hooks on the module) ---
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Whole tensors under the module's keys; each rank keeps its part, copied into it."""
        if assign:
            raise ValueError(
                "graphddp: load_state_dict(assign=True) with sharding='full': the optimizer, the compiled graphs and the "
                "update inside the backward hold this rank's parts, so they are loaded by copying into them; "
                "call load_state_dict(state_dict) without assign"
            )
        return super().load_state_dict(state_dict, strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The whole current values, gathered (every rank calls it), detached."""
        seen: set[int] = set()
        for name, part in self._by_name.items():
            if remove_duplicate and id(part) in seen:
                continue
            seen.add(id(part))
            gathered = nn.Parameter(part.whole_value(), requires_grad=False)
            # clipping it would clip nothing: refused (graphddp.optim.guards), saying whether max_grad_norm clips already
            setattr(gathered, guards.GATHERED_COPY, getattr(part.part, guards.PART, True))
            yield (f"{prefix}.{name}" if prefix else name), gathered

    def _whole_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        return self.optimizer, self.whole_state


def _different_graphs(ran: list[list[tuple]], forward: int) -> str:
    """Where the graphs the ranks called in their forward ``forward`` (and its backward) first
    gathered differently: the first graph call and bucket where a rank differs from rank 0."""
    other = next(r for r, layouts in enumerate(ran) if layouts != ran[0])
    k = next((i for i, (a, b) in enumerate(zip(ran[0], ran[other])) if a != b), min(len(ran[0]), len(ran[other])))

    def side(rank: int) -> str:
        if k >= len(ran[rank]):
            return f"rank {rank} called {len(ran[rank])} compiled graph(s)"
        kind, layout = ran[rank][k]
        if kind == "inference":
            return f"rank {rank}'s gathers {list(layout)}"
        return f"rank {rank}'s gathers " + "; ".join(f"{b[0]} {b[1]} of {list(b[3])}" for b in layout)

    return (
        f"graphddp: sharding='full': the ranks ran different compiled graphs in their forward {forward}, graph call {k + 1}: "
        f"{side(0)}, {side(other)}. Each gather pairs the ranks' parts of one parameter, so this step's gathered values "
        "were wrong; every rank must run the same modules in the same order (a branch on the rank may take another "
        "input, not other parameters)"
    )
