"""Clipping by global norm inside the backward (``max_grad_norm=``): the norms and the coefficient.

Background
    ``torch.nn.utils.clip_grad_norm_`` reads ``p.grad`` after the backward; with the optimizer
    inside the backward no gradient is kept, so a loop that clips there clips nothing
    (:mod:`graphddp.optim.guards` makes that an error). ``graphddp.compile(model,
    optimizer=opt, max_grad_norm=c)`` computes instead, in the graph, what
    ``clip_grad_norm_(model.parameters(), c)`` computes on the averaged gradients, op for op:
    each gradient's L2 norm (torch's ``_foreach_norm``, one ``vector_norm`` per tensor), the
    norm of those norms (``vector_norm`` of their stack), ``clip_coef = c / (total + 1e-6)``
    (``Tensor.__rtruediv__``: a reciprocal times ``c``), clamped to 1, and every gradient
    multiplied by it before its update.

Where (:meth:`graphddp.values.schedule.Schedule.update_after` decides, this pass follows)
    The norm needs every bucket's average, so no update may run before the last wait. What can
    run earlier does: each bucket's gradient norms go right after its own wait, while later
    buckets are still on the wire; the coefficient goes after the last bucket's norms; then
    every update, each reading the coefficient. The gradients the graph still returns (of
    parameters the optimizer does not hold) are scaled too, as ``clip_grad_norm_`` scales
    every gradient of ``model.parameters()``.

Postcondition (``graphddp.optim.verify``, U7): one coefficient node, after every wait,
computed from every bucket's reduced gradients; every update and every returned parameter
gradient reads it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from graphddp.graph.trace import after_all, role, splice, trace
from graphddp.values.collectives import backend_of, kind
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, WAIT

CLIP_NORM = "clip_norm"  # role of each gradient's norm
CLIP = "clip"  # the coefficient's arithmetic, and the scaling of returned gradients
CLIP_COEFFICIENT = "clip_coefficient"  # the coefficient itself: one node per clipped graph
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def gradient_norms(*grads: torch.Tensor) -> list[torch.Tensor]:
    """Each gradient's L2 norm, as ``_get_total_norm`` computes them (before stacking)."""
    with role(CLIP_NORM):
        return [torch.linalg.vector_norm(g, 2.0) for g in grads]


def coefficient_fn(max_norm: float) -> Callable[..., torch.Tensor]:
    """The clip coefficient from every gradient's norm: ``clip_grad_norm_``'s arithmetic."""

    def coefficient(*norms: torch.Tensor) -> torch.Tensor:
        with role(CLIP):
            total = torch.linalg.vector_norm(torch.stack(list(norms)), 2.0)
            return torch.clamp(torch.reciprocal(total + EPS) * max_norm, max=1.0)

    return coefficient


def scale(coef: torch.Tensor, *grads: torch.Tensor) -> list[torch.Tensor]:
    """Returned gradients times the coefficient (``_clip_grads_with_norm_``'s ``mul_``)."""
    with role(CLIP):
        return [g * coef for g in grads]


def part_squares(grad_part: torch.Tensor, sizes: Sequence[int], chunks: Sequence[int]) -> torch.Tensor:
    """``sharding="optimizer"``: the sum of squares of each slot's part of a reduce-scattered
    bucket (``grad_part`` holds ``chunks[k]`` elements per slot, the first ``sizes[k]`` of them
    this rank's part; a slot this rank owns nothing of adds 0), in a float type at least as wide
    as float32. Summed over ranks they are each gradient's squared L2 norm."""
    with role(CLIP_NORM):
        sums, at = [], 0
        for size, c in zip(sizes, chunks):
            piece = grad_part[at:at + size]
            if piece.dtype not in (torch.float32, torch.float64):
                piece = piece.float()
            sums.append(torch.sum(piece * piece))
            at += c
        return torch.stack(sums)


def sharded_coefficient_fn(max_norm: float, buckets: int, group_name: str, world: int) -> Callable[..., torch.Tensor]:
    """``sharding="optimizer"``: the clip coefficient from every sharded bucket's part squares
    (:func:`part_squares`, one vector per bucket: summed over ranks by one all-reduce, each
    gradient's norm their square root) and the norms of the gradients the graph returns
    (all-reduced already, whole on every rank: not summed again), as ``clip_grad_norm_``
    combines per-tensor norms."""
    all_reduce = kind("all_reduce").lower(backend_of(group_name))

    def coefficient(*args: torch.Tensor) -> torch.Tensor:
        squares, norms = args[:buckets], args[buckets:]
        with role(CLIP):
            summed = WAIT(all_reduce.issue(torch.cat(list(squares)), group_name, world))
            each = torch.sqrt(summed)
            if norms:
                each = torch.cat([each, torch.stack(list(norms)).to(each.dtype)])
            total = torch.linalg.vector_norm(each, 2.0)
            return torch.clamp(torch.reciprocal(total + EPS) * max_norm, max=1.0)

    return coefficient


def insert_norms(graph: fx.Graph, buckets: Sequence[tuple[int, Sequence[fx.Node]]], decompositions: Mapping[Any, Callable[..., Any]]) -> list[fx.Node]:
    """Each bucket's gradient norms, right after its own nodes (its wait and unflatten views)
    and its gradients; returns them, in bucket order. ``buckets``: (index, its gradients' nodes)."""
    norms: list[fx.Node] = []
    for index, grads in buckets:
        if not grads:
            continue
        own = [n for n in graph.nodes if n.meta.get(BUCKET_KEY) == index]
        traced = trace(gradient_norms, [g.meta["val"] for g in grads], f"the gradient norms of bucket {index}", decompositions)
        norms += splice(graph, traced, list(grads), after_all(graph, own + list(grads)), index)
    return norms


def insert_clip(
    graph: fx.Graph, buckets: Sequence[tuple[int, Sequence[fx.Node]]], max_norm: float,
    decompositions: Mapping[Any, Callable[..., Any]],
) -> fx.Node:
    """Splice each bucket's gradient norms right after its own nodes (its wait and unflatten
    views) and its gradients, then the coefficient after the last norm; returns the
    coefficient's node. ``buckets``: (index, its gradients' nodes) in bucket order."""
    norms = insert_norms(graph, buckets, decompositions)
    last = buckets[-1][0]
    traced = trace(coefficient_fn(max_norm), [n.meta["val"] for n in norms], "the clip coefficient", decompositions)
    coef = splice(graph, traced, norms, after_all(graph, norms), last)
    coef.meta[ROLE_KEY] = CLIP_COEFFICIENT
    return coef


def insert_scaled(graph: fx.Graph, coef: fx.Node, grads: Sequence[fx.Node], bucket: int, decompositions: Mapping[Any, Callable[..., Any]]) -> list[fx.Node]:
    """Returned gradients scaled by the coefficient, right after it (and after them)."""
    if not grads:
        return []
    traced = trace(scale, [coef.meta["val"], *(g.meta["val"] for g in grads)], "the clipped returned gradients", decompositions)
    return splice(graph, traced, [coef, *grads], after_all(graph, [coef, *grads]), bucket)
