"""Sharded buckets in the backward graph: reduce-scatter, update this rank's part, all-gather.

Runs after :func:`~graphddp.graph.insert_comm.insert_collectives`, which leaves the buckets whose
collective is ``"reduce_scatter"`` here, and places :mod:`graphddp.optim.shard_functions`' traced
functions, each parameter cut into ``world`` chunks::

    <issue_after node>
    flatten         g_i -> pad to world * c_i -> view [world, c_i]; compress; div(world_size)
    reduce_scatter  reduce_scatter_tensor(cat(dim=1).view(-1)) (gloo: all_to_all_single, rows summed)
    ... the backward ...
    # right after the next bucket's reduce-scatter is issued (GATHER_LAG), so the all-gather shares
    # the link with the rest of the backward (docs/sharding.md); the last bucket's at the output
    update          work_i = a copy of this rank's part of param_i (a clone inductor folds, or
                    graph.trace.fresh_copy where the old values are read after the update)
    wait            wait_tensor; decompress
    update          the optimizer's math on work_i, the gradient's part and the state (in place),
                    spliced per part from one trace per signature (insert_update.splice_update)
    all_gather      all_gather_into_tensor(cat(pad(work_i, c_i)))
    # gather="backward": after the next bucket's all-gather, if nothing after reads the bucket's
    # parameters (_write_point), else at the output
    wait            wait_tensor
    write           param_i.copy_(gathered[:, at_i:at_i + c_i].flat[:numel_i].view(shape_i))
    output(..., None for every gradient of the bucket, ...)

``gather="forward"``: the all-gathers are issued at the output, last bucket first (the forward reads
it first), returned un-waited; the next forward waits and writes
(:mod:`graphddp.optim.insert_gather`). They are issued here, not when that forward starts, so that
completing them never needs a collective: a ``state_dict()`` one rank alone calls can finish them.
``max_grad_norm``: see :meth:`_Splicer.clipped`.

New inputs per sharded bucket (:func:`layout`): its parameters, the state of every part this rank
owns, the hyperparameters. Each parameter is read and written through its one node, every read
before the write, as in :mod:`graphddp.optim.insert_update`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.capture import ancestors, storage_of
from graphddp.graph.anchors import IssuePoints, place_buckets
from graphddp.graph.bucket_function import gather_fn, write_fn
from graphddp.graph.insert_comm import carried_inputs
from graphddp.graph.trace import set_outputs, splice, trace
from graphddp.hooks import builtin as hooks
from graphddp.optim import clip
from graphddp.optim.insert_update import UpdateInputs, add_update_inputs, read_through, splice_update
from graphddp.optim.shard_functions import (
    ShardLayout, clipped_update_fn, layout, pack_fn, part_update_args, reduce_fn, shard_layout, state_values, update_fn,
)
from graphddp.values.collectives import SHARDED, kind
from graphddp.values.schedule import Bucket, Schedule
from graphddp.values.shards import GATHER_LAG


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One sharded bucket's traced functions, spliced by :class:`_Splicer`."""

    shard: ShardLayout
    update: fx.GraphModule  # to the shares and copies the updates write: without clipping from the gradients (:func:`update_fn`), with from the part
    pack: fx.GraphModule  # the updated copies to the all-gather (:func:`pack_fn`)
    tail: fx.GraphModule  # its wait and writes, or (gather="forward") its all-gather
    reduce: fx.GraphModule | None = None  # with clipping: the reduce-scatter to the part and its squares


def _outputs(traced: fx.GraphModule) -> Any:
    out = traced.graph.output_node().args[0]
    return tuple(n.meta["val"] for n in out) if isinstance(out, (tuple, list)) else out.meta["val"]


def _coefficient_value(reduces: list[fx.GraphModule], fake_mode: Any) -> torch.Tensor:
    """A fake clip coefficient: a scalar of the type the norms' shares add up in."""
    squares = [_outputs(r)[1] for r in reduces]
    with fake_mode:
        return torch.empty((), dtype=functools.reduce(torch.promote_types, [q.dtype for q in squares]), device=squares[0].device)


