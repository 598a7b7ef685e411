"""The rules of a :class:`Schedule`'s optimizer update inside the backward: U1-U7 after
:func:`graphddp.optim.insert_update`, S1-S7 after :func:`graphddp.optim.insert_shard.insert_sharded_updates`
(the table of every placement's rules: :mod:`graphddp.graph.verify`). They live above the graph
layer because clipping's roles are the optimizer's."""
from __future__ import annotations

import torch
import torch.fx as fx

from graphddp.graph.capture import ancestors, descendants
from graphddp.graph.insert_comm import carried_inputs
from graphddp.graph.invariants import (
    Memory, carried_once, clip_coefficient, from_average, not_returned, over_replicas, returned_clipped, root, waited_once,
    written_last,
)
from graphddp.graph.part_facts import UPDATE_PARAM
from graphddp.graph.verify.updates import check_writes
from graphddp.graph.verify_common import VerificationError, _fail, _Graph
from graphddp.optim.clip import CLIP, CLIP_COEFFICIENT, CLIP_NORM, reduce_op
from graphddp.values.collectives import ALL_GATHER, ALL_TO_ALL_OP, REDUCE_SCATTER, SHARDED
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_collective, is_wait
from graphddp.values.placement import REPLICATE, flat
from graphddp.values.schedule import Schedule

aten = torch.ops.aten


def verify_updates(gm: fx.GraphModule, schedule: Schedule) -> None:
    """Check U1-U7."""
    g = _Graph(gm)
    nodes, storage, order, outs = g.nodes, Memory(g.nodes), g.order, g.outs
    update_params = [n for n in nodes if n.op == "placeholder" and n.name.startswith(UPDATE_PARAM)]
    buckets = [b for b in schedule.buckets if b.collective != SHARDED]  # sharded: verify_sharded
    names = [n for b in buckets for n in b.updates]
    if len(update_params) != len(names):
        raise VerificationError(f"graphddp verify: the schedule updates {len(names)} parameters, the graph has {len(update_params)} update_param inputs")
    waits = {n.meta[BUCKET_KEY]: n for n in nodes if is_wait(n) and n.meta.get(BUCKET_KEY) is not None}
    unflatten_views: dict[int, list[fx.Node]] = {}
    for n in nodes:
        if n.meta.get(ROLE_KEY) == "unflatten" and n.target is aten.view.default and n.meta.get(BUCKET_KEY) is not None:
            unflatten_views.setdefault(n.meta[BUCKET_KEY], []).append(n)
    clipped = _clipped(gm, schedule, buckets, waits, unflatten_views, order)  # U7's coefficient, and what it feeds
    seen: set[str] = set()
    k = 0
    for bucket in buckets:
        slots = {s.param_name: (i, s) for i, s in enumerate(bucket.slots)}
        views = unflatten_views.get(bucket.index, [])
        for name in bucket.updates:
            what = f"the update of {name!r} (bucket {bucket.index})"
            if name not in slots or name in seen:  # U1
                raise VerificationError(f"graphddp verify: {what}: not a slot of the bucket, or updated twice")
            seen.add(name)
            index, slot = slots[name]
            not_returned(gm, outs[slot.output_index], "U2", f"{what}, output {slot.output_index}")
            memory = storage(update_params[k])
            k += 1
            write = written_last(gm, storage.updates.get(memory, []) if memory is not None else [], storage, "U3", what)
            written = root(write.args[0], storage)
            for node, arg in storage.readers.get(memory, ()):  # in graph order
                if node is not write and arg.op == "placeholder" and arg is not written and node.op != "placeholder":  # U4
                    _fail(gm, node, f"{what}: {node.name} reads {arg.name}, another input backed by the parameter's memory, which the compiler cannot order against {write.name}")
            wait = waits.get(bucket.index)
            if wait is not None:
                if len(views) != len(bucket.slots) or not any(u.meta.get(ROLE_KEY) == "update" for u in views[index].users):  # U5
                    _fail(gm, write, f"{what}: the update does not read the bucket's reduced gradient")
                if order[write] < order[wait]:  # U6
                    _fail(gm, write, f"{what}: {write.name} runs before the bucket's wait {wait.name}")
            own = schedule.update_after(bucket.index) == bucket.index
            after = waits.get(schedule.update_after(bucket.index))
            if not own and after is not None and order[write] < order[after]:  # U6, with clipping
                _fail(gm, write, f"{what}: {write.name} runs before the last bucket's wait {after.name}, so before the clip norm can be known")
            following = waits.get(bucket.index + 1)
            if own and following is not None and order[write] > order[following]:  # U6
                _fail(gm, write, f"{what}: {write.name} runs after bucket {bucket.index + 1}'s wait {following.name}: the update no longer overlaps it")
            if clipped is not None and write not in clipped:  # U7
                _fail(gm, write, f"{what}: {write.name} does not read the clip coefficient: the parameter would be updated with an unclipped gradient")
    if clipped is not None:
        returned_clipped(gm, buckets, outs, clipped, "U7")


