"""What a bucket's buffer holds on its way in and out (rules 2, 5-8, 10 and 12's slices): the slots
flattened in order, scaled once, cast once each way, left alone while on the wire, and every
gradient returned as its own slice."""
from __future__ import annotations

from typing import Any, Collection, Mapping

import torch
import torch.fx as fx

from graphddp.graph.capture import views_of
from graphddp.graph.invariants import carried_once
from graphddp.graph.verify_common import _fail, _Graph, _names
from graphddp.values.comm import BUCKET_KEY, CARRIED, CAST, ROLE_KEY, is_cast, is_ours, is_wait
from graphddp.values.schedule import Bucket, GradSlot, Schedule, dtype_name

aten = torch.ops.aten
# Ops that scale a tensor by a number: exactly one, a div by the world size, per bucket.
_SCALE_OPS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar}


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


def _check_casts(g: _Graph, bucket: Bucket, casts: list[fx.Node], at: fx.Node, dtype: str | None, way: str) -> None:
    """6, one ``way`` (before the all-reduce ``at``, after its wait ``at``): with a compression hook
    exactly one of ``casts``, to ``dtype``; none without. Of several, the last is shown (before the
    all-reduce: the first applied)."""
    if bucket.comm_dtype is None:
        if casts:
            _fail(g.gm, casts[0], f"bucket {bucket.index} has no compression hook, but {casts[0].name} casts it to "
                                  f"{_cast_dtype(casts[0])} {way}")
        return
    if len(casts) != 1:
        _fail(g.gm, casts[-1] if casts else at, f"bucket {bucket.index} travels in {bucket.comm_dtype}: {way} it needs exactly one cast "
                                                f"to {dtype}, has {_names(casts)}")
    if _cast_dtype(casts[0]) != dtype:
        _fail(g.gm, casts[0], f"bucket {bucket.index} is cast to {_cast_dtype(casts[0])} by {casts[0].name} {way}; expected {dtype}")


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
    """O: each carried input is read once, by its bucket's ``add`` (7 checked which slot); not those
    of ``sharded`` buckets, which the optimizer's pass reads (S7)."""
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


def _check_fake_values(g: _Graph) -> None:
    for node in g.nodes:
        val = node.meta.get("val")
        tensors = val if isinstance(val, (tuple, list)) and val else [val]  # an op returning several (linalg_qr)
        if is_ours(node) and not all(isinstance(v, torch.Tensor) for v in tensors):
            _fail(g.gm, node, f"{node.name} (bucket {node.meta[BUCKET_KEY]}) has no tensor meta['val']")


def _trace_back(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """(The wait, or None, and graphddp's nodes on the way) from a returned value back by first
    argument; only graphddp's nodes are followed, so the walk is short however deep the graph."""
    path: list[fx.Node] = []
    while isinstance(node, fx.Node) and is_ours(node) and node not in path:
        if is_wait(node):
            return node, path
        path.append(node)
        node = node.args[0] if node.args else None
    return None, path


def _check_gradient(g: _Graph, index: int, name: str, bucket: Bucket, slot: GradSlot, offset: int) -> None:
    """Output ``index`` is ``view(slice(wait [-> cast], 0, off, off+n), shape)`` of its bucket."""
    returned = g.returned(index)
    what = f"gradient of {name!r} (output {index})"
    wait, path = _trace_back(returned)
    if wait is None:  # not graphddp's at all, or graphddp's nodes that lead to no wait
        how = f": graphddp's nodes {_names(path)} lead to no bucket's wait" if path else ""
        _fail(g.gm, returned, f"{what} is returned unreduced, as {returned.name}{how}")
    if wait.meta[BUCKET_KEY] != bucket.index:
        _fail(g.gm, wait, f"{what} comes from bucket {wait.meta[BUCKET_KEY]}'s wait {wait.name}, planned bucket {bucket.index}")
    shape = [aten.view.default, aten.slice.Tensor] + ([CAST] if bucket.comm_dtype else [])
    if [n.target for n in path] != shape:
        _fail(g.gm, returned, f"{what} reaches bucket {bucket.index}'s wait {wait.name} through {_names(path)}, not view(slice({'cast(' if bucket.comm_dtype else ''}wait))")
    _check_slice(g, what, bucket, slot, offset, view=path[0], piece=path[1])


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


def _check_slice(g: _Graph, what: str, bucket: Bucket, slot: GradSlot, offset: int, view: fx.Node, piece: fx.Node) -> None:
    """A returned gradient is ``view(piece, shape)``, ``piece`` its slot's own slice of the
    bucket (10 and 12): another offset hands a parameter its neighbour's gradient."""
    want = (0, offset, offset + slot.numel)
    if tuple(piece.args[1:4]) != want or (len(piece.args) > 4 and piece.args[4] != 1):
        _fail(g.gm, piece, f"{what} is {piece.name}, the slice {tuple(piece.args[1:])} of bucket {bucket.index}, not its own slice (dim, start, end) = {want}")
    if list(view.args[1]) != list(slot.shape):
        _fail(g.gm, view, f"{what} is viewed as {list(view.args[1])} by {view.name}; its shape is {list(slot.shape)}")


def _check_outputs(g: _Graph, schedule: Schedule, expected: Mapping[int, str], sharded: set[int] = frozenset()) -> None:
    left = {s.output_index for b in schedule.buckets if b.index in sharded for s in b.slots}
    expected = {i: n for i, n in expected.items() if i not in left}
    planned = {
        s.output_index: (b, s, off) for b in schedule.buckets if b.index not in sharded
        for s, off in zip(b.slots, b.offsets()) if not s.zero_filled
    }
    for index, name in sorted(expected.items()):
        if index not in planned:
            _fail(g.gm, g.returned(index), f"gradient of {name!r} (output {index}) is in no bucket")
        check = _check_hook_gradient if planned[index][0].hook else _check_gradient
        check(g, index, name, *planned[index])
    extra = sorted(set(planned) - set(expected))
    if extra:
        _fail(g.gm, g.returned(extra[0]), f"outputs {extra} are reduced but need no synchronisation")
    for index in range(len(g.outs)):
        returned = g.returned(index)
        if index not in planned and is_ours(returned):  # the rewrite replaced what it should not have
            _fail(g.gm, returned, f"output {index} needs no synchronisation, but is {returned.name}, graphddp's node for bucket {returned.meta[BUCKET_KEY]}")
