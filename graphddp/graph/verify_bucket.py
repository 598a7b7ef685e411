"""The communication verifier's checks of one bucket: invariants 3-9, and 12 for a user's hook
(:mod:`graphddp.graph.verify` lists them all)."""
from __future__ import annotations

from typing import Any, Collection

import torch
import torch.fx as fx

from graphddp.graph.capture import views_of
from graphddp.graph.invariants import carried_once, on_group, waited_once
from graphddp.graph.verify_common import _fail, _Graph, _names
from graphddp.values.comm import BUCKET_KEY, CARRIED, ROLE_KEY, gate_name, is_cast, is_collective, is_ours, is_wait
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, GradSlot, Schedule, dtype_name

aten = torch.ops.aten

# Ops that scale a tensor by a number: exactly one, a div by the world size, per bucket.
_SCALE_OPS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar}
# What graphddp places between a bucket's wait and the gradients it returns.
_UNFLATTEN_ROLES = {"decompress", "unflatten"}


# -- 3-8. one bucket, from its gradients to its all-reduce ------------------------------------


def _arg(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _check_reduction(g: _Graph, bucket: Bucket, ar: fx.Node, schedule: Schedule) -> None:
    """A sum (the scale divides, 5), on the schedule's group (:mod:`graphddp.graph.invariants`' R)."""
    op = _arg(ar, 1, "reduce_op")
    if op != "sum":
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} reduces with {op!r}, expected 'sum'")
    expected = gate_name(schedule.group_name) if schedule.gated else schedule.group_name
    on_group(g.gm, ar, expected, "rule 3", f"bucket {bucket.index}'s all-reduce", "the gate's group" if schedule.gated else "the schedule's")


def _issue_anchor(g: _Graph, bucket: Bucket, at: fx.Node) -> fx.Node:
    """The node named by ``issue_after`` (the last placeholder, when that names a placeholder)."""
    anchor = g.by_name.get(bucket.issue_after)
    if anchor is None:
        _fail(g.gm, at, f"bucket {bucket.index}'s issue_after {bucket.issue_after!r} is not in the graph")
    return g.last_placeholder if anchor.op == "placeholder" and g.last_placeholder is not None else anchor


def _check_issue_order(g: _Graph, bucket: Bucket, ar: fx.Node) -> None:
    """Not issued before ``issue_after``. That the all-reduce also follows every gradient it
    reduces needs no check of its own: the layout check makes its buffer read every producer,
    and the order check puts those reads after their definitions."""
    anchor = _issue_anchor(g, bucket, ar)
    if g.before(ar, anchor):
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} is issued before {anchor.name}, its issue_after")


def _chain(ar: fx.Node) -> tuple[list[fx.Node], Any]:
    """The scale and cast nodes between the flat buffer and the all-reduce (nearest first), and the
    buffer: anything else ends the walk, for the layout check to reject. A fresh copy (a gated
    one-gradient bucket's) is looked through."""
    chain: list[fx.Node] = []
    node = ar.args[0]
    while isinstance(node, fx.Node) and node not in chain and (node.target in _SCALE_OPS or is_cast(node)):
        chain.append(node)
        node = node.args[0]
    if isinstance(node, fx.Node) and _is_fresh_copy(node):
        node = node.args[1]
    return chain, node


def _is_fresh_copy(node: fx.Node) -> bool:
    """``copy_(empty(...), x)``: :func:`graphddp.graph.trace.fresh_copy`."""
    return (
        node.target == aten.copy_.default and isinstance(node.args[0], fx.Node)
        and node.args[0].target == aten.empty.memory_format
    )


