"""Which collectives a replicated bucket issues, on which group, and where (rules 1, 3, 4, 9, 11, 12)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from graphddp.graph.capture import reach
from graphddp.graph.invariants import on_group, waited_once
from graphddp.graph.verify.layout import _chain, _check_casts, _check_in_flight, _check_layout, _check_scale
from graphddp.graph.verify_common import VerificationError, _fail, _Graph
from graphddp.values.collectives import kind
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, gate_name, is_cast, is_collective, is_ours, is_wait
from graphddp.values.schedule import WAIT_AT_OUTPUT, Bucket, Schedule

aten = torch.ops.aten
# What graphddp places between a bucket's wait and the gradients it returns.
_UNFLATTEN_ROLES = {"decompress", "unflatten"}


def _collect_all_reduces(g: _Graph, schedule: Schedule, hooked: set[int]) -> dict[int, fx.Node]:
    """Bucket index -> its one graphddp all-reduce (``hooked`` buckets are checked by 12)."""
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
        waited_once(g.gm, ar, "rule 1", f"the all-reduce of bucket {index}", index)
        by_bucket[index] = ar
    missing = sorted(set(range(schedule.num_buckets)) - set(by_bucket) - hooked)
    if missing:
        raise VerificationError(f"graphddp verify: buckets {missing} have no all-reduce in the graph")
    return by_bucket


def _check_stray_waits(g: _Graph, skipped: set[int]) -> None:
    for wait in g.nodes:
        if not (is_wait(wait) and is_ours(wait)) or wait.meta[BUCKET_KEY] in skipped:
            continue
        index = wait.meta[BUCKET_KEY]
        target = wait.args[0] if wait.args else None
        if not (isinstance(target, fx.Node) and is_collective(target) and is_ours(target, index)):
            name = target.name if isinstance(target, fx.Node) else repr(target)
            _fail(g.gm, wait, f"wait {wait.name} of bucket {index} waits on {name}, which is not bucket {index}'s collective")


def _check_reduction(g: _Graph, bucket: Bucket, ar: fx.Node, schedule: Schedule) -> None:
    """A sum (the scale divides, 5), on the schedule's group (R)."""
    op = ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("reduce_op")
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


def _check_issue_order(g: _Graph, bucket: Bucket, issued: list[fx.Node]) -> None:
    """4 (and 12's): nothing ``issued`` before ``issue_after``. That a collective also follows every
    gradient it reduces needs no check of its own: the layout check makes its buffer read every
    producer, and the order check puts those reads after their definitions."""
    anchor = _issue_anchor(g, bucket, issued[0])
    for issue in issued:
        if g.before(issue, anchor):
            _fail(g.gm, issue, f"bucket {bucket.index}'s {issue.name} is issued before {anchor.name}, its issue_after")


def _reduced_region(wait: fx.Node, index: int) -> set[fx.Node]:
    """The wait and graphddp's decompress/unflatten nodes of its bucket that read it."""
    return set(reach([wait], lambda n: [u for u in n.users if is_ours(u, index) and u.meta.get(ROLE_KEY) in _UNFLATTEN_ROLES]))


def _wait_target(g: _Graph, bucket: Bucket, at: fx.Node) -> fx.Node:
    """The node named by the bucket's ``wait_before`` (``"output"``: the output node)."""
    if bucket.wait_before == WAIT_AT_OUTPUT:
        return g.output
    if bucket.wait_before not in g.by_name:
        _fail(g.gm, at, f"bucket {bucket.index}'s wait_before {bucket.wait_before!r} is not in the graph")
    return g.by_name[bucket.wait_before]


def _check_wait_placement(g: _Graph, bucket: Bucket, at: fx.Node, region: set[fx.Node], reads: Callable[[fx.Node], bool]) -> None:
    """9 (and 12's): every wait in ``region`` before ``wait_before``, and until then only nodes for
    which ``reads`` holds read what ``region`` holds (``at``: the node to show if it is missing)."""
    target = _wait_target(g, bucket, at)
    nodes = sorted(region, key=g.order.__getitem__)
    for wait in (n for n in nodes if is_wait(n)):
        if not g.before(wait, target):
            _fail(g.gm, wait, f"bucket {bucket.index}'s wait {wait.name} is not before {target.name}, its wait_before")
    for node in nodes:
        for reader in node.users:
            if not reads(reader) and g.before(reader, target):
                _fail(g.gm, reader, f"{reader.name} reads bucket {bucket.index}'s reduced values ({node.name}) before {target.name}, "
                                    "the bucket's wait_before")


def _check_bucket(g: _Graph, bucket: Bucket, ar: fx.Node, schedule: Schedule) -> None:
    _check_reduction(g, bucket, ar, schedule)
    _check_issue_order(g, bucket, [ar])
    chain, flat = _chain(ar)
    _check_scale(g, bucket, ar, chain, schedule.world_size, schedule.gated)
    _check_casts(g, bucket, [n for n in chain if is_cast(n)], ar, bucket.comm_dtype, f"before its all-reduce {ar.name}")
    _check_layout(g, bucket, ar, flat)
    _check_in_flight(g, bucket, ar)
    (wait,) = ar.users
    _check_casts(g, bucket, [u for u in wait.users if is_cast(u)], wait, bucket.dtype, f"after its wait {wait.name}")
    region = _reduced_region(wait, bucket.index)
    _check_wait_placement(g, bucket, wait, region, region.__contains__)


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
    for c in collectives:
        on_group(g.gm, c, schedule.group_name, "rule 12", f"bucket {index}'s hook", "the schedule's")
        waited_once(g.gm, c, "rule 12", f"bucket {index}'s hook", index)
    _check_issue_order(g, bucket, collectives)
    if sent != bucket.wire_nbytes:
        _fail(g.gm, collectives[0], f"bucket {index}'s collectives send {sent} bytes, the schedule records {bucket.wire_nbytes}")
    _check_layout(g, bucket, collectives[0], _hook_buffer(g, bucket, nodes))
    _check_wait_placement(g, bucket, collectives[0], g.after_waits(index), lambda r: is_ours(r, index) or r.op == "output")


def _check_order(g: _Graph) -> None:
    """Lint's def-before-use rule, but naming the node in context."""
    for node in g.nodes:
        for arg in node.all_input_nodes:
            if arg not in g.order or not g.before(arg, node):
                _fail(g.gm, node, f"{node.name} reads {arg.name}, which is not defined before it")


def _check_lint(gm: fx.GraphModule) -> None:
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError naming the node
        raise VerificationError(f"graphddp verify: graph is not lint-clean: {e}") from e
