"""``graphddp.compile(model, optimizer=opt, sharding="full")``: parameters, gradients and optimizer
state held 1/N per rank, each parameter gathered where the forward and the backward read it.

How (docs/design-full-sharding.md, SimpleFSDP's idea with plain tensors). Each parameter is
replaced in its module by this rank's part (:func:`graphddp.values.shards.padded_part`, the cut
``sharding="optimizer"`` uses), and the module's class by a subclass whose property of the same
name all-gathers the parts and views the result as the whole parameter. ``torch.compile`` traces
these gathers into the forward graphs (across graph breaks: every graph gathers what it reads),
and AOTAutograd derives each gather's backward, a reduce-scatter of the gradient, so every rank
receives the gradient of its part, summed over ranks; :class:`_Average` divides the whole
gradient by the world size first, as DDP does. With ``reshard_after_forward`` (default True) the
backward gathers again instead of keeping the gathered parameters (:mod:`graphddp.graph.reshard`).

What the parts mean for the user:

* the optimizer passed as ``optimizer=`` is re-pointed at the parts (its param groups, and any
  state it already has, cut to each part), so its state is 1/N per rank. With torch.optim's
  SGD, Adam or AdamW each backward updates its parts itself, right after their gradients
  arrive, and leaves them no gradient; ``opt.step()`` stays torch's and steps what a backward
  left to it (a ``no_sync`` micro-step's accumulation, a weight tied across a graph break,
  other optimizer classes: :mod:`graphddp.compiler.full_updates`); ``max_grad_norm=`` clips by
  the global norm (``grad_norm_type``'s) of the whole gradient (one all-reduce of a number before ``opt.step()``,
  which then steps every part);
* ``model.state_dict()`` gives whole tensors under the wrapped module's keys and
  ``load_state_dict`` keeps this rank's part: checkpoints move between world sizes and to plain
  models; both gather or read every part, so **every rank calls them**;
* ``model.parameters()`` / ``named_parameters()`` give the whole current values, gathered (every
  rank calls them too), detached: for reading (an EMA, a norm, a copy), not for training;
  ``model.module``'s own parameters are the parts;
* ``no_sync()`` / ``require_backward_grad_sync`` (read at the forward, as DDP reads it): the
  backward does not update, and still reduce-scatters (the accumulated gradient is DDP's; the
  bytes are one reduce-scatter per micro-step).

Mixed precision is FSDP2's ``MixedPrecisionPolicy`` passed as ``mp_policy=`` (same meaning):
parameters gathered and computed in ``param_dtype``, gradients reduce-scattered in
``reduce_dtype``, the parts and the optimizer's state in the parameters' own dtype.

Not yet (refused by name where an option asks for it): comm hooks, ``join()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from graphddp.compiler.full import Compiled, fully_sharded_compiler
from graphddp.compiler.full_updates import PartUpdates
from graphddp.config import DDPConfig
from graphddp.frontend.wrap import check_and_broadcast
from graphddp.graph.part_collectives import PREFETCH
from graphddp.optim import clip, guards
from graphddp.optim.shard import ELEMENTWISE, check_whole_state
from graphddp.runtime import agree
from graphddp.runtime.calibrate import resolve_cost
from graphddp.runtime.sync import broadcast_tensors
from graphddp.values.comm import gather_flat
from graphddp.values.part_schedule import FullSchedule, PartGraph, RankMemory
from graphddp.values.shards import padded_part

_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
# The functional all-gather whose backward reduce-scatters: its torch 2.13 name, or the older one.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class _Average(torch.autograd.Function):
    """Identity forward; the backward divides the whole gradient by the world size before the
    reduce-scatter sums it, as DDP divides before its all-reduce."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.world = world
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad / ctx.world, None


@dataclasses.dataclass
class Part:
    """One parameter of the module as this rank holds it."""

    part: nn.Parameter  # flat, chunk(numel, world) elements, zero past the parameter's end
    shape: tuple[int, ...]
    names: list[str]  # every name it has in the module (tied weights: more than one)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_AG = torch.ops._c10d_functional.all_gather_into_tensor.default
_RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default


