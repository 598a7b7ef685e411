"""The checker run after :func:`graphddp.optim.insert_update`: the optimizer update is safe.

An in-place update inside the backward can read the local gradient instead of the average, run
before the last read of the old value (a matmul's input gradient needs the old weight), or write
through an input a compiler cannot order against an aliasing one; no numerics test on one model is
sure to show it. Per bucket and per parameter in ``Bucket.updates``:

U1. **Schedule.** Every updated parameter is a slot of its bucket, updated by one bucket only.
U2. **No gradient kept** (G).
U3. **One write, last** (L, by the fake storage of its ``update_param_k`` input).
U4. **One way in.** Its memory is read only through the written node: no aliasing input is read.
U5. **Averaged gradient.** At world size > 1, the slot's unflatten view has an update among its users.
U6. **Placement** (:meth:`Schedule.update_after`). After its bucket's wait and before the next
    bucket's; with ``max_grad_norm``, after the last bucket's wait.
U7. **Clipping** (C). One coefficient, after every wait, computed from every slot's reduced gradient;
    every update's write and every returned gradient computed from it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphddp.graph.capture import ancestors, descendants
from graphddp.graph.invariants import Memory, clip_coefficient, not_returned, returned_clipped, root, written_last
from graphddp.graph.verify_common import VerificationError, _fail, _Graph
from graphddp.optim.clip import CLIP_COEFFICIENT, CLIP_NORM
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_wait
from graphddp.values.schedule import Schedule

aten = torch.ops.aten


def verify_updates(gm: fx.GraphModule, schedule: Schedule) -> None:
    """Check U1-U7."""
    g = _Graph(gm)
    nodes, storage, order, outs = g.nodes, Memory(g.nodes), g.order, g.outs
    update_params = [n for n in nodes if n.op == "placeholder" and n.name.startswith("update_param_")]
    buckets = [b for b in schedule.buckets if b.collective != "reduce_scatter"]  # sharded: verify_shard
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
