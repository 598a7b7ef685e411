"""Clipping by global norm inside the backward (``max_grad_norm=``, ``grad_norm_type=``).

Background
    With the optimizer inside the backward no gradient is kept, so a loop's ``clip_grad_norm_``
    would clip nothing (:mod:`graphddp.optim.guards` refuses it). The graph computes instead what
    ``clip_grad_norm_(model.parameters(), c, norm_type=p)`` computes on the averaged gradients, op
    for op: each gradient's p-norm, the p-norm of their stack, ``c / (total + 1e-6)`` clamped to 1,
    every gradient multiplied by it before its update.

Sharded
    A p-norm is a sum over elements raised to 1/p, so each rank's sums of ``|g|^p`` over its parts
    add up over ranks to the whole gradient's: one SUM all-reduce (the inf-norm: a MAX of each
    rank's largest ``|g|``). Padding holds zeros, which add nothing to either. ``sharding="full"``
    clips the parts the same way, eagerly (:func:`clip_parts_before_step`).

Where (``Schedule.update_after`` decides)
    The norm needs every bucket's average, so no update runs before the last wait; each bucket's
    norms go right after its own wait, the coefficient after the last, then every update. The
    gradients the graph still returns are scaled too, as ``clip_grad_norm_`` scales every one.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from graphddp.graph.bucket_function import row_parts
from graphddp.graph.trace import after_all, role, splice, trace
from graphddp.values import collectives
from graphddp.values.comm import ALL_REDUCE, BUCKET_KEY, ROLE_KEY, WAIT

CLIP_NORM = "clip_norm"  # role of each gradient's norm
CLIP = "clip"  # the coefficient's arithmetic, and the scaling of returned gradients
CLIP_COEFFICIENT = "clip_coefficient"  # the coefficient itself: one node per clipped graph
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def gradient_norms_fn(norm_type: float) -> Callable[..., list[torch.Tensor]]:

    def gradient_norms(*grads: torch.Tensor) -> list[torch.Tensor]:
        with role(CLIP_NORM):
            return [torch.linalg.vector_norm(g, norm_type) for g in grads]

    return gradient_norms


def coefficient_fn(max_norm: float, norm_type: float) -> Callable[..., torch.Tensor]:

    def coefficient(*norms: torch.Tensor) -> torch.Tensor:
        with role(CLIP):
            total = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
            return torch.clamp(torch.reciprocal(total + EPS) * max_norm, max=1.0)

    return coefficient


def scale(coef: torch.Tensor, *grads: torch.Tensor) -> list[torch.Tensor]:
    with role(CLIP):
        return [g * coef for g in grads]


def reduce_op(norm_type: float) -> str:
    return "max" if norm_type == math.inf else "sum"


def part_norms(grad_part: torch.Tensor, sizes: Sequence[int], chunks: Sequence[int], norm_type: float) -> torch.Tensor:
    """Per slot of a reduce-scattered bucket, this rank's share of the gradient's norm, at least
    float32: the sum of ``|g|^p``, or for inf the largest ``|g|`` (``grad_part`` holds ``chunks[k]``
    elements per slot, the first ``sizes[k]`` this rank's)."""
    with role(CLIP_NORM):
        shares = []
        for size, piece in zip(sizes, row_parts(grad_part, chunks, sizes)):
            if piece.dtype not in (torch.float32, torch.float64):
                piece = piece.float()
            if norm_type == 2.0:
                shares.append(torch.sum(piece * piece))
            elif norm_type == math.inf:  # amax of nothing is an error; |g| >= 0, so 0 adds nothing
                shares.append(torch.amax(torch.abs(piece)) if size else piece.new_zeros(()))
            else:
                shares.append(torch.sum(torch.abs(piece) if norm_type == 1.0 else torch.pow(torch.abs(piece), norm_type)))
        return torch.stack(shares)


def _root(combined: torch.Tensor, norm_type: float) -> torch.Tensor:
    if norm_type == 2.0:
        return torch.sqrt(combined)
    if norm_type in (1.0, math.inf):
        return combined
    return torch.pow(combined, 1.0 / norm_type)


def sharded_coefficient_fn(max_norm: float, norm_type: float, buckets: int, group_name: str, world: int) -> Callable[..., torch.Tensor]:
    """The clip coefficient from every sharded bucket's :func:`part_norms`, combined over ranks by one
    all-reduce, and the norms of the gradients the graph returns (whole already: not combined)."""
    op = reduce_op(norm_type)
    issue = collectives.ALL_REDUCE.lower(collectives.backend_of(group_name)).issue if op == "sum" else (
        lambda flat, group, _world: ALL_REDUCE(flat, op, group))

    def coefficient(*args: torch.Tensor) -> torch.Tensor:
        shares, norms = args[:buckets], args[buckets:]
        with role(CLIP):
            each = _root(WAIT(issue(torch.cat(list(shares)), group_name, world)), norm_type)
            if norms:
                each = torch.cat([each, torch.stack(list(norms)).to(each.dtype)])
            total = torch.linalg.vector_norm(each, norm_type)
            return torch.clamp(torch.reciprocal(total + EPS) * max_norm, max=1.0)

    return coefficient


def insert_norms(
    graph: fx.Graph, buckets: Sequence[tuple[int, Sequence[fx.Node]]], norm_type: float, decompositions: Mapping[Any, Callable[..., Any]],
) -> list[fx.Node]:
    """Each bucket's gradient norms, right after its own nodes and its gradients, in bucket order.
    ``buckets``: (index, its gradients' nodes)."""
    norms: list[fx.Node] = []
    for index, grads in buckets:
        if not grads:
            continue
        own = [n for n in graph.nodes if n.meta.get(BUCKET_KEY) == index]
        traced = trace(gradient_norms_fn(norm_type), [g.meta["val"] for g in grads], f"the gradient norms of bucket {index}", decompositions)
        norms += splice(graph, traced, list(grads), after_all(graph, own + list(grads)), index)
    return norms


def insert_clip(
    graph: fx.Graph, buckets: Sequence[tuple[int, Sequence[fx.Node]]], max_norm: float, norm_type: float,
    decompositions: Mapping[Any, Callable[..., Any]],
) -> fx.Node:
    """:func:`insert_norms`, then the coefficient after the last norm; returns its node."""
    norms = insert_norms(graph, buckets, norm_type, decompositions)
    return splice_coefficient(graph, coefficient_fn(max_norm, norm_type), norms, buckets[-1][0], decompositions)


def splice_coefficient(
    graph: fx.Graph, fn: Callable[..., torch.Tensor], inputs: list[fx.Node], bucket: int, decompositions: Mapping[Any, Callable[..., Any]],
) -> fx.Node:
    """The clip coefficient ``fn(*inputs)`` after the last of ``inputs``: the one node tagged as it."""
    traced = trace(fn, [n.meta["val"] for n in inputs], "the clip coefficient", decompositions)
    coef = splice(graph, traced, inputs, after_all(graph, inputs), bucket)
    coef.meta[ROLE_KEY] = CLIP_COEFFICIENT
    return coef


def insert_scaled(graph: fx.Graph, coef: fx.Node, grads: Sequence[fx.Node], bucket: int, decompositions: Mapping[Any, Callable[..., Any]]) -> list[fx.Node]:
    """Returned gradients scaled by the coefficient, right after it (and after them)."""
    if not grads:
        return []
    traced = trace(scale, [coef.meta["val"], *(g.meta["val"] for g in grads)], "the clipped returned gradients", decompositions)
    return splice(graph, traced, [coef, *grads], after_all(graph, [coef, *grads]), bucket)


def clip_parts_before_step(
    optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float, group: Any, whole: Collection[int] = (),
) -> Any:
    """``sharding="full"`` without the update inside: a step pre-hook scaling the parts' gradients as
    ``clip_grad_norm_`` on the whole parameters would, by one all-reduce of this rank's share
    (module docstring: Sharded). ``whole``: the ids of parameters every rank of ``group`` holds
    whole (``replicate_below_mb``), whose share each rank counts once over the group's size.
    Returns the hook's handle."""
    inf = norm_type == math.inf
    ranks = dist.get_world_size(group)

    def clip(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        held = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in held]
        if not grads:
            return
        values = [g.detach().float() for g in grads]
        if inf:
            share = torch.stack([v.abs().max() if v.numel() else v.new_zeros(()) for v in values]).max()
        else:
            sums = [(v.square() if norm_type == 2.0 else v.abs().pow(norm_type)).sum() for v in values]
            share = torch.stack([s / ranks if id(p) in whole else s for s, p in zip(sums, held)]).sum()
        dist.all_reduce(share, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        coef = torch.clamp(max_norm / (_root(share, norm_type) + EPS), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))

    return optimizer.register_step_pre_hook(clip)
