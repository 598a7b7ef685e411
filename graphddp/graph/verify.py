"""The checker run after every rewrite: prove the communication in a graph matches its Schedule.

Every invariant is one a rewrite can get wrong in a graph FX lint still accepts (lint only
guarantees def-before-use). A failure raises :class:`VerificationError` showing the offending node
with its neighbours; every check has a mutation in ``tests/unit/test_verify_mutations.py`` (or a test
in ``test_verify.py``) that only it catches. Only collectives graphddp inserted (tagged with a
bucket) are checked; the model's own (tensor parallelism) are left alone. Nothing is mutated. This
module holds 0-2, 10 and 11; one bucket's checks (3-9, 12) are in :mod:`graphddp.graph.verify_bucket`.
In order:

0. **Schedule.** Bucket ``i`` is at position ``i``; no output is in two buckets.
1. **Accounting.** Each bucket has exactly one tagged ``all_reduce_``, waited once by a wait of its
   bucket (invariants' W); every graphddp wait waits on its own bucket's collective.
2. **Fake values.** Every inserted node has a tensor ``meta["val"]`` (later passes read it).
3. **Reduction.** ``"sum"`` on ``schedule.group_name`` (on its gate in a gated schedule).
4. **Issue order.** After ``issue_after``; after every producer follows from 7 and 11.
5. **Scale.** Exactly one ``div(.., world_size)`` before the all-reduce (DDP pre-divides; a missing
   or double division is silently wrong); none in a gated schedule, where the gate divides.
6. **Casts.** With ``comm_dtype``, one cast to it before the all-reduce and one back after the wait.
7. **Layout.** The flat buffer is the bucket's slots in order, each a flattening ``view`` (of a
   ``clone`` at most) of its ``producer`` (a zero-filled slot: of the bucket's ``zeros``; carrying:
   of ``add(producer, carried)``, each carried input read once so).
8. **No reads in flight.** Once issued, nothing but the all-reduce reads its buffer or a view of it.
9. **Wait placement.** Each wait before ``wait_before``; until then only the bucket's decompress
   and unflatten read its result.
10. **Outputs.** Every gradient in ``expected`` is ``view(slice(wait [-> cast back], 0, off, off +
    numel), shape)`` of its own bucket's wait; every slot is expected; any other output is not ours.
12. **User hooks** (checked instead of 1, 3-10): at least one collective, all on the group, after
    ``issue_after``, each waited once; the layout of 7; ``Bucket.hook_wire_nbytes`` on the wire;
    waits before ``wait_before``; every gradient a slice of one result depending on the waits.
11. **Order and lint**, last, so that a misplaced collective is reported in the schedule's terms.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.fx as fx

from graphddp.graph.invariants import waited_once
from graphddp.graph.verify_bucket import _check_bucket, _check_carried, _check_hook_bucket, _check_hook_gradient, _check_slice
from graphddp.graph.verify_common import VerificationError, _fail, _Graph, _names
from graphddp.values.collectives import kind
from graphddp.values.comm import BUCKET_KEY, CAST, is_collective, is_ours, is_wait, wire_bytes
from graphddp.values.schedule import Bucket, GradSlot, Schedule

aten = torch.ops.aten


# -- 1. accounting ------------------------------------------------------------------------------


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


# -- 2. fake values -----------------------------------------------------------------------------


def _check_fake_values(g: _Graph) -> None:
    for node in g.nodes:
        val = node.meta.get("val")
        tensors = val if isinstance(val, (tuple, list)) and val else [val]  # an op returning several (linalg_qr)
        if is_ours(node) and not all(isinstance(v, torch.Tensor) for v in tensors):
            _fail(g.gm, node, f"{node.name} (bucket {node.meta[BUCKET_KEY]}) has no tensor meta['val']")


# -- 10. outputs --------------------------------------------------------------------------------


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



# -- 11. lint -----------------------------------------------------------------------------------


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


def verify(gm: fx.GraphModule, schedule: Schedule, expected: Mapping[int, str]) -> None:
    """Check invariants 0-12. ``expected``: output index -> param name."""
    problem = schedule.structure_error()
    if problem:
        raise VerificationError(f"graphddp verify: {problem}")
    g = _Graph(gm)
    hooked = {b.index for b in schedule.buckets if b.hook}
    # Sharded buckets (reduce-scatter, update, all-gather) are the optimizer's: graphddp.optim.verify_shard.
    sharded = {b.index for b in schedule.buckets if b.collective == "reduce_scatter"}
    reduces = _collect_all_reduces(g, schedule, hooked | sharded)
    _check_stray_waits(g, sharded)
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
    _check_carried(g, sharded)
    _check_order(g)
    _check_lint(gm)
