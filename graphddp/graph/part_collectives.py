"""The collectives of ``sharding="full"`` in a compiled graph: bucketed, and placed for overlap.

AOTAutograd leaves each parameter's collectives where autograd met them: in the forward, the
all-gather of a part right before its first read and waited at once; in the backward, each
reduce-scatter right after its gradient and waited at once. Compiled that way nothing overlaps, and
inductor's own comm passes raise every gather to the top of the forward, each still waited at once
(docs/design-full-sharding.md). This pass rewrites them, one graph at a time, and the compiler then
keeps graphddp's order (``INDUCTOR_FX_ORDER_CONFIG``):

* **buckets.** Consecutive gathers, in the order their parameters are first read, form buckets
  of up to ``cap`` gathered bytes (a bucket closes once it reaches the cap, DDP's rule), and the
  backward's reduce-scatters, in issue order, the same way: one collective per bucket, in a
  sharded bucket's rank-major layout, so a transformer block's dozen gathers become a few. Which
  collectives share a bucket is planned before the rewrite, from the facts of the graph's
  collectives alone (:mod:`graphddp.graph.part_facts`); this pass lowers the plan.
* **placement.** Bucket ``i``'s gather is issued right before the wait of bucket ``i -
  prefetch``, so ``prefetch`` buckets travel while the compute reads the ones before them; each
  wait stays right before its first parameter's first read. A reduce-scatter bucket is issued
  where its last gradient is complete and waited right before the issue of the bucket ``lag``
  later (with the few ops that read its result), so ``lag`` travel while later gradients are
  computed and each full-size gradient dies after its send.
* **per backend** every collective is issued and waited through the parts' placement, as its kind
  lowers it: on gloo all-to-alls, where prefetching's gathers in flight would corrupt the heap; the
  cost is the parts repeated, a bucket's gathered size.
* **hybrid** (a 2-D ``device_mesh=``) each part's gradient comes out of the frontend's gather
  reduce-scattered over the shard group and then all-reduced over the replicate group; a bucket
  does the same once for all its parts (:meth:`Placement.finish_reduce`, roles ``"replicate"`` and
  ``"replicate_wait"``).

Every node added carries ``ROLE_KEY`` (``"gather"``, ``"gather_wait"``, ``"reduce_scatter"``,
``"reduce_scatter_wait"``) and ``BUCKET_KEY``; :mod:`graphddp.graph.verify` checks the result.
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch
import torch.fx as fx

from graphddp.graph.bucket_function import columns_of, rank_major, row_parts
from graphddp.graph.capture import ancestors, reach
from graphddp.graph.part_facts import Pair, part_facts, part_gathers, part_input, reduces, wait_of
from graphddp.graph.anchors import IssuePoints
from graphddp.graph.trace import role, role_of, splice, trace
from graphddp.plan.parts import PREFETCH, SCATTER_LAG, plan_part_buckets
from graphddp.values.collectives import ALL_GATHER_OP, REDUCE_SCATTER_OP
from graphddp.values.comm import CAST, ROLE_KEY, is_wait
from graphddp.values.part_schedule import ALL_REDUCE, GATHER, REDUCE_SCATTER, REDUCE_WAITS, REDUCES, WAIT_OF, PartBucket, PartCap, PartGraph
from graphddp.values.placement import Placement, Whole, flat as flat_placement


def place_part_collectives(
    graph: fx.Graph, kind: str, cap: PartCap, prefetch: int = PREFETCH, lag: int = SCATTER_LAG, placement: Placement | None = None,
    replicated: Whole | None = None,
) -> PartGraph:
    """Bucket and place every gather of a part and every reduce of a gradient: the graph's
    collectives each waited once, their facts read, the buckets planned from them alone, and that
    plan lowered. ``placement``: the parts'; ``replicated``: the parameters' held whole, whose
    gradients' all-reduces are bucketed too. Returns the plan, a ``kind`` graph's."""
    _one_wait_per_gather(graph)
    _one_wait_each(graph)
    plan = plan_part_buckets(kind, *part_facts(graph, placement, replicated), cap)
    lower_part_plan(graph, plan, prefetch, lag, placement, replicated)
    return plan


def lower_part_plan(
    graph: fx.Graph, plan: PartGraph, prefetch: int = PREFETCH, lag: int = SCATTER_LAG, placement: Placement | None = None,
    replicated: Whole | None = None,
) -> None:
    """``plan``'s buckets made in ``graph``, the graph its facts were read from: each bucket's
    collectives replaced by one, then placed. Both lists of collectives are taken before either
    is rewritten, in the order the facts list them."""
    gathers, found = part_gathers(graph), reduces(graph, placement, replicated)
    _bucket_gathers(graph, _members(gathers, plan.of(GATHER)), prefetch)
    _bucket_reduces(graph, _members(found, plan.of(*REDUCES)), [b.kind for b in plan.of(*REDUCES)], lag, placement, replicated)


def _members(pairs: list[Pair], buckets: tuple[PartBucket, ...]) -> list[list[Pair]]:
    """Each planned bucket's (issue, end) pairs; the plan must cover the pairs exactly, each once."""
    members = sorted(i for b in buckets for i in b.members)
    if members != list(range(len(pairs))):
        raise RuntimeError(f"graphddp: a plan of {len(members)} collective(s) lowered on a graph of {len(pairs)}: not the graph it was planned from")
    return [[pairs[i] for i in b.members] for b in buckets]


