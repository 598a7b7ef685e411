"""The checker run after every rewrite: prove the communication in a graph matches its Schedule.

Every invariant below is something a rewrite (or a later pass) can actually get wrong, most
of them in a graph that FX lint still accepts (lint only guarantees def-before-use, so a
check such as "nothing reads a bucket before its wait" proves nothing after it). Each
failure raises :class:`VerificationError` naming the offending node and showing it with its
neighbours in the graph; a schedule that does not describe the graph (0, a bucket with no
all-reduce, an output in no bucket) is named by bucket and output instead. Every check has a
mutation in ``tests/test_verify_mutations.py`` (or a test in ``tests/test_passes.py``) that
only it catches. Checks run in this order:

0. **Schedule.** The schedule is well formed: bucket ``i`` is at position ``i``, and no
   output is in two buckets (else a gradient would be reduced twice).
1. **Accounting.** Every all-reduce graphddp inserted (tagged with a bucket) is
   ``all_reduce_`` and belongs to a schedule bucket; every bucket has exactly one. Every such
   all-reduce has exactly one user, a wait of the same bucket; every graphddp wait waits on
   its own bucket's all-reduce (no stray waits).
2. **Fake values.** Every node graphddp inserted carries a tensor ``meta["val"]``, or a
   tuple of them for an op with several results (later passes and inductor read it).
3. **Reduction.** Each all-reduce uses reduce op ``"sum"`` on ``schedule.group_name``.
4. **Issue order.** Each all-reduce comes after (in graph order) its ``issue_after`` node
   (the last placeholder, when that names a placeholder). That it also comes after the
   producer of every gradient it reduces follows from 7 (its buffer reads every producer)
   and 11 (every read comes after the definition), so it is not checked twice.
5. **Scale.** Between the flat buffer and the all-reduce the bucket is scaled exactly once,
   by ``div(.., schedule.world_size)`` (DDP pre-divides; a sum of un-divided gradients, or a
   double division, is silently wrong).
6. **Compression casts are paired.** A bucket with ``comm_dtype`` is cast to it exactly once
   before the all-reduce, and its wait is cast back to the bucket dtype exactly once; a bucket
   without ``comm_dtype`` has neither cast.
7. **Layout.** The flat buffer concatenates exactly the bucket's slots, in order: piece ``i``
   is a flattening ``view`` (of a contiguous ``clone`` at most) of the node named by slot
   ``i``'s ``producer``, with ``numel`` elements; a zero-filled slot's piece flattens
   ``zeros`` made for that bucket (and no output is returned for it, 10). In a carrying
   graph (gradients accumulated under ``no_sync`` averaged with the new ones) the piece
   flattens ``add(producer, c)``, ``c`` the bucket's carried input for that slot's parameter,
   and every carried input is read once, that way.
8. **No reads of the buffer in flight.** Once the (in-place) all-reduce is issued, nothing
   but it reads its input buffer or a view of it.
9. **Wait placement.** Each wait comes before its bucket's ``wait_before`` node (``"output"``
   is the output node), and until that node nothing but graphddp's decompress and unflatten
   nodes of that bucket reads the wait's result.
10. **Outputs.** Every gradient that needs synchronisation (``expected``: output index ->
    parameter) is in a bucket and is returned as
    ``view(slice(wait [-> cast back], 0, off, off + numel), shape)`` of its own bucket's
    wait, at its own offset; every slot of the schedule is expected; an output that needs no
    synchronisation is not one of graphddp's nodes (the rewrite left it as it was).
12. **User hooks.** A bucket with ``hook`` (a user's traced hook, ``graphddp.hooks.traced``) is
    checked instead of 1 and 3-10 by what graphddp can know of any hook: it issues at least
    one collective (else its gradients would not be averaged), every one on
    ``schedule.group_name``, after ``issue_after``, each with exactly one user, a wait of
    the bucket; its flat buffer is the bucket's slots in order (7); the bytes its collectives
    send equal ``Bucket.hook_wire_nbytes``; every wait comes before ``wait_before`` and
    nothing but the bucket's own nodes reads what depends on a wait before it; every gradient
    is ``view(slice(r, 0, off, off + numel), shape)`` of one result ``r`` of the bucket that
    depends on its waits. The scale is the hook's business (DDP leaves averaging to a hook).
11. **Order and lint.** Every argument is defined before its use (so the graph is acyclic),
    and the graph is FX lint-clean. This runs last, so a misplaced collective is first
    reported in terms of the schedule.

Only collectives graphddp inserted (tagged with a bucket) are checked: collectives the model
issues itself (tensor parallelism, say) are left alone.

The checker reads the graph and the schedule; it never mutates either.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NoReturn

import torch
import torch.fx as fx

from graphddp.graph.capture import views_of
from graphddp.values.collectives import kind
from graphddp.values.comm import (
    BUCKET_KEY,
    CARRIED,
    CAST,
    ROLE_KEY,
    group_of,
    is_cast,
    is_collective,
    is_ours,
    is_wait,
    wire_bytes,
)
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, GradSlot, Schedule, dtype_name

aten = torch.ops.aten

# Ops that scale a tensor by a number: exactly one, a div by the world size, per bucket.
_SCALE_OPS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar}
# What graphddp places between a bucket's wait and the gradients it returns.
_UNFLATTEN_ROLES = {"decompress", "unflatten"}


class VerificationError(RuntimeError):
    """A rewritten graph whose communication does not match its Schedule: never run it."""


def _context(gm: fx.GraphModule, node: fx.Node, radius: int = 3) -> str:
    nodes = list(gm.graph.nodes)
    i = nodes.index(node)
    lines = []
    for j in range(max(0, i - radius), min(len(nodes), i + radius + 1)):
        n = nodes[j]
        mark = ">>" if n is node else "  "
        lines.append(f"{mark} {j:4d}: {n.format_node()}")
    return "\n".join(lines)


def _fail(gm: fx.GraphModule, node: fx.Node, message: str) -> NoReturn:
    raise VerificationError(f"graphddp verify: {message}\n{_context(gm, node)}")


def _names(nodes: Iterable[fx.Node]) -> list[str]:
    return [n.name for n in nodes]


class _Graph:
    """Read-only lookups over one graph, computed once per ``verify`` call."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        # Not graph.output_node(): that asserts the output is last, and a misplaced node after
        # it is exactly what should be reported by name.
        outputs = [n for n in self.nodes if n.op == "output"]
        if len(outputs) != 1:
            raise VerificationError(f"graphddp verify: the graph has {len(outputs)} output nodes")
        self.output = outputs[0]
        returned = self.output.args[0]
        self.outs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.last_placeholder = placeholders[-1] if placeholders else None
        self._bucket_nodes: dict[int, list[fx.Node]] = {}
        self._after_waits: dict[int, set[fx.Node]] = {}

    def before(self, a: fx.Node, b: fx.Node) -> bool:
        return self.order[a] < self.order[b]

    def bucket_nodes(self, index: int) -> list[fx.Node]:
        """graphddp's nodes of bucket ``index``, in graph order."""
        if index not in self._bucket_nodes:
            self._bucket_nodes[index] = [n for n in self.nodes if is_ours(n, index)]
        return self._bucket_nodes[index]

    def after_waits(self, index: int) -> set[fx.Node]:
        """The nodes of bucket ``index`` that depend on one of its waits (computed once)."""
        if index not in self._after_waits:
            nodes = self.bucket_nodes(index)
            mine, region = set(nodes), set()
            for node in nodes:  # graph order: a node's bucket inputs come before it
                if is_wait(node) or any(a in region for a in node.all_input_nodes if a in mine):
                    region.add(node)
            self._after_waits[index] = region
        return self._after_waits[index]

    def returned(self, index: int) -> fx.Node:
        """The node returned as output ``index`` (the output node itself when it is not a node)."""
        out = self.outs[index] if 0 <= index < len(self.outs) else None
        return out if isinstance(out, fx.Node) else self.output