def insert_sharded_updates(gm: fx.GraphModule, schedule: Schedule, inputs: UpdateInputs, *, rank: int) -> list[ShardLayout]:
    """Splice every sharded bucket; returns their layouts in bucket order (the runtime passes each
    one's :func:`layout` inputs). A no-op without one."""
    sharded = [b for b in schedule.buckets if b.collective == SHARDED]
    if not sharded:
        return []
    from torch._inductor.decomposition import select_decomp_table

    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    placements = {p.bucket.index: p for p in place_buckets(gm, schedule, outs, only={b.index for b in sharded})}
    assert schedule.placement is not None, "with_sharding sets the placement of sharded buckets"
    shards = [shard_layout(b, inputs.rules, inputs.groups, schedule.placement, rank) for b in sharded]
    fake_mode = detect_fake_mode(tuple(inputs.values.values()))
    decompositions = select_decomp_table()
    issues = [placements[shard.bucket.index].issue for shard in shards]
    position = {n: i for i, n in enumerate(graph.nodes)}  # before any edit
    clipped = schedule.max_grad_norm is not None
    carried = carried_inputs(graph)  # the carrying variant: per bucket, its accumulated gradients

    def gradients(b: Bucket) -> list[torch.Tensor]:
        return [outs[s.output_index].meta["val"] for s in b.slots] + [c.meta["val"] for c in carried.get(b.index, ())]

    reduces = {}  # max_grad_norm: per bucket, the trace of its reduce-scatter to its part and its norms' shares
    for shard in shards if clipped else ():
        b = shard.bucket
        fn = reduce_fn(shard, hooks.for_bucket(b), schedule.grad_norm_type)
        reduces[b.index] = trace(fn, gradients(b), f"sharded bucket {b.index}'s average", decompositions)
    coef = _coefficient_value(list(reduces.values()), fake_mode) if clipped else None
    rests = {shard.bucket.index: state_values(shard, fake_mode, inputs.values) for shard in shards}  # after the parameters
    traced = []
    for at, shard in enumerate(shards):  # every bucket traced before the first edit
        b = shard.bucket
        # With clipping every update waits for the coefficient, at the end of the backward.
        point = output if clipped else _update_point(at, placements[b.index], issues, position, output)
        params = [inputs.values[n] for n in b.param_names]
        private = b.gather == "forward" or _reads_after(point, _storages(params), output)
        if clipped:
            grad_part = _outputs(reduces[b.index])[0]
            fn = clipped_update_fn(shard, private)
            update = trace(fn, [grad_part, *params, coef], f"sharded bucket {b.index}'s update", decompositions)
        else:
            fn = update_fn(shard, hooks.for_bucket(b), private, b.index in carried)
            update = trace(fn, gradients(b) + params, f"sharded bucket {b.index}", decompositions)
        work = list(_outputs(update)[len(shard.owned()):])
        pack = trace(pack_fn(shard), work, f"sharded bucket {b.index}'s all-gather", decompositions)
        result = _outputs(pack)
        # What ends the bucket in this graph: its wait and writes, or (gather="forward") its all-gather.
        if b.gather == "forward":
            tail = trace(gather_fn(shard.placement), [result], f"sharded bucket {b.index}'s all-gather")
        else:
            tail = trace(write_fn(b, shard.placement), [result, *params], f"sharded bucket {b.index}'s write")
        traced.append(_Traced(shard, update, pack, tail, reduces.get(b.index)))
    new_params = {}
    new_rest = {}
    for shard in shards:
        names = layout(shard)
        n = len(shard.bucket.slots)
        vals = [inputs.values[s] for s in shard.bucket.param_names] + rests[shard.bucket.index]
        nodes = add_update_inputs(graph, names, vals)
        new_params.update(zip(shard.bucket.param_names, nodes[:n]))
        new_rest[shard.bucket.index] = nodes[n:]
    read_through(graph, new_params, inputs)
    splicer = _Splicer(graph, traced, outs, new_params, new_rest, carried, IssuePoints(graph), placements, issues, position, decompositions)
    if clipped:
        splicer.clipped(schedule)
    else:
        splicer.overlapped()
    # gather="forward": every all-gather at the output, the last bucket's first.
    deferred = splicer.deferred
    for at in sorted(deferred, reverse=True):
        deferred[at] = splice(graph, traced[at].tail, [deferred[at]], output, traced[at].shard.bucket.index)
    set_outputs(graph, list(outs) + [deferred[at] for at in sorted(deferred)])
    graph.lint()
    gm.recompile()
    return shards