def _clipped(gm: fx.GraphModule, schedule: Schedule, buckets: list, waits: dict, unflatten_views: dict, order: dict) -> set[fx.Node] | None:
    """U7's first half; returns the nodes computed from the coefficient (None without one)."""
    if schedule.max_grad_norm is not None and not any(b.updates for b in buckets):
        return None
    coef = clip_coefficient(gm, schedule.max_grad_norm, "U7", CLIP_COEFFICIENT)
    if coef is None:
        return None
    late = [w for w in waits.values() if order[w] > order[coef]]
    if late:
        _fail(gm, coef, f"the clip coefficient {coef.name} is computed before {late[0].name}: without that bucket's average")
    inputs = ancestors(coef)
    for bucket in buckets:
        if bucket.index not in waits:  # world size 1: nothing was reduced
            continue
        views = unflatten_views.get(bucket.index, [])
        for slot, view in zip(bucket.slots, views if len(views) == len(bucket.slots) else ()):
            if not slot.zero_filled and not any(u.meta.get(ROLE_KEY) == CLIP_NORM and u in inputs for u in view.users):
                _fail(gm, view, f"the clip norm does not read the reduced gradient of {slot.param_name!r} (bucket {bucket.index})")
    return descendants([coef])


def verify_sharded(gm: fx.GraphModule, schedule: Schedule) -> None:
    """Check S1-S7."""
    g = _Graph(gm)
    memory_of, order, by_name, outs = Memory(g.nodes), g.order, g.by_name, g.outs
    rs_ops, ag_ops = REDUCE_SCATTER.ops, ALL_GATHER.ops
    placement = schedule.placement or flat(schedule.group_name, schedule.world_size)
    issued: dict[int, tuple[fx.Node, fx.Node]] = {}  # per sharded bucket: its reduce-scatter and all-gather
    carried = carried_inputs(gm.graph)  # the carrying variant's accumulated gradients, per bucket
    for bucket in (b for b in schedule.buckets if b.collective == SHARDED):
        mine = g.bucket_nodes(bucket.index)
        collectives = [n for n in mine if is_collective(n) and n.meta.get(ROLE_KEY) != CLIP]  # S6 checks the norms' all-reduce
        # by role: on gloo both are all-to-alls (graphddp.values.collectives)
        gathers = [n for n in collectives if n.target in ag_ops and n.meta.get(ROLE_KEY) == ALL_GATHER.key]
        replicas = [n for n in collectives if n.meta.get(ROLE_KEY) == REPLICATE]
        scatters = [n for n in collectives if n.target in rs_ops and n not in gathers and n not in replicas]
        where = f"sharded bucket {bucket.index}"
        hybrid = int(placement.hybrid)
        if len(scatters) != 1 or len(gathers) != 1 or len(replicas) != hybrid or len(collectives) != 2 + hybrid:
            expected = "one reduce-scatter, one all-reduce over the replicate group" if hybrid else "one reduce-scatter"
            _fail(gm, (collectives or [gm.graph.output_node()])[0],
                  f"{where}: expected {expected} and one all-gather, found {[n.name for n in collectives]} (S1)")
        scatter, gather = issued[bucket.index] = scatters[0], gathers[0]
        waited_once(gm, scatter, "S1", where)
        if bucket.gather != "forward":  # else returned un-waited (S5), the next forward waits for it
            waited_once(gm, gather, "S1", where)
        if replicas:
            replicated = over_replicas(gm, scatter, replicas, placement.replicate.name, "S1", where)
            from_average(gm, gather, [replicated], "S1", f"{where}: the all-gather", "the replicate all-reduce")
        inputs = ancestors(scatter)
        for node in carried.get(bucket.index, ()):
            carried_once(gm, node, inputs.__contains__, "S7", where, "an add its reduce-scatter reads")
        for slot in bucket.slots:
            producer = by_name.get(slot.producer)
            if producer is None or producer not in inputs or order[producer] > order[scatter]:
                _fail(gm, scatter, f"{where}: the reduce-scatter does not follow the gradient of {slot.param_name!r} (S2)")
        scatter_waits = [u for u in scatter.users if is_wait(u)]
        from_average(gm, gather, scatter_waits, "S3", f"{where}: the all-gather", "the reduce-scatter")
        if scatter.target is ALL_TO_ALL_OP:  # a reduce-scatter on gloo: its rows are summed after the wait
            _check_rows_summed(gm, where, scatter_waits, placement.shard.size)
        for slot in bucket.slots:
            not_returned(gm, outs[slot.output_index], "S4", f"{where}: {slot.param_name!r}")
        gather_waits = [u for u in gather.users if is_wait(u)]
        writes = [n for n in mine if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "write"]
        if bucket.gather == "forward":
            deferred = [b for b in schedule.buckets if b.collective == SHARDED and b.gather == "forward"]
            if gather_waits or writes or gather not in outs[len(outs) - len(deferred):]:
                _fail(gm, gather, f"{where}: gather='forward' leaves the all-gather un-waited and returned, and writes "
                                  f"no parameter in the backward (S5)")
            continue
        check_writes(gm, where, bucket.param_names, writes, gather_waits, memory_of)
    _check_clipping(gm, schedule, outs, issued)