# -- 1. accounting ------------------------------------------------------------------------------


def _collect_all_reduces(g: _Graph, schedule: Schedule, hooked: set[int]) -> dict[int, fx.Node]:
    """Bucket index -> its one graphddp all-reduce; each with exactly one wait of its bucket.
    Buckets in ``hooked`` run a user's hook, checked by 12 instead."""
    by_bucket: dict[int, fx.Node] = {}
    for ar in g.nodes:
        # Collectives the model itself issues (e.g. tensor parallelism) are not ours to check.
        if not (is_collective(ar) and is_ours(ar)) or ar.meta[BUCKET_KEY] in hooked:
            continue
        index = ar.meta[BUCKET_KEY]
        if not (isinstance(index, int) and 0 <= index < schedule.num_buckets):
            _fail(g.gm, ar, f"all-reduce {ar.name} is tagged bucket {index!r}, which belongs to no schedule bucket")
        if index in by_bucket:
            _fail(g.gm, ar, f"bucket {index} is all-reduced twice: {by_bucket[index].name} and {ar.name}")
        expected = kind(schedule.buckets[index].collective)
        if ar.target not in expected.ops:
            _fail(g.gm, ar, f"bucket {index}'s collective {ar.name} is {ar.target}; a bucket of kind {expected.key} is issued with "
                            f"{sorted(map(str, expected.ops))}")
        users = list(ar.users)
        if len(users) != 1 or not is_wait(users[0]):
            _fail(g.gm, ar, f"all-reduce {ar.name} of bucket {index} must have exactly one user, its wait; has {_names(users)}")
        if not is_ours(users[0], index):
            _fail(g.gm, users[0], f"wait {users[0].name} of bucket {index}'s all-reduce {ar.name} is not tagged bucket {index}")
        by_bucket[index] = ar
    missing = sorted(set(range(schedule.num_buckets)) - set(by_bucket) - hooked)
    if missing:
        raise VerificationError(f"graphddp verify: buckets {missing} have no all-reduce in the graph")
    return by_bucket