@dataclasses.dataclass
class _Splicer:
    graph: fx.Graph
    traced: list[_Traced]  # in bucket order
    outs: list[Any]  # the graph's outputs, each bucket's gradients set to None as it is spliced
    param_node: Mapping[str, fx.Node]
    rest: Mapping[int, list[fx.Node]]  # per bucket index: its state and hyperparameter inputs
    carried: Mapping[int, list[fx.Node]]  # per bucket index: its accumulated gradients (the carrying variant)
    early: IssuePoints
    placements: Mapping[int, Any]
    issues: list[fx.Node]  # per bucket, its issue point (placement)
    position: Mapping[fx.Node, int]  # each node's place in the graph before any edit
    decompositions: Mapping[Any, Any]
    deferred: dict[int, Any] = dataclasses.field(default_factory=dict)  # gather="forward": bucket position -> its updated parts

    def _taken(self, bucket: Bucket) -> tuple[list[fx.Node], list[fx.Node]]:
        """The bucket's gradients (no longer returned; then its carried ones, if any) and parameter nodes."""
        grads = [self.outs[s.output_index] for s in bucket.slots] + list(self.carried.get(bucket.index, ()))
        for s in bucket.slots:
            self.outs[s.output_index] = None
        return grads, [self.param_node[n] for n in bucket.param_names]

    def _from_issue(self, at: int, bucket: Bucket, traced: fx.GraphModule, inputs: list[fx.Node]) -> tuple[Any, fx.Node]:
        """``traced`` spliced from the bucket's issue point, all but its reduce-scatter going before
        :func:`_update_point`; returns its outputs and that point."""
        p = self.placements[bucket.index]
        wait = _update_point(at, p, self.issues, self.position, self.graph.output_node())
        return self.early.splice(traced, inputs, p.issue, _not_for_the_issue(traced), wait, bucket.index), wait

    def _updated(self, t: _Traced, outputs: list[fx.Node], point: fx.Node) -> Any:
        """The bucket's parts updated from ``outputs`` (:func:`update_fn`'s) before ``point``, one
        spliced update per part, then packed: returns the all-gather (or the parts, gather="forward")."""
        b, shard = t.shard.bucket, t.shard
        owned = len(shard.owned())
        work = list(outputs[owned:])
        for k, args in part_update_args(shard, outputs[:owned], work, self.rest[b.index]):
            what = f"the optimizer update of {b.param_names[k]!r}'s part"
            work[k] = splice_update(self.graph, shard.rules[k], args, point, b.index, what, self.decompositions)
        return splice(self.graph, t.pack, work, point, b.index)

    def overlapped(self) -> None:
        output = self.graph.output_node()
        writes = []
        late_points: list[fx.Node] = []  # per bucket: the node its wait, update and all-gather precede
        for at, t in enumerate(self.traced):
            b = t.shard.bucket
            grads, params = self._taken(b)
            outputs, wait = self._from_issue(at, b, t.update, grads + params)
            gathered = self._updated(t, outputs, wait)
            late_points.append(wait)
            if b.gather == "forward":
                self.deferred[at] = gathered
            else:
                writes.append((at, t.tail, [gathered, *params], b.index))
        for at, tail, inputs, index in writes:  # each bucket's wait and parameter writes
            splice(self.graph, tail, inputs, _write_point(late_points, at, inputs[1:], output), index)

    def clipped(self, schedule: Schedule) -> None:
        """Every update needs the global norm: each bucket's wait and its parts' norm shares go
        where its update would be; at the end one all-reduce of the shares (with the norms of the
        gradients still returned, which it scales too) gives the coefficient, then every bucket's
        update and all-gather, its wait and writes one bucket later (two all-gathers in flight)."""
        graph, output = self.graph, self.graph.output_node()
        parts, squares = [], []
        for at, t in enumerate(self.traced):
            grads, _ = self._taken(t.shard.bucket)
            (part, square), _ = self._from_issue(at, t.shard.bucket, t.reduce, grads)
            parts.append(part)
            squares.append(square)
        returned = [
            (b.index, [self.outs[s.output_index] for s in b.slots if not s.zero_filled and self.outs[s.output_index] is not None])
            for b in schedule.buckets if b.collective != SHARDED
        ]
        norms = clip.insert_norms(graph, returned, schedule.grad_norm_type, self.decompositions)
        last = self.traced[-1].shard.bucket.index
        coefficient = clip.sharded_coefficient_fn(
            schedule.max_grad_norm, schedule.grad_norm_type, len(squares), schedule.placement.shard.name, schedule.placement.shard.size
        )
        coef = clip.splice_coefficient(graph, coefficient, squares + norms, last, self.decompositions)
        for index, grads in returned:  # clip_grad_norm_ scales every gradient of the module
            scaled = clip.insert_scaled(graph, coef, grads, index, self.decompositions)
            for g, new in zip(grads, scaled):
                self.outs[self.outs.index(g)] = new
        pending = None
        for at, t in enumerate(self.traced):
            b = t.shard.bucket
            params = [self.param_node[n] for n in b.param_names]
            gathered = self._updated(t, splice(graph, t.update, [parts[at], *params, coef], output, b.index), output)
            if pending is not None:
                splice(graph, *pending)
                pending = None
            if b.gather == "forward":
                self.deferred[at] = gathered
            else:
                pending = (t.tail, [gathered, *params], output, b.index)  # its wait and writes, one bucket later
        if pending is not None:
            splice(graph, *pending)