# -- what the graph has ------------------------------------------------------------------------


def above_reduces(node: fx.Node, also: Collection[str] = ()) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walking from ``node`` towards the graph's inputs, stopping at the waits of reduces
    (reduce-scatters and all-reduces, and waits of the roles in ``also``): the waits it meets, in
    the order met, and the inputs it reaches without passing one (what a gradient is made of:
    averaged parts or parameters, or something local)."""
    stops = {*REDUCE_WAITS, *also}

    def stop(n: fx.Node) -> bool:
        return is_wait(n) and n.meta.get(ROLE_KEY) in stops

    met = reach([node], lambda n: [] if stop(n) or n.op == "placeholder" else n.all_input_nodes)
    return [n for n in met if stop(n)], [n for n in met if n.op == "placeholder"]


def _one_wait_per_gather(graph: fx.Graph) -> None:
    """A gather waited twice is one gather: a forward output that is a view of a gathered
    parameter makes AOTAutograd return the gathered base beside the graph's own reads. Its
    later waits read the first's result, which comes before each of them in graph order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for issue in [n for n in graph.nodes if n.target is ALL_GATHER_OP]:
        first, *later = sorted((u for u in issue.users if is_wait(u)), key=order.__getitem__) or [None]
        for wait in later:
            wait.replace_all_uses_with(first)
            graph.erase_node(wait)


def _one_wait_each(graph: fx.Graph) -> None:
    """One reduce-scatter per wait. Two parameters whose gradients are the same tensor (the
    BatchNorm biases of a ResNet block's residual branch and its downsample, both summed from
    one gradient) get one reduce-scatter with two waits under inductor: its partitioner
    (AOTAutograd's min-cut) eliminates common subexpressions, which merges the collectives and
    keeps the waits apart. Each wait gets its own copy of the collective back, as AOTAutograd
    traced them: each gradient is one slot of a bucket."""
    for issue in [n for n in graph.nodes if n.target is REDUCE_SCATTER_OP]:
        for wait in [u for u in issue.users if is_wait(u)][1:]:
            with graph.inserting_before(wait):
                twin = graph.node_copy(issue)
            wait.replace_input_with(issue, twin)


def _chain(issue: fx.Node, end: fx.Node) -> list[fx.Node]:
    """The nodes from ``end`` back to ``issue`` through first arguments, ``end`` first: the order
    they can be erased in (a reduce-scatter, its wait, and with hybrid, the part's all-reduce and wait)."""
    out = [end]
    while out[-1] is not issue:
        out.append(out[-1].args[0])
    return out


# -- the rewrite ---------------------------------------------------------------------------------


def _gather_fn(placement: Placement, sizes: Sequence[int], dtype: torch.dtype) -> Callable[..., list[torch.Tensor]]:
    """One bucket's gather: its parts (cast to ``dtype``, a policy's ``param_dtype``) concatenated
    and gathered over the shard group, each parameter cut back out of the ``[shard size, parts]`` rows."""
    world = placement.shard.size

    def gather(*parts: torch.Tensor) -> list[torch.Tensor]:
        with role(GATHER):
            # a policy's param_dtype: cast, then sent (the prim inductor lowers: it has no _to_copy)
            parts = tuple(p if p.dtype == dtype else CAST(p, dtype) for p in parts)
            sent = placement.issue_gather(torch.cat(parts) if len(parts) > 1 else parts[0])
        with role(WAIT_OF[GATHER]):  # each parameter's gathered layout: its parts in rank order
            return [column.reshape(-1) for column in columns_of(placement.finish_gather(sent), world, sizes)]

    return gather


def _scatter_fn(placement: Placement, sizes: Sequence[int]) -> Callable[..., list[torch.Tensor]]:
    """One bucket's reduce-scatter over the shard group and, with a replicate group, one all-reduce
    of the bucket's part over it."""
    world = placement.shard.size

    def scatter(*grads: torch.Tensor) -> list[torch.Tensor]:
        with role(REDUCE_SCATTER):
            sent = placement.issue_reduce(rank_major([g.view(world, c) for g, c in zip(grads, sizes)]))
        with role(WAIT_OF[REDUCE_SCATTER]):
            return list(row_parts(placement.finish_reduce(sent, tag=role), sizes, sizes))

    return scatter


def _all_reduce_fn(placement: Whole, sizes: Sequence[int]) -> Callable[..., list[torch.Tensor]]:
    """One bucket's all-reduce of whole gradients over the placement's group, each cut back out."""

    def all_reduce(*grads: torch.Tensor) -> list[torch.Tensor]:
        with role(ALL_REDUCE):
            sent = placement.issue_reduce(torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1))
        with role(WAIT_OF[ALL_REDUCE]):
            return list(placement.finish_reduce(sent).split(list(sizes)))

    return all_reduce


