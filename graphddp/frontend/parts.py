"""The cut of ``sharding="full"``: each parameter to this rank's part, every read of it a gather.

Each parameter is replaced in its module by this rank's part (:func:`graphddp.values.shards.padded_part`,
the cut ``sharding="optimizer"`` uses), and the module's class by a subclass whose property of the same
name all-gathers the parts and views the result as the whole parameter (SimpleFSDP's idea with plain
tensors, docs/design-full-sharding.md). ``torch.compile`` traces these gathers into every graph that
reads the parameter (across graph breaks too), and AOTAutograd derives each gather's backward, a
reduce-scatter of the gradient, so every rank receives its part's gradient summed over ranks. A
parameter smaller than ``replicate_below_mb`` stays whole on every rank and is never gathered.

The cut is made once, at wrap time, with the optimizer re-pointed at the parts and state dicts that
hold whole tensors; :mod:`graphddp.frontend.full` builds the mode around it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from graphddp.optim.whole_state import WholeState
from graphddp.values.collectives import ALL_GATHER_OP, ALL_REDUCE_OUT_OP, REDUCE_SCATTER_OP
from graphddp.values.comm import WAIT
from graphddp.values.placement import Level, Placement, Whole, flat
from graphddp.values.shards import padded_part, whole

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
    group: Any  # the shard group its part is cut over; None: whole on every rank (replicate_below_mb)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def whole_value(self) -> torch.Tensor:
        """The parameter whole (gathered over its shard group: every rank of it calls this)."""
        return whole([self.part], [self.shape], self.group)[0]

    def cut(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole ``value`` of the parameter's shape."""
        world, rank = (1, 0) if self.group is None else (dist.get_world_size(self.group), dist.get_rank(self.group))
        return padded_part(value, world, rank)


class _Gather(torch.autograd.Function):
    """The gather of a part with graphddp's own backward, where the one autograd derives for the
    functional all-gather (the gradient reduce-scattered as it comes, over one group) would be
    wrong: under a mixed-precision policy (FSDP2's meaning) the parts are gathered in
    ``param_dtype``, the gradient sent in ``reduce_dtype`` and cast back to the part's dtype, where
    the optimizer steps it; with hybrid sharding each part's gradient is also averaged over the
    replicate group. The raw reduce-scatter is what :mod:`graphddp.graph.part_collectives` finds,
    buckets and lowers per backend."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, placement: Placement, param_dtype: torch.dtype,  # type: ignore[override]
                reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.placement, ctx.reduce_dtype, ctx.part_dtype = placement, reduce_dtype, part.dtype
        return WAIT(ALL_GATHER_OP(part.to(param_dtype), placement.shard.size, placement.shard.name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        placement = ctx.placement
        sent = grad.to(ctx.reduce_dtype) / placement.world
        done = placement.average_replicas(WAIT(REDUCE_SCATTER_OP(sent, "sum", placement.shard.size, placement.shard.name)))
        return done.to(ctx.part_dtype), None, None, None


class _Replicated(torch.autograd.Function):
    """The read of a parameter held whole on every rank: the parameter itself (in a policy's
    ``param_dtype``), whose backward is DDP's average, in ``reduce_dtype``, over the placement's
    one group, which :mod:`graphddp.graph.part_collectives` buckets beside the reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, placement: Whole, param_dtype: torch.dtype,  # type: ignore[override]
                reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.placement, ctx.reduce_dtype, ctx.part_dtype = placement, reduce_dtype, whole.dtype
        return whole.view_as(whole) if param_dtype == whole.dtype else whole.to(param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        placement = ctx.placement
        sent = grad.to(ctx.reduce_dtype) / placement.world
        return WAIT(ALL_REDUCE_OUT_OP(sent, "sum", placement.shard.name)).to(ctx.part_dtype), None, None, None


def _read_args(shape: tuple[int, ...], placement: Placement, policy: Any) -> tuple:
    """How a part is read whole, fixed at the cut, as :func:`_whole_of`'s arguments after the part:
    the parameter's shape, its placement's groups ((name, size) each) and whether it is held whole
    on every rank, and a policy's dtypes (None: the part's own, and the ``param_dtype``). Plain
    values, so that Dynamo puts them in the graph as constants."""
    replicate = None if placement.replicate is None else (placement.replicate.name, placement.replicate.size)
    return (
        shape, (placement.shard.name, placement.shard.size), replicate, isinstance(placement, Whole),
        getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None),
    )