def _update_point(at: int, placement: Any, issues: list[fx.Node], position: Mapping[fx.Node, int], output: fx.Node) -> fx.Node:
    """The node bucket ``at``'s wait, update and all-gather go before: right after the next
    bucket's issue point (GATHER_LAG); else (issued at the same node, or the last) its wait point."""
    issue = placement.issue
    later = issues[at + GATHER_LAG] if at + GATHER_LAG < len(issues) else None
    if later is not None and later.op != "placeholder" and (issue.op == "placeholder" or position[later] > position[issue]):
        return later.next
    return placement.wait if placement.wait.op != "placeholder" else output  # a bucket issued with the graph's inputs


def _storages(values: Iterable[Any]) -> set[int]:
    return {storage_of(v) for v in values} - {None}


def _reads_after(point: fx.Node, memory: set[int], output: fx.Node) -> bool:
    """Whether a node from ``point`` to the output reads any of ``memory`` (storages)."""
    node = point
    while node is not output:
        if any(storage_of(a.meta.get("val")) in memory for a in node.all_input_nodes):
            return True
        node = node.next
    return False


def _write_point(late_points: list[fx.Node], at: int, params: list[fx.Node], output: fx.Node) -> fx.Node:
    """Where bucket ``at``'s wait and writes go: right after the next bucket's all-gather (its own is
    done or nearly, and the gathered bucket is freed there rather than at the end), if nothing from
    there on reads its parameters' old values; else at the output."""
    if at + 1 >= len(late_points) or late_points[at + 1] is output:
        return output
    point = late_points[at + 1]
    return output if _reads_after(point, _storages(p.meta.get("val") for p in params), output) else point


def _not_for_the_issue(gm: fx.GraphModule) -> set[fx.Node]:
    """The traced update's nodes that go at the wait point: all but the reduce-scatter and what it
    reads, so that the copies of the parameters' parts live only from the update to the all-gather."""
    # the first: traced before the all-gather, which on gloo is an all-to-all too
    scatter = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in kind(SHARDED).ops)
    needed = ancestors(scatter)
    return {n for n in gm.graph.nodes if n.op == "call_function" and n not in needed}