def _bucket_gathers(graph: fx.Graph, buckets: list[list[tuple[fx.Node, fx.Node]]], prefetch: int) -> None:
    """Each bucket's gathers replaced by one, spliced in two parts where the module docstring places
    them. The first ``prefetch`` are issued after the graph's inputs, in bucket order: a backend runs
    them in the order they are issued (gloo's two threads take the first two), so bucket 0, which
    the compute needs first, goes out first."""
    top, waits = IssuePoints(graph), []
    for index, bucket in enumerate(buckets):
        _, world, group = bucket[0][0].args
        parts = [part_input(g) for g, _ in bucket]
        casts = [g.args[0] for g, _ in bucket if g.args[0] not in parts]
        dtype = bucket[0][0].meta["val"].dtype  # one per bucket (the plan keys on it)
        fn = _gather_fn(flat_placement(group, world), [p.meta["val"].shape[0] for p in parts], dtype)
        traced = trace(fn, [p.meta["val"] for p in parts], f"gather bucket {index}")
        late = {n for n in traced.graph.nodes if role_of(n) == WAIT_OF[GATHER]}
        if index < prefetch:
            results = top.splice(traced, parts, top.last_input, late, bucket[0][1], index)
        else:
            results = splice(graph, traced, parts, waits[index - prefetch] if prefetch else bucket[0][1], index, late=(late, bucket[0][1]))
        _replace(graph, bucket, results)
        waits.append(_gather_wait(results[0]))
        for cast in casts:  # now inside the bucket's gather
            if not cast.users:
                graph.erase_node(cast)


def _bucket_reduces(
    graph: fx.Graph, buckets: list[list[tuple[fx.Node, fx.Node]]], kinds: Sequence[str], lag: int, placement: Placement | None = None,
    replicated: Whole | None = None,
) -> None:
    """Each bucket's reduces replaced by one, spliced in two parts where the module docstring places
    them; where the bucket ``lag`` later reads its result, and for the last ``lag`` buckets, its wait
    stays right after its own issue. A hybrid reduce-scatter bucket reduces through ``placement``;
    an all-reduce bucket (``kinds``) through ``replicated``."""
    for index, (bucket, kind) in enumerate(zip(buckets, kinds)):
        grads = [r.args[0] for r, _ in bucket]
        if kind == ALL_REDUCE:
            assert replicated is not None
            fn = _all_reduce_fn(replicated, [g.meta["val"].numel() for g in grads])
        else:
            _, _, world, group = bucket[0][0].args
            hybrid = placement is not None and bucket[0][1] is not wait_of(bucket[0][0])
            fn = _scatter_fn(placement if hybrid else flat_placement(group, world), [g.meta["val"].shape[0] // world for g in grads])
        traced = trace(fn, [g.meta["val"] for g in grads], f"{kind} bucket {index}")
        later = buckets[index + lag] if index + lag < len(buckets) else []
        ends = {end for _, end in bucket}
        if later and not any(ends & ancestors(r.args[0]) for r, _ in later):
            late = ({n for n in traced.graph.nodes if role_of(n) != kind}, later[-1][0])
        else:
            late = None
        results = splice(graph, traced, grads, bucket[-1][0], index, late=late)
        _replace(graph, bucket, results)
        _after(graph, results)


def _replace(graph: fx.Graph, bucket: list[tuple[fx.Node, fx.Node]], results: list[fx.Node]) -> None:
    """Each (issue, wait) of ``bucket`` replaced by its result of the bucket spliced in."""
    for (issue, end), result in zip(bucket, results):
        end.replace_all_uses_with(result)
        for node in _chain(issue, end):
            graph.erase_node(node)


def _after(graph: fx.Graph, results: list[fx.Node]) -> None:
    """Move what reads a bucket's results, and was placed before the last of them, to right after
    it, in its order. A reduce-scatter bucket's results come after where its last gradient's was
    issued; a reader of an earlier one (a policy's cast of this rank's part back to its dtype)
    sat right after that one's wait. Everything else such a reader reads is older, so it may move."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(results, key=order.__getitem__)
    early = {n for r in results for n in _readers_before(r, last)} - set(results)
    anchor = last
    for node in sorted(early, key=order.__getitem__):
        anchor.append(node)
        anchor = node


def _gather_wait(result: fx.Node) -> fx.Node:
    """The wait of the gather bucket ``result`` was cut out of."""
    return next(n for n in ancestors(result) if is_wait(n) and n.meta.get(ROLE_KEY) == WAIT_OF[GATHER])


def _readers_before(wait: fx.Node, anchor: fx.Node) -> list[fx.Node]:
    """``wait`` and every node before ``anchor`` that reads it, transitively, in graph order."""
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    limit = order[anchor]
    found = reach([wait], lambda n: [u for u in n.users if u.op != "output" and order[u] < limit])
    return sorted(found, key=order.__getitem__)