@torch._dynamo.allow_in_graph
def _whole_of(
    part: torch.Tensor, shape: tuple[int, ...], shard: tuple[str, int], replicate: tuple[str, int] | None, whole: bool,
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The whole parameter ``part`` stands for (:func:`_read_args`): the part itself where it is
    whole; else every rank's part gathered, the padding dropped; through :class:`_Gather` only
    where a policy's dtypes or a hybrid placement need its backward. One node to Dynamo, which
    AOTAutograd traces: Dynamo itself would trace each read's autograd function apart, at every
    read of every parameter (its cost: docs/full-sharding.md, compile time)."""
    param_dtype = param_dtype or part.dtype
    reduce_dtype = reduce_dtype or param_dtype
    if whole:
        return _Replicated.apply(part, Whole(Level(*shard)), param_dtype, reduce_dtype).view(shape)
    placement = Placement(Level(*shard), None if replicate is None else Level(*replicate))
    numel = math.prod(shape)
    if param_dtype == reduce_dtype == part.dtype and not placement.hybrid:
        gathered = _all_gather(part, 0, placement.shard.name)
        return _Average.apply(gathered[:numel].view(shape), placement.shard.size)
    return _Gather.apply(part, placement, param_dtype, reduce_dtype)[:numel].view(shape)


def _read(part: nn.Parameter) -> torch.Tensor:
    """The property of every parameter name of a cut module (:func:`shard_parameters` tags the part)."""
    return _whole_of(part, *part._graphddp_read)


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a gathering property per parameter name; one class per (class, names), so
    that a model's equal blocks share one class (Dynamo guards on it)."""
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        def prop(name: str) -> property:
            return property(lambda self: _read(self._parameters[name]))

        _SHARDED_CLASSES[key] = type(f"FullySharded{cls.__name__}", (cls,), {n: prop(n) for n in names})
    return _SHARDED_CLASSES[key]


def shard_parameters(
    module: nn.Module, group: Any, policy: Any = None, placement: Placement | None = None, replicated: Whole | None = None,
    below_bytes: int = 0,
) -> dict[int, Part]:
    """Replace every parameter of ``module`` by this rank's part over ``group`` (the shard group)
    and every read of it by a gather; ``placement``: where each part's gradient is averaged (None:
    over ``group`` alone). A parameter of fewer than ``below_bytes`` stays whole on every rank, its
    gradient averaged over ``replicated``'s group. Returns the parts by the replaced parameter's id."""
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
                keep = replicated is not None and p.numel() * p.element_size() < below_bytes
                q = nn.Parameter(padded_part(p, 1, 0) if keep else padded_part(p, world, rank), requires_grad=p.requires_grad)
                where = replicated if keep else placement or flat(group.group_name, world)
                q._graphddp_read = _read_args(tuple(p.shape), where, policy)  # type: ignore[attr-defined]
                entry = parts[id(p)] = placed[id(q)] = Part(q, tuple(p.shape), [], None if keep else group)
            full_name = f"{mod_name}.{name}" if mod_name else name
            if full_name not in entry.names:
                entry.names.append(full_name)
            mod._parameters[name] = entry.part
        if type(mod) not in _SHARDED_CLASSES.values():
            mod.__class__ = _sharded_class(type(mod), names)
    return parts


def repoint_optimizer(optimizer: torch.optim.Optimizer, parts: Mapping[int, Part], group: Any) -> WholeState:
    """Make ``optimizer`` step the parts: its param groups name them instead of the whole
    parameters, and any state it has is cut to this rank's part (:meth:`WholeState.cut_held`: every
    elementwise entry checked first; a step count stays as it is). Returns the :class:`WholeState`
    that moves its state whole in and out of the padded parts over ``group`` (the shard group)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stray = next((p for p in params if id(p) not in parts), None)
    if stray is not None:
        raise ValueError(
            "graphddp.compile(..., sharding='full'): the optimizer holds a tensor that is not a parameter of the "
            f"module (shape {list(stray.shape)}); build it over model.parameters() before graphddp.compile"
        )
    ordered = [parts[id(p)] for p in params]
    held_whole = frozenset(i for i, p in enumerate(ordered) if p.group is None)
    whole_state = WholeState(tuple(p.names[0] for p in ordered), tuple(p.shape for p in ordered), group, padded=True, held_whole=held_whole)
    whole_state.cut_held(optimizer, [p.part for p in ordered])
    for g in optimizer.param_groups:
        g["params"] = [parts[id(p)].part for p in g["params"]]
    return whole_state


def install_whole_state_dicts(module: nn.Module, parts: Mapping[int, Part]) -> None:
    """Make ``module.state_dict()`` gather every parameter whole under the module's own keys, and
    ``module.load_state_dict`` keep this rank's part of it, as hooks on the module so that a
    pipeline's ``model.state_dict()`` under ``graphddp.backend`` gathers too. Every rank calls them."""
    by_name = {name: part for part in parts.values() for name in part.names}

    def gather_parts(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        done: dict[int, torch.Tensor] = {}  # a tied weight: gathered once
        for name, part in by_name.items():
            if prefix + name in state:
                if id(part) not in done:
                    done[id(part)] = part.whole_value()
                state[prefix + name] = done[id(part)]

    def keep_parts(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, part in by_name.items():
            value = state.get(prefix + name)
            if isinstance(value, torch.Tensor):
                if tuple(value.shape) != part.shape:
                    raise ValueError(f"graphddp: {name!r} has shape {list(value.shape)} in the state dict, {list(part.shape)} in the model")
                state[prefix + name] = part.cut(value.to(part.part.device))

    module.register_state_dict_post_hook(gather_parts)
    module.register_load_state_dict_pre_hook(keep_parts)