class _GatherInDtype(torch.autograd.Function):
    """With a mixed-precision policy (FSDP2's, same meaning): the parts cast to ``param_dtype``
    and all-gathered (the forward's bytes in that dtype); the backward casts the whole gradient
    to ``reduce_dtype``, divides it by the world size, reduce-scatters it (sum) and casts this
    rank's part back to the part's dtype, where the optimizer steps it. A function of its own
    because autograd's derived reduce-scatter would send the gradient in the gathered dtype."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, world: int, group_name: str, param_dtype: torch.dtype,  # type: ignore[override]
                reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.world, ctx.group_name, ctx.reduce_dtype, ctx.part_dtype = world, group_name, reduce_dtype, part.dtype
        return _WAIT(_AG(part.to(param_dtype), world, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        sent = grad.to(ctx.reduce_dtype) / ctx.world
        return _WAIT(_RS(sent, "sum", ctx.world, ctx.group_name)).to(ctx.part_dtype), None, None, None, None


def _gathered(part: torch.Tensor, shape: tuple[int, ...], group: Any, policy: Any = None) -> torch.Tensor:
    """The whole parameter from every rank's part: all-gather, drop the padding, view; with a
    mixed-precision ``policy`` in its ``param_dtype`` (:class:`_GatherInDtype`)."""
    world = dist.get_world_size(group)
    param_dtype = getattr(policy, "param_dtype", None) or part.dtype
    reduce_dtype = getattr(policy, "reduce_dtype", None) or param_dtype
    if param_dtype == part.dtype and reduce_dtype == part.dtype:
        return _Average.apply(_all_gather(part, 0, group)[: math.prod(shape)].view(shape), world)
    full = _GatherInDtype.apply(part, world, group.group_name, param_dtype, reduce_dtype)
    return full[: math.prod(shape)].view(shape)


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a gathering property per parameter name; one class per (class, names), so
    that a model's equal blocks share one class (Dynamo guards on it)."""
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        def prop(name: str) -> property:
            def getter(self: nn.Module) -> torch.Tensor:
                q = self._parameters[name]
                return _gathered(q, q._graphddp_shape, q._graphddp_group, q._graphddp_policy)
            return property(getter)

        _SHARDED_CLASSES[key] = type(f"FullySharded{cls.__name__}", (cls,), {n: prop(n) for n in names})
    return _SHARDED_CLASSES[key]


