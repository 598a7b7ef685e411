"""The checker run after every rewrite: prove the communication in a graph matches its Schedule.

Every invariant below is something a rewrite (or a later pass) can actually get wrong, most
of them in a graph that FX lint still accepts (lint only guarantees def-before-use, so a
check such as "nothing reads a bucket before its wait" proves nothing after it). Each
failure raises :class:`VerificationError` naming the offending node and showing it with its
neighbours in the graph; a schedule that does not describe the graph (0, a bucket with no
all-reduce, an output in no bucket) is named by bucket and output instead. Every check has a
mutation in ``tests/unit/test_verify_mutations.py`` (or a test in ``tests/unit/test_verify.py``) that
only it catches. This module runs them all and holds 0-2, 10 and 11; one bucket's checks
(3-9, and a user hook's, 12) are in :mod:`graphddp.graph.verify_bucket`, the invariants every
mode shares in :mod:`graphddp.graph.invariants`, and the error and graph lookups every
checker shares in :mod:`graphddp.graph.verify_common`. Checks run in this order:

0. **Schedule.** The schedule is well formed: bucket ``i`` is at position ``i``, and no
   output is in two buckets (else a gradient would be reduced twice).
1. **Accounting.** Every all-reduce graphddp inserted (tagged with a bucket) is
   ``all_reduce_`` and belongs to a schedule bucket; every bucket has exactly one. Every such
   all-reduce has exactly one user, a wait of the same bucket (:mod:`graphddp.graph.invariants`' W); every graphddp wait waits on
   a collective of its own bucket (no stray waits; a hook's bucket too).
2. **Fake values.** Every node graphddp inserted carries a tensor ``meta["val"]``, or a
   tuple of them for an op with several results (later passes and inductor read it).
3. **Reduction.** Each all-reduce uses reduce op ``"sum"`` on ``schedule.group_name`` (on
   its gate, ``graphddp.runtime.gate.gate_name(group_name)``, in a gated schedule).
4. **Issue order.** Each all-reduce comes after (in graph order) its ``issue_after`` node
   (the last placeholder, when that names a placeholder). That it also comes after the
   producer of every gradient it reduces follows from 7 (its buffer reads every producer)
   and 11 (every read comes after the definition), so it is not checked twice.
5. **Scale.** Between the flat buffer and the all-reduce the bucket is scaled exactly once,
   by ``div(.., schedule.world_size)`` (DDP pre-divides; a sum of un-divided gradients, or a
   double division, is silently wrong). In a gated schedule (``Schedule.gated``) the gate
   divides when it issues the all-reduce, so the graph must not scale at all.
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
        waited_once(g.gm, ar, "rule 1", f"the all-reduce of bucket {index}", index)
        by_bucket[index] = ar
    missing = sorted(set(range(schedule.num_buckets)) - set(by_bucket) - hooked)
    if missing:
        raise VerificationError(f"graphddp verify: buckets {missing} have no all-reduce in the graph")
    return by_bucket


def _check_stray_waits(g: _Graph, skipped: set[int]) -> None:
    """Every graphddp wait waits on a collective of its own bucket (a hook's may issue several)."""
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