def _check_stray_waits(g: _Graph, hooked: set[int]) -> None:
    """Every graphddp wait waits on its own bucket's graphddp all-reduce."""
    for wait in g.nodes:
        if not (is_wait(wait) and is_ours(wait)) or wait.meta[BUCKET_KEY] in hooked:
            continue
        index = wait.meta[BUCKET_KEY]
        target = wait.args[0] if wait.args else None
        if not (isinstance(target, fx.Node) and is_collective(target) and is_ours(target, index)):
            name = target.name if isinstance(target, fx.Node) else repr(target)
            _fail(g.gm, wait, f"wait {wait.name} of bucket {index} waits on {name}, which is not bucket {index}'s all-reduce")


# -- 2. fake values -----------------------------------------------------------------------------


def _check_fake_values(g: _Graph) -> None:
    for node in g.nodes:
        val = node.meta.get("val")
        tensors = val if isinstance(val, (tuple, list)) and val else [val]  # an op returning several (linalg_qr)
        if is_ours(node) and not all(isinstance(v, torch.Tensor) for v in tensors):
            _fail(g.gm, node, f"{node.name} (bucket {node.meta[BUCKET_KEY]}) has no tensor meta['val']")


# -- 3-8. one bucket, from its gradients to its all-reduce ------------------------------------


def _arg(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _check_reduction(g: _Graph, bucket: Bucket, ar: fx.Node, schedule: Schedule) -> None:
    op, group = _arg(ar, 1, "reduce_op"), _arg(ar, 2, "group_name")
    if op != "sum":
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} reduces with {op!r}, expected 'sum'")
    if group != schedule.group_name:
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} runs on group {group!r}, the schedule's is {schedule.group_name!r}")


def _check_issue_order(g: _Graph, bucket: Bucket, ar: fx.Node) -> None:
    """Not issued before ``issue_after`` (the last placeholder, when that names a placeholder).

    That the all-reduce also follows every gradient it reduces needs no check of its own: the
    layout check makes its buffer read every producer, and the order check puts those reads
    after their definitions.
    """
    anchor = g.by_name.get(bucket.issue_after)
    if anchor is None:
        _fail(g.gm, ar, f"bucket {bucket.index}'s issue_after {bucket.issue_after!r} is not in the graph")
    if anchor.op == "placeholder" and g.last_placeholder is not None:
        anchor = g.last_placeholder
    if g.before(ar, anchor):
        _fail(g.gm, ar, f"bucket {bucket.index}'s all-reduce {ar.name} is issued before {anchor.name}, its issue_after")


def _chain(ar: fx.Node) -> tuple[list[fx.Node], Any]:
    """The scale and cast nodes between the flat buffer and the all-reduce, and the buffer.

    Nearest the all-reduce first. Anything else in the way ends the walk and is taken as the
    buffer, which the layout check then rejects by name.
    """
    chain: list[fx.Node] = []
    node = ar.args[0]
    while isinstance(node, fx.Node) and node not in chain and (node.target in _SCALE_OPS or is_cast(node)):
        chain.append(node)
        node = node.args[0]
    return chain, node


def _check_scale(g: _Graph, bucket: Bucket, ar: fx.Node, chain: list[fx.Node], world_size: int) -> None:
    scales = [n for n in chain if n.target in _SCALE_OPS]
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


def _check_carried(g: _Graph) -> None:
    """A carried input is read once, by its bucket's ``add`` (7 checked which slot): an unread
    one is an accumulated gradient left out of the average."""
    for node in g.gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(ROLE_KEY) != CARRIED:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].meta.get(ROLE_KEY) != "carry" or not is_ours(users[0], node.meta.get(BUCKET_KEY)):
            _fail(g.gm, node, f"carried input {node.name} ({node.meta.get(CARRIED)!r}) is read by {_names(users)}; expected once, by its bucket's add")


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


