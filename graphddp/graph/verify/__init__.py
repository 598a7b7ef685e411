"""The checker run after every rewrite: prove the communication and the updates in a graph match
their plan, whatever the placement.

Every rule is one a rewrite can get wrong in a graph FX lint still accepts (lint only guarantees
def-before-use), and each has a mutation test that only it catches (``tests/unit``: grep the rule's
name). Only collectives graphddp inserted (tagged with a bucket) are checked; the model's own
(tensor parallelism) are left alone. Nothing is mutated. The rules every placement shares are
stated once in :mod:`graphddp.graph.invariants` (the letter after a rule); the modules here hold
the rest, by kind: order (who issues what, where), layout (what a buffer holds), updates (the
optimizer inside the backward), parts (the sharded collectives).

Replicated buckets, :func:`verify` (a bucket ``i`` at position ``i``, no output in two: 0):

1. **Accounting** (W). One tagged ``all_reduce_`` per bucket, waited once by a wait of its bucket;
   every graphddp wait waits on its own bucket's collective.
2. **Fake values.** Every inserted node has a tensor ``meta["val"]`` (later passes read it).
3. **Reduction** (R). ``"sum"`` on ``schedule.group_name`` (on its gate in a gated schedule).
4. **Issue order.** After ``issue_after``; after every producer follows from 7 and 11.
5. **Scale.** One ``div(.., world_size)`` before the all-reduce (DDP pre-divides); none when gated.
6. **Casts.** With ``comm_dtype``, one cast to it before the all-reduce and one back after the wait.
7. **Layout** (O). The flat buffer is the bucket's slots in order, each a flattening ``view`` (of a
   ``clone`` at most) of its ``producer`` (zero-filled: of the bucket's ``zeros``; carrying: of
   ``add(producer, carried)``, each carried input read once so).
8. **No reads in flight.** Once issued, nothing but the all-reduce reads its buffer or a view of it.
9. **Wait placement.** Each wait before ``wait_before``; until then only the bucket's decompress
   and unflatten read its result.
10. **Outputs.** Every gradient in ``expected`` is ``view(slice(wait [-> cast back], 0, off, off +
    numel), shape)`` of its own bucket's wait; every slot is expected; any other output is not ours.
12. **User hooks** (instead of 1, 3-10; W, R): at least one collective, all on the group, after
    ``issue_after``, each waited once; the layout of 7; ``Bucket.hook_wire_nbytes`` on the wire;
    waits before ``wait_before``; every gradient a slice of one result depending on the waits.
11. **Order and lint**, last, so that a misplaced collective is reported in the schedule's terms.

Their updates, :func:`verify_updates` (per parameter in ``Bucket.updates``):

U1. **Schedule.** Every updated parameter is a slot of its bucket, updated by one bucket only.
U2. **No gradient kept** (G).
U3. **One write, last** (L, by the storage of its ``update_param_k`` input).
U4. **One way in.** Its memory is read only through the written node: no aliasing input is read.
U5. **Averaged gradient** (A). At world size > 1, the slot's unflatten view has an update among its users.
U6. **Placement** (:meth:`Schedule.update_after`). After its bucket's wait and before the next
    bucket's; with ``max_grad_norm``, after the last bucket's wait.
U7. **Clipping** (C). One coefficient, after every wait, computed from every slot's reduced
    gradient; every update's write and every returned gradient computed from it.

``sharding="optimizer"``, :func:`verify_sharded` (per bucket that reduce-scatters):

S1. **One of each** (W, H). One tagged reduce-scatter and one all-gather, each waited once (with
    ``gather="forward"`` the all-gather by the next forward), no other collective but, hybrid, one
    all-reduce of the part over the replicate group whose wait the gather reads.
S2. **After its gradients.** The reduce-scatter follows and depends on every gradient of the bucket.
S3. **Averaged gradient** (A). The all-gather's input depends on the reduce-scatter's wait; gloo's
    all-to-all is read only as the sum of its ``world`` rows (one row alone is a local gradient).
S4. **No gradient kept** (G).
S5. **One write, after the gather, last** (L, A). With ``gather="forward"`` the all-gather is
    returned un-waited and the backward writes no parameter.
S6. **Clipping** (C). One coefficient, from every reduce-scatter's wait through one all-reduce
    whose reduction is the norm's (SUM, or MAX for inf) and from every returned gradient; every
    all-gather and returned gradient computed from it.
S7. **Carried gradients** (O). Read once, by an ``add`` the bucket's reduce-scatter depends on.

``sharding="full"``, :func:`check_part_collectives` on every rewritten graph (P1-P3, P5-P7) and
:func:`check_part_updates` on a backward that updates (P4):

P1. **Waited once, read after** (W, and FX's def-before-use).
P2. **Every gradient of a part reduced.** In a backward, each part's gradient output
    (input ``primals_k``, output ``k - 1``) reads the ``tangents`` through at least one
    reduce's wait (a reduce-scatter's, or a whole parameter's all-reduce) and never around one:
    else a rank trains on 1/N of the data. Given no parts, those the backward gathers again.
P3. **Once.** No reduce sends what a reduce received (divided by N twice).
P4. **Each part updated once, after its average, last** (G, L, A).
P5. **Resharded: only the backward's first bucket kept** (``reshard_after_forward=True``): the
    forward's outputs hold no more gathered bytes than :func:`graphddp.graph.reshard.tag_regathers` kept.
P6. **Hybrid** (R, H). Gathers and reduce-scatters on the shard group, each reduce-scatter's part
    all-reduced once over the replicate group, every part's gradient reading the reduce-scatters
    only through that all-reduce's wait (a parameter held whole: through its all-reduce's, P7).
P7. **Held whole, averaged over every rank** (R). A gradient's all-reduce (``replicate_below_mb``)
    runs on every rank's group, and only where parameters are held whole.
"""
from __future__ import annotations

from typing import Mapping

import torch.fx as fx

from graphddp.graph.verify.layout import _check_carried, _check_fake_values, _check_outputs
from graphddp.graph.verify.order import (
    _check_bucket, _check_hook_bucket, _check_lint, _check_order, _check_stray_waits, _collect_all_reduces,
)
from graphddp.graph.verify.parts import check_part_collectives, check_replicated
from graphddp.graph.verify.updates import check_part_updates
from graphddp.graph.verify_common import VerificationError, _Graph
from graphddp.values.collectives import SHARDED
from graphddp.values.comm import wire_bytes
from graphddp.values.schedule import Schedule

__all__ = ["VerificationError", "check_part_collectives", "check_part_updates", "check_replicated", "verify"]


def verify(gm: fx.GraphModule, schedule: Schedule, expected: Mapping[int, str]) -> None:
    """Check invariants 0-12. ``expected``: output index -> param name."""
    problem = schedule.structure_error()
    if problem:
        raise VerificationError(f"graphddp verify: {problem}")
    g = _Graph(gm)
    hooked = {b.index for b in schedule.buckets if b.hook}
    sharded = {b.index for b in schedule.buckets if b.collective == SHARDED}  # the optimizer's: verify_sharded
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
