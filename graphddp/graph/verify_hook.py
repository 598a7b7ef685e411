"""The communication verifier's checks of a bucket that runs a user's traced hook: invariant 12.

A bucket with ``hook`` (:mod:`graphddp.hooks.traced`) is checked by what graphddp can know of
any hook, instead of invariants 1 and 3-10 (:mod:`graphddp.graph.verify` lists them all): its
collectives, their group, issue point and waits, the bytes they send, its flat buffer (the
layout check of :mod:`graphddp.graph.verify_bucket`), where its results are first read, and
how each gradient is sliced from them. Its own module: these checks make no assumption about
what the hook does, and share none of the built-in bucket's (scale, casts, one all-reduce).
Read-only, like the whole verifier.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphddp.graph.verify_bucket import _check_layout
from graphddp.graph.verify_common import _fail, _Graph, _names
from graphddp.values.comm import ROLE_KEY, group_of, is_collective, is_ours, is_wait
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, GradSlot, Schedule

aten = torch.ops.aten


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