def shard_parameters(module: nn.Module, group: Any, policy: Any = None) -> dict[int, Part]:
    """Replace every parameter of ``module`` by this rank's part and every read of it by a gather
    (module docstring). Returns the parts by the id of the parameter they replace."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts: dict[int, Part] = {}  # by the replaced parameter's id
    placed: dict[int, Part] = {}  # by the part's id: a module reached twice holds parts already
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        for name in names:
            p = mod._parameters[name]
            entry = placed.get(id(p)) or parts.get(id(p))
            if entry is None:
                q = nn.Parameter(padded_part(p, world, rank), requires_grad=p.requires_grad)
                q._graphddp_shape, q._graphddp_group, q._graphddp_policy = tuple(p.shape), group, policy  # type: ignore[attr-defined]
                entry = parts[id(p)] = placed[id(q)] = Part(q, tuple(p.shape), [])
            full_name = f"{mod_name}.{name}" if mod_name else name
            if full_name not in entry.names:
                entry.names.append(full_name)
            mod._parameters[name] = entry.part
        if type(mod) not in _SHARDED_CLASSES.values():
            mod.__class__ = _sharded_class(type(mod), names)
    return parts


def repoint_optimizer(optimizer: torch.optim.Optimizer, parts: Mapping[int, Part], world: int, rank: int) -> None:
    """Make ``optimizer`` step the parts: its param groups name them instead of the whole
    parameters, and any state it has is cut to this rank's part (elementwise entries; a step
    count stays as it is)."""
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if id(p) not in parts:
                raise ValueError(
                    "graphddp.compile(..., sharding='full'): the optimizer holds a tensor that is not a parameter of the "
                    f"module (shape {list(p.shape)}); build it over model.parameters() before graphddp.compile"
                )
            q = parts[id(p)].part
            state = optimizer.state.pop(p, None)
            if state:
                optimizer.state[q] = cut_state(state, world, rank, parts[id(p)])
            group["params"][i] = q


def cut_state(state: Mapping[str, Any], world: int, rank: int, part: Part) -> dict[str, Any]:
    """``part``'s whole optimizer state with every elementwise entry cut to ``rank``'s padded
    part (a step count and other entries stay as they are); an entry of another size is refused
    (:func:`graphddp.optim.shard.check_whole_state`)."""
    check_whole_state(part.names[0], state, part.numel)
    return {k: padded_part(v, world, rank) if k in ELEMENTWISE and isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor of ``tree`` cast to ``dtype`` (FSDP2's ``cast_forward_inputs``
    and ``output_dtype``; integer tensors, such as token ids, stay as they are)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class FullyShardedGraphDDP(nn.Module):
    """What ``graphddp.compile(..., sharding="full")`` returns (module docstring)."""

    def __init__(self, module: nn.Module, group: Any, config: DDPConfig, optimizer: torch.optim.Optimizer, parts: dict[int, Part]) -> None:
        super().__init__()
        self.module = module
        self.process_group = group
        self.config = config
        self.optimizer = optimizer
        self._parts = parts
        self._by_name = {name: part for part in parts.values() for name in part.names}
        self._sync = True
        self._forwards = 0  # run by this rank: every rank runs every forward (_check_same_forward)
        updates = PartUpdates.of(optimizer, module, lambda: self._sync, config.verify, config.max_grad_norm)
        self._record = Compiled({id(p.part): p.names[0] for p in parts.values()}, dist.get_world_size(group), updates, group)
        self.graphs = self._record.graphs  # every compiled forward and backward, in order
        object.__setattr__(self, "_compiled", torch.compile(
            module, backend=fully_sharded_compiler(config, self._record), fullgraph=config.fullgraph, dynamic=config.dynamic, **_ISOLATED
        ))

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def parts(self) -> dict[str, Part]:
        """Every parameter name of the wrapped module (tied weights: each of theirs) and the part
        this rank holds for it."""
        return dict(self._by_name)

    @property
    def schedules(self) -> list[FullSchedule]:
        """One :class:`~graphddp.values.part_schedule.FullSchedule` per Dynamo graph compiled so
        far: its forward's and backward's collectives, read back from the compiled graphs, and
        what this rank holds."""
        by_index: dict[int, dict[str, PartGraph]] = {}
        for index, graph in self._record.described:
            by_index.setdefault(index, {})[graph.kind] = graph
        return [
            FullSchedule(
                graph_index=index, world_size=self.world_size, reshard_after_forward=self.config.reshard_after_forward,
                prefetch=PREFETCH, forward=pair.get("forward"), backward=pair.get("backward"),
                memory=self._memory(pair.get("forward"), pair.get("backward")),
            )
            for index, pair in sorted(by_index.items())
        ]

    def _memory(self, forward: PartGraph | None, backward: PartGraph | None) -> RankMemory:
        """What this rank holds: the parts, their gradients and state (the whole model), and
        the gathers of one graph in flight at once, and those its forward keeps for the backward
        (read off the compiled forward's outputs: without resharding, those the backward reads;
        with it, the backward's first bucket, :mod:`graphddp.graph.reshard`)."""
        parts = [p.part for p in self._parts.values()]
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        states = [self.optimizer.state.get(p, {}) for p in parts]
        state = sum(size(v) for st in states for v in st.values() if isinstance(v, torch.Tensor))
        graphs = [g for g in (forward, backward) if g is not None]
        inside = {n for _, g in self._record.described for n in g.updates}
        kept = 0 if forward is None else forward.kept_bytes
        return RankMemory(
            parameters=sum(size(p) for p in parts),
            whole_parameters=sum(p.numel * p.part.element_size() for p in self._parts.values()),
            gradients=sum(size(p.part) for p in self._parts.values() if p.part.requires_grad and p.names[0] not in inside),
            optimizer_state=state,
            gathered_in_flight=max((g.in_flight_bytes(PREFETCH) for g in graphs), default=0),
            kept_to_backward=kept,
        )

    @torch._dynamo.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_same_forward()
        if self.config.broadcast_buffers and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_tensors(buffers, self.process_group)
        policy = self.config.mp_policy
        if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
        out = self._compiled(*args, **kwargs)
        if policy is not None and policy.output_dtype is not None:
            out = _cast_floats(out, policy.output_dtype)
        return out

    def _check_same_forward(self) -> None:
        """Every rank must run every forward: each one gathers the parameters from all ranks. A
        forward one rank runs alone (nanoGPT's ``estimate_loss`` on rank 0) would pair its
        gathers with the other ranks' next collectives: a hang until the process group's
        timeout, or, where those are gathers of the same sizes, the wrong tensors.
        So before its first collective each forward takes part in a fixed-size one
        (:func:`graphddp.runtime.agree.max_over_ranks`, which pairs only with its own kind) of
        how many forwards this rank has run and whether autograd is on; ranks that differ raise
        :class:`~graphddp.runtime.agree.ScheduleMismatchError` on every rank, naming each side.
        One small all-gather read on the host per forward (its cost: docs/full-sharding.md)."""
        if agree.nothing_to_agree(self.process_group):
            return
        self._forwards += 1
        mine = [self._forwards, int(torch.is_grad_enabled())]
        got = agree.max_over_ranks([*mine, *(-v for v in mine)], self.process_group)
        if got[:2] == [-v for v in got[2:]]:
            return
        sides = "; ".join(
            f"rank {r}: its forward {n}, {'with autograd' if grad else 'under no_grad'}"
            for r, (n, grad) in enumerate(agree.gather(mine, self.process_group))
        )
        raise agree.ScheduleMismatchError(
            f"graphddp: sharding='full': the ranks are not running the same forward ({sides}). Every forward gathers "
            "the parameters from every rank, so every rank runs every forward, evaluation included (nanoGPT's "
            "estimate_loss runs on rank 0 alone: run it on every rank)"
        )

    # -- DDP's switches: accepted, the gradient is reduce-scattered every micro-step -----------------
    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A forward under it does not update the parts in its backward: the gradients
        accumulate (still reduce-scattered each micro-step, module docstring) until a
        synchronising micro-step, whose ``opt.step()`` steps them."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    @property
    def updates(self) -> dict[str, int]:
        """How many backwards updated their parts inside (``"inside"``) and how many left them
        to ``opt.step()``, by reason (:mod:`graphddp.compiler.full_updates`); empty where the
        optimizer steps after every backward (its class, or ``max_grad_norm``)."""
        updates = self._record.updates
        return {} if updates is None else dict(updates.counts)

    def join(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("graphddp: join() is not supported with sharding='full' yet (every forward gathers)")

    def register_comm_hook(self, *_: Any, **__: Any) -> None:
        raise NotImplementedError("graphddp: register_comm_hook is not supported with sharding='full' yet")

    # -- whole tensors in and out -------------------------------------------------------------------
    def _whole(self, part: Part) -> torch.Tensor:
        return self._whole_of(part.part, part)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict with every parameter whole (gathered: every rank calls it)."""
        out = self.module.state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        whole: dict[int, torch.Tensor] = {}
        for name, part in self._by_name.items():
            key = prefix + name
            if key in out:
                if id(part) not in whole:
                    whole[id(part)] = self._whole(part)
                out[key] = whole[id(part)]
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Whole tensors under the module's keys; each rank keeps its part, copied into it."""
        if assign:
            raise ValueError(
                "graphddp: load_state_dict(assign=True) with sharding='full': the optimizer, the compiled graphs and the "
                "update inside the backward hold this rank's parts, so they are loaded by copying into them; "
                "call load_state_dict(state_dict) without assign"
            )
        rank = dist.get_rank(self.process_group)
        cut = dict(state_dict)
        for name, part in self._by_name.items():
            value = cut.get(name)
            if isinstance(value, torch.Tensor):
                if tuple(value.shape) != part.shape:
                    raise ValueError(f"graphddp: {name!r} has shape {list(value.shape)} in the state dict, {list(part.shape)} in the model")
                cut[name] = padded_part(value.to(part.part.device), self.world_size, rank)
        return self.module.load_state_dict(cut, strict=strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        """The whole current values, gathered (every rank calls it), detached (module docstring)."""
        seen: set[int] = set()
        for name, part in self._by_name.items():
            if remove_duplicate and id(part) in seen:
                continue
            seen.add(id(part))
            whole = nn.Parameter(self._whole(part), requires_grad=False)
            # clipping it would clip nothing: refused (graphddp.optim.guards), saying whether max_grad_norm clips already
            setattr(whole, guards.GATHERED_COPY, getattr(part.part, guards.PART, True))
            yield (f"{prefix}.{name}" if prefix else name), whole

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    # -- the optimizer's whole state ------------------------------------------------------------------
    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """The state dict a plain optimizer of the same class over the whole parameters would
        have: every elementwise entry gathered and cut to its parameter's shape (every rank
        calls it; the padding is dropped)."""
        out = self.optimizer.state_dict()
        by_index = self._parts_by_index()
        for index, state in out["state"].items():
            part = by_index[index]
            out["state"][index] = {
                k: self._whole_of(v, part) if k in ELEMENTWISE and isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        return out

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a whole optimizer state (from :meth:`full_optimizer_state_dict` on any world size,
        or a plain optimizer's ``state_dict()``): each rank keeps its part of every entry."""
        world, rank = self.world_size, dist.get_rank(self.process_group)
        by_index = self._parts_by_index()
        if len(state["state"]) > len(by_index) or any(int(i) >= len(by_index) for i in state["state"]):
            raise ValueError(f"load_full_optimizer_state_dict: the state holds entries for {len(state['state'])} parameters "
                             f"(indices up to {max(int(i) for i in state['state'])}), the optimizer steps {len(by_index)}")
        cut = {**state, "state": {index: cut_state(st, world, rank, by_index[int(index)]) for index, st in state["state"].items()}}
        self.optimizer.load_state_dict(cut)

    def _parts_by_index(self) -> list[Part]:
        """The parts in the optimizer's order: what a state dict's index names."""
        parts = {id(part.part): part for part in self._parts.values()}
        return [parts[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def _whole_of(self, value: torch.Tensor, part: Part) -> torch.Tensor:
        out = torch.empty(value.numel() * self.world_size, dtype=value.dtype, device=value.device)
        gather_flat(out, value.detach().contiguous(), self.process_group)
        return out[: part.numel].view(part.shape)


def compile_fully_sharded(module: nn.Module, group: Any, config: DDPConfig, optimizer: Any) -> FullyShardedGraphDDP:
    """``graphddp.compile``'s ``sharding="full"`` path: the wrap-time checks every mode makes,
    the broadcast from the group's first rank (whole tensors, before they are cut), the cut, and
    the optimizer re-pointed at the parts."""
    where = "graphddp.compile"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"{where}: sharding='full' keeps each parameter's optimizer state 1/N per rank, so it needs optimizer= "
            "(a torch.optim optimizer over model.parameters(), built before graphddp.compile)"
        )
    device = check_and_broadcast(where, module, group, config)  # whole tensors, before they are cut
    config = resolve_cost(config, group, device)  # what the buckets' cap is planned with (graphddp.plan.full_cap)
    guards.watch_gathered_copies()
    parts = shard_parameters(module, group, config.mp_policy)
    for part in parts.values():
        # clip_grad_norm_ on parts is refused (graphddp.optim.guards), told whether max_grad_norm clips already
        setattr(part.part, guards.PART, True if config.max_grad_norm is None else (config.max_grad_norm, config.grad_norm_type))
    repoint_optimizer(optimizer, parts, dist.get_world_size(group), dist.get_rank(group))
    if config.max_grad_norm is not None:
        clip.clip_parts_before_step(optimizer, config.max_grad_norm, config.grad_norm_type, group)
    guards.agree_found_inf(optimizer, group)  # parts: one rank's inf must skip every rank's step
    return FullyShardedGraphDDP(module, group, config, optimizer, parts)