def _check_scale(g: _Graph, bucket: Bucket, ar: fx.Node, chain: list[fx.Node], world_size: int, gated: bool = False) -> None:
    scales = [n for n in chain if n.target in _SCALE_OPS]
    if gated:  # its gate divides (graphddp.runtime.gate): the graph must not
        if scales:
            _fail(g.gm, scales[0], f"bucket {bucket.index} is gated (its gate divides by world size {world_size}), but {scales[0].name} scales it before its all-reduce {ar.name} too")
        return
    if not scales:
        source = ar.args[0]
        name = source.name if isinstance(source, fx.Node) else repr(source)
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} sends {name} unscaled; expected one div by world size {world_size}")
    if len(scales) > 1:  # point at the first one applied, farthest from the all-reduce
        _fail(g.gm, scales[-1], f"bucket {bucket.index} is scaled {len(scales)} times before its all-reduce {ar.name}: {_names(scales)}")
    (scale,) = scales
    divisor = scale.args[1] if len(scale.args) > 1 else None
    if scale.target != aten.div.Tensor or isinstance(divisor, fx.Node) or divisor != world_size:
        _fail(g.gm, scale, f"bucket {bucket.index} is scaled by {scale.name} = {scale.target}(.., {divisor!r}); expected div by world size {world_size}")