def _check_clipping(gm: fx.GraphModule, schedule: Schedule, outs: list, issued: dict[int, tuple[fx.Node, fx.Node]]) -> None:
    """S6; ``issued``: each sharded bucket's reduce-scatter and all-gather (S1)."""
    coef = clip_coefficient(gm, schedule.max_grad_norm, "S6", CLIP_COEFFICIENT)
    if coef is None:
        return
    inputs = ancestors(coef)
    summed = [n for n in inputs if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    if len(summed) != 1:
        _fail(gm, coef, f"the clip coefficient {coef.name} reads {len(summed)} all-reduces of the parts' norms, expected 1 (S6)")
    op = reduce_op(schedule.grad_norm_type)
    if summed[0].args[1:2] != (op,):
        _fail(gm, summed[0], f"the all-reduce of the parts' L{schedule.grad_norm_type:g} norms reduces by {summed[0].args[1:2]}, "
                             f"expected {op!r} (S6)")
    reduced = ancestors(summed[0])
    later = descendants([coef])
    for index, (scatter, gather) in issued.items():
        if not any(is_wait(u) and u in reduced for u in scatter.users):
            _fail(gm, summed[0], f"sharded bucket {index}: the all-reduce of the parts' norms does not read its reduce-scatter's wait (S6)")
        if gather not in later:
            _fail(gm, gather, f"sharded bucket {index}: its parts are updated without the clip coefficient (S6)")
    replicated = [b for b in schedule.buckets if b.collective != SHARDED]
    returned_clipped(gm, replicated, outs, later, "S6")
    for bucket in replicated:
        graded = any(not s.zero_filled and isinstance(outs[s.output_index], fx.Node) for s in bucket.slots)
        if graded and not any(n.meta.get(BUCKET_KEY) == bucket.index and n.meta.get(ROLE_KEY) == CLIP_NORM for n in inputs):
            _fail(gm, coef, f"the clip coefficient {coef.name} does not read the norms of bucket {bucket.index}'s returned gradients (S6)")


def _check_rows_summed(gm: fx.GraphModule, where: str, waits: list[fx.Node], world: int) -> None:
    """S3 for gloo's all-to-all: every read of what it received is a [world, -1] view summed over dim 0."""
    for wait in waits:
        for view in wait.users:
            rows = view.target is aten.view.default and list(view.args[1])[:1] == [world]
            if not rows or not view.users or any(
                u.target is not aten.sum.dim_IntList or list(u.args[1]) != [0] for u in view.users
            ):
                _fail(gm, view, f"{where}: {view.name} reads the all-to-all's rows other than as their sum (S3)")