def _check_wait_placement(g: _Graph, bucket: Bucket, wait: fx.Node) -> None:
    if bucket.wait_before == WAIT_AT_OUTPUT:
        target = g.output
    elif bucket.wait_before in g.by_name:
        target = g.by_name[bucket.wait_before]
    else:
        _fail(g.gm, wait, f"bucket {bucket.index}'s wait_before {bucket.wait_before!r} is not in the graph")
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
    _check_scale(g, bucket, ar, chain, schedule.world_size)
    _check_compress(g, bucket, ar, chain)
    _check_layout(g, bucket, ar, flat)
    _check_in_flight(g, bucket, ar)
    (wait,) = ar.users
    _check_decompress(g, bucket, wait)
    _check_wait_placement(g, bucket, wait)


# -- 10. outputs --------------------------------------------------------------------------------


def _trace_back(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """Follow graphddp's nodes back from a returned value, by first argument, to a wait.

    Returns (the wait, or None, and the graphddp nodes on the way). Only graphddp's own nodes
    are followed, so the walk is a few nodes long however deep the backward is.
    """
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
    view, piece = path[0], path[1]
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


# -- 12. user hooks ----------------------------------------------------------------------------


def _wait_target(g: _Graph, bucket: Bucket, at: fx.Node) -> fx.Node:
    if bucket.wait_before == WAIT_AT_OUTPUT:
        return g.output
    if bucket.wait_before not in g.by_name:
        _fail(g.gm, at, f"bucket {bucket.index}'s wait_before {bucket.wait_before!r} is not in the graph")
    return g.by_name[bucket.wait_before]


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
    anchor = g.by_name.get(bucket.issue_after)
    if anchor is not None and anchor.op == "placeholder":
        anchor = g.last_placeholder
    for c in collectives:
        if group_of(c) != schedule.group_name:
            _fail(g.gm, c, f"bucket {index}'s {c.name} runs on group {group_of(c)!r}, the schedule's is {schedule.group_name!r}")
        users = list(c.users)
        if len(users) != 1 or not is_wait(users[0]) or not is_ours(users[0], index):
            _fail(g.gm, c, f"{c.name} of bucket {index} must have exactly one user, a wait of the bucket; has {_names(users)}")
        if anchor is None or g.before(c, anchor):
            _fail(g.gm, c, f"bucket {index}'s {c.name} is issued before {bucket.issue_after}, its issue_after")
    for wait in (n for n in nodes if is_wait(n)):
        if wait.args[0] not in collectives:
            _fail(g.gm, wait, f"wait {wait.name} of bucket {index} waits on {wait.args[0]}, not one of the bucket's collectives")
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
    want = (0, offset, offset + slot.numel)
    if tuple(piece.args[1:4]) != want or (len(piece.args) > 4 and piece.args[4] != 1):
        _fail(g.gm, piece, f"{what} is {piece.name}, the slice {tuple(piece.args[1:])} of bucket {bucket.index}, not its own slice (dim, start, end) = {want}")
    if list(view.args[1]) != list(slot.shape):
        _fail(g.gm, view, f"{what} is viewed as {list(view.args[1])} by {view.name}; its shape is {list(slot.shape)}")


# -- 11. lint -----------------------------------------------------------------------------------


def _check_order(g: _Graph) -> None:
    """Every argument is defined before its use: lint's rule, but naming the node in context."""
    for node in g.nodes:
        for arg in node.all_input_nodes:
            if arg not in g.order or not g.before(arg, node):
                _fail(g.gm, node, f"{node.name} reads {arg.name}, which is not defined before it")


def _check_lint(gm: fx.GraphModule) -> None:
    """FX lint for the rest (targets, names, the graph's own bookkeeping)."""
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError naming the node
        raise VerificationError(f"graphddp verify: graph is not lint-clean: {e}") from e


def verify(gm: fx.GraphModule, schedule: Schedule, expected: Mapping[int, str]) -> None:
    """Check invariants 0-11 (module docstring). ``expected``: output index -> param name."""
    problem = schedule.structure_error()
    if problem:
        raise VerificationError(f"graphddp verify: {problem}")
    g = _Graph(gm)
    hooked = {b.index for b in schedule.buckets if b.hook}
    # Sharded buckets (reduce-scatter, update, all-gather) are the optimizer's: graphddp.optim.verify_shard.
    sharded = {b.index for b in schedule.buckets if b.collective == "reduce_scatter"}
    reduces = _collect_all_reduces(g, schedule, hooked | sharded)
    _check_stray_waits(g, hooked | sharded)
    _check_fake_values(g)
    sent = wire_bytes(gm)
    for bucket in schedule.buckets:
        if bucket.index in sharded:
            continue
        if bucket.hook:
            _check_hook_bucket(g, bucket, schedule, sent.get(bucket.index, 0))
        else:
            _check_bucket(g, bucket, reduces[bucket.index], schedule)
    _check_outputs(g, schedule, expected, sharded)
    _check_carried(g)
    _check_order(g)
    _check_lint(gm)