def _cast_dtype(node: fx.Node) -> str:
    return dtype_name(node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype"))


def _check_compress(g: _Graph, bucket: Bucket, ar: fx.Node, chain: list[fx.Node]) -> None:
    """Exactly one cast to ``comm_dtype`` before the all-reduce, or none without a hook."""
    casts = [n for n in chain if is_cast(n)]
    if bucket.comm_dtype is None:
        if casts:
            _fail(g.gm, casts[0], f"bucket {bucket.index} has no compression hook, but {casts[0].name} casts it to {_cast_dtype(casts[0])} before its all-reduce")
        return
    if not casts:
        _fail(g.gm, ar, f"bucket {bucket.index} should travel in {bucket.comm_dtype}, but nothing casts it before its all-reduce {ar.name}")
    if len(casts) > 1:  # point at the first one applied, farthest from the all-reduce
        _fail(g.gm, casts[-1], f"bucket {bucket.index} is cast {len(casts)} times before its all-reduce {ar.name}: {_names(casts)}")
    if _cast_dtype(casts[0]) != bucket.comm_dtype:
        _fail(g.gm, casts[0], f"bucket {bucket.index} is cast to {_cast_dtype(casts[0])} by {casts[0].name}; its comm_dtype is {bucket.comm_dtype}")


def _numel(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.numel()) if isinstance(val, torch.Tensor) else None


def _check_layout(g: _Graph, bucket: Bucket, ar: fx.Node, flat: Any) -> None:
    """The flat buffer is the bucket's slots, flattened, in order (no cat for a single slot)."""
    where = flat if isinstance(flat, fx.Node) else ar
    is_cat = isinstance(flat, fx.Node) and flat.op == "call_function" and flat.target == aten.cat.default
    pieces = list(flat.args[0]) if is_cat else [flat]
    if len(pieces) != len(bucket.slots):
        what = f"concatenates {len(pieces)} pieces" if is_cat else f"is one piece ({getattr(flat, 'target', flat)})"
        _fail(g.gm, where, f"bucket {bucket.index}'s buffer {getattr(flat, 'name', flat)} {what}; the bucket has {len(bucket.slots)} gradients {list(bucket.param_names)}")
    for i, (piece, slot) in enumerate(zip(pieces, bucket.slots)):
        _check_piece(g, bucket, i, piece, slot, where)


def _check_piece(g: _Graph, bucket: Bucket, i: int, piece: Any, slot: GradSlot, where: fx.Node) -> None:
    """Piece ``i`` is ``view(producer, [numel])``, through graphddp's contiguous clone at most."""
    what = f"piece {i} of bucket {bucket.index}'s buffer"
    if not (isinstance(piece, fx.Node) and piece.target == aten.view.default and isinstance(piece.args[0], fx.Node)):
        name = piece.name if isinstance(piece, fx.Node) else repr(piece)
        _fail(g.gm, piece if isinstance(piece, fx.Node) else where, f"{what} is {name}, not a flattening view of the gradient of {slot.param_name!r}")
    source = piece.args[0]
    if source.target == aten.clone.default and is_ours(source):  # the contiguous copy of a strided gradient
        source = source.args[0]
    if source.meta.get(ROLE_KEY) == "carry" and is_ours(source, bucket.index):  # + its accumulated gradient
        source = _carried_sum(g, bucket, piece, source, slot, what)
    if slot.zero_filled:  # no gradient in this graph: zeros of the bucket's own, in its place
        if not (isinstance(source, fx.Node) and source.target == aten.zeros.default and source.meta.get(BUCKET_KEY) == bucket.index):
            name = source.name if isinstance(source, fx.Node) else repr(source)
            _fail(g.gm, piece, f"{what}, {piece.name}, flattens {name}; {slot.param_name!r} is zero-filled: expected bucket {bucket.index}'s zeros")
    elif not isinstance(source, fx.Node) or source.name != slot.producer:
        name = source.name if isinstance(source, fx.Node) else repr(source)
        _fail(g.gm, piece, f"{what}, {piece.name}, flattens {name}; expected {slot.producer}, the gradient of {slot.param_name!r}")
    size = piece.args[1] if len(piece.args) > 1 else None
    size = list(size) if isinstance(size, (list, tuple)) else [size]
    if size not in ([slot.numel], [-1]) or _numel(source) != slot.numel:
        _fail(g.gm, piece, f"{what}, {piece.name}, is {size} of {_numel(source)} elements; {slot.param_name!r} has {slot.numel}")


def _check_slice(g: _Graph, what: str, bucket: Bucket, slot: GradSlot, offset: int, view: fx.Node, piece: fx.Node) -> None:
    """A returned gradient is ``view(piece, shape)``, ``piece`` its slot's own slice of the
    bucket (10 and 12): another offset hands a parameter its neighbour's gradient."""
    want = (0, offset, offset + slot.numel)
    if tuple(piece.args[1:4]) != want or (len(piece.args) > 4 and piece.args[4] != 1):
        _fail(g.gm, piece, f"{what} is {piece.name}, the slice {tuple(piece.args[1:])} of bucket {bucket.index}, not its own slice (dim, start, end) = {want}")
    if list(view.args[1]) != list(slot.shape):
        _fail(g.gm, view, f"{what} is viewed as {list(view.args[1])} by {view.name}; its shape is {list(slot.shape)}")


def _carried_sum(g: _Graph, bucket: Bucket, piece: fx.Node, add: fx.Node, slot: GradSlot, what: str) -> Any:
    """A carrying bucket's piece flattens ``add(producer, c)``, ``c`` the bucket's carried input
    of the piece's slot; returns the gradient added to (checked as any piece's by the caller)."""
    args = list(add.args)
    carried = [a for a in args if isinstance(a, fx.Node) and a.op == "placeholder" and a.meta.get(ROLE_KEY) == CARRIED]
    if add.target != aten.add.Tensor or len(args) != 2 or len(carried) != 1:
        _fail(g.gm, piece, f"{what}, {piece.name}, flattens {add.name} = {add.target}{tuple(getattr(a, 'name', a) for a in args)}; "
                           "expected the gradient plus one carried input")
    if carried[0].meta.get(BUCKET_KEY) != bucket.index or carried[0].meta.get(CARRIED) != slot.param_name:
        _fail(g.gm, piece, f"{what}, {piece.name}, adds {carried[0].name}, carried for {carried[0].meta.get(CARRIED)!r} of bucket "
                           f"{carried[0].meta.get(BUCKET_KEY)}; expected the accumulated gradient of {slot.param_name!r}")
    return next(a for a in args if a is not carried[0])


def _check_carried(g: _Graph, sharded: Collection[int] = ()) -> None:
    """Each carried input is read once, by its bucket's ``add`` (:mod:`graphddp.graph.invariants`'
    O; 7 checked which slot). Not those of ``sharded`` buckets, which the optimizer's pass reads
    (``graphddp.optim.verify_shard``, S7)."""
    for node in g.gm.graph.nodes:
        index = node.meta.get(BUCKET_KEY)
        if node.op == "placeholder" and node.meta.get(ROLE_KEY) == CARRIED and index not in sharded:
            carried_once(g.gm, node, lambda add: is_ours(add, index), "rule 7", f"bucket {index}, {node.meta.get(CARRIED)!r}", "its bucket's add")


def _check_in_flight(g: _Graph, bucket: Bucket, ar: fx.Node) -> None:
    """The all-reduce is in place: its input must not be read after it is issued."""
    buffer = ar.args[0]
    if not isinstance(buffer, fx.Node):
        return
    for alias in views_of(buffer):
        for reader in alias.users:
            if reader is not ar and g.before(ar, reader):
                _fail(g.gm, reader, f"{reader.name} reads bucket {bucket.index}'s buffer {buffer.name} after its all-reduce {ar.name} was issued")


# -- 6, 9. one bucket, from its wait to its readers -------------------------------------------


def _check_decompress(g: _Graph, bucket: Bucket, wait: fx.Node) -> None:
    """Exactly one cast back to the bucket dtype after the wait, or none without a hook."""
    casts = [u for u in wait.users if is_cast(u)]
    if bucket.comm_dtype is None:
        if casts:
            _fail(g.gm, casts[0], f"bucket {bucket.index} has no compression hook, but {casts[0].name} casts its wait {wait.name} to {_cast_dtype(casts[0])}")
        return
    if len(casts) != 1:
        _fail(g.gm, wait, f"bucket {bucket.index} travels in {bucket.comm_dtype}: its wait {wait.name} needs exactly one cast back to {bucket.dtype}, has {_names(casts)}")
    if _cast_dtype(casts[0]) != bucket.dtype:
        _fail(g.gm, casts[0], f"bucket {bucket.index}'s wait is cast back to {_cast_dtype(casts[0])} by {casts[0].name}; the bucket is {bucket.dtype}")


def _reduced_region(wait: fx.Node, index: int) -> set[fx.Node]:
    """The wait and graphddp's decompress/unflatten nodes of its bucket that read it."""
    region, todo = set(), [wait]
    while todo:
        n = todo.pop()
        if n in region:
            continue
        region.add(n)
        todo.extend(u for u in n.users if is_ours(u, index) and u.meta.get(ROLE_KEY) in _UNFLATTEN_ROLES)
    return region


def _wait_target(g: _Graph, bucket: Bucket, at: fx.Node) -> fx.Node:
    """The node named by the bucket's ``wait_before`` (``"output"``: the output node)."""
    if bucket.wait_before == WAIT_AT_OUTPUT:
        return g.output
    if bucket.wait_before not in g.by_name:
        _fail(g.gm, at, f"bucket {bucket.index}'s wait_before {bucket.wait_before!r} is not in the graph")
    return g.by_name[bucket.wait_before]


def _check_wait_placement(g: _Graph, bucket: Bucket, wait: fx.Node) -> None:
    target = _wait_target(g, bucket, wait)
    if not g.before(wait, target):
        _fail(g.gm, wait, f"bucket {bucket.index}'s wait {wait.name} is not before {target.name}, its wait_before")
    region = _reduced_region(wait, bucket.index)
    for node in sorted(region, key=g.order.__getitem__):
        for reader in node.users:
            if reader not in region and g.before(reader, target):
                _fail(g.gm, reader, f"{reader.name} reads bucket {bucket.index}'s reduced buffer ({node.name}) before {target.name}, the bucket's wait_before")


def _check_bucket(g: _Graph, bucket: Bucket, ar: fx.Node, schedule: Schedule) -> None:
    _check_reduction(g, bucket, ar, schedule)
    _check_issue_order(g, bucket, ar)
    chain, flat = _chain(ar)
    _check_scale(g, bucket, ar, chain, schedule.world_size, schedule.gated)
    _check_compress(g, bucket, ar, chain)
    _check_layout(g, bucket, ar, flat)
    _check_in_flight(g, bucket, ar)
    (wait,) = ar.users
    _check_decompress(g, bucket, wait)
    _check_wait_placement(g, bucket, wait)


# -- 12. a bucket that runs a user's hook ------------------------------------------------------


def _hook_buffer(g: _Graph, bucket: Bucket, nodes: list[fx.Node]) -> Any:
    """The flat buffer handed to the hook: the last flatten node (through graphddp's copy of a
    one-gradient bucket, so the hook may write it)."""
    flats = [n for n in nodes if n.meta.get(ROLE_KEY) == "flatten"]
    top = [n for n in flats if not any(u in flats for u in n.users)]
    if len(top) != 1:
        _fail(g.gm, (top or nodes)[0], f"bucket {bucket.index}'s hook {bucket.hook!r} reads {len(top)} flat buffers, expected one")
    flat = top[0]
    if flat.target == aten.copy_.default and len(bucket.slots) == 1:  # graph.trace.fresh_copy
        flat = flat.args[1]
    return flat


def _check_hook_bucket(g: _Graph, bucket: Bucket, schedule: Schedule, sent: int) -> None:
    index, hook = bucket.index, bucket.hook
    nodes = g.bucket_nodes(index)
    collectives = [n for n in nodes if is_collective(n)]
    if not collectives:
        _fail(g.gm, nodes[-1] if nodes else g.output, f"bucket {index}'s hook {hook!r} issues no collective: its gradients would not be averaged")
    anchor = _issue_anchor(g, bucket, collectives[0])
    for c in collectives:
        on_group(g.gm, c, schedule.group_name, "rule 12", f"bucket {index}'s hook", "the schedule's")
        waited_once(g.gm, c, "rule 12", f"bucket {index}'s hook", index)
        if g.before(c, anchor):
            _fail(g.gm, c, f"bucket {index}'s {c.name} is issued before {bucket.issue_after}, its issue_after")
    if sent != bucket.wire_nbytes:
        _fail(g.gm, collectives[0], f"bucket {index}'s collectives send {sent} bytes, the schedule records {bucket.wire_nbytes}")
    _check_layout(g, bucket, collectives[0], _hook_buffer(g, bucket, nodes))
    target = _wait_target(g, bucket, collectives[0])
    region = g.after_waits(index)
    for node in sorted(region, key=g.order.__getitem__):
        if is_wait(node) and not g.before(node, target):
            _fail(g.gm, node, f"bucket {index}'s wait {node.name} is not before {target.name}, its wait_before")
        for reader in node.users:
            if not is_ours(reader, index) and reader.op != "output" and g.before(reader, target):
                _fail(g.gm, reader, f"{reader.name} reads bucket {index}'s reduced values ({node.name}) before {target.name}, the bucket's wait_before")


def _check_hook_gradient(g: _Graph, index: int, name: str, bucket: Bucket, slot: GradSlot, offset: int) -> None:
    """Output ``index`` is ``view(slice(r, 0, off, off+n), shape)`` of the bucket's hook result."""
    returned = g.returned(index)
    what = f"gradient of {name!r} (output {index})"
    view = returned
    piece = view.args[0] if view.target == aten.view.default and view.args else None
    result = piece.args[0] if isinstance(piece, fx.Node) and piece.target == aten.slice.Tensor else None
    if not (is_ours(view, bucket.index) and isinstance(result, fx.Node) and is_ours(piece, bucket.index)):
        _fail(g.gm, returned, f"{what} is {returned.name}, not view(slice(..)) of bucket {bucket.index}'s hook result")
    if not is_ours(result, bucket.index) or result not in g.after_waits(bucket.index):
        _fail(g.gm, result, f"{what} is sliced from {result.name}, which does not depend on a wait of bucket {bucket.index}: it is not averaged")
    _check_slice(g, what, bucket, slot, offset, view, piece)
