"""The checker run after :func:`graphddp.graph.part_collectives.place_part_collectives` on every
graph of ``sharding="full"``.

The rewrite replaces AOTAutograd's own collectives by buckets and moves them; what it could get
wrong, and a numerics test on one model might not show:

P1. **Waited once, read after** (:mod:`graphddp.graph.invariants`' W). Every collective is
    read by exactly one wait, and nothing reads its result but through that wait; FX's lint (every node after what it reads) then
    makes "no parameter read before its gather's wait" and "no gradient part read before its
    reduce-scatter's wait" hold.
P2. **Every gradient of a part reduce-scattered.** In a backward (a part is the forward's
    input ``primals_k``, its gradient the backward's output ``k - 1``; the compiler names the
    graph's parts), the gradient of each part reaches the output through
    reduce-scatters only: the output depends on the backward's incoming gradients (its
    ``tangents``) through at least one reduce-scatter's wait and never around one. A rank that
    returned its local gradient for a part would train on 1/N of the data.
P3. **Once.** No reduce-scatter sends what a reduce-scatter received: a gradient averaged twice
    is divided by N twice.
P4. **Each part updated once, after its average, last** (the optimizer inside the backward,
    :mod:`graphddp.optim.insert_part_update`). For every part the variant updates: its gradient
    output is None (:mod:`graphddp.graph.invariants`' G); exactly one graphddp update ``copy_``
    writes it (through its input ``primals_k`` or its ``update_param`` input); that write reads
    a reduce-scatter's wait (the averaged gradient, not this rank's own: A); and no node after
    the write reads the part (L).
P5. **Resharded: only the backward's first bucket kept** (``reshard_after_forward=True``). The
    forward's outputs (what AOTAutograd saves for the backward is among them) hold no more
    gathered bytes than the parts :func:`graphddp.graph.reshard.tag_regathers` kept (the
    parameters the backward reads first, one bucket's cap of them): every other gathered
    buffer's last reader is in the forward, so it is freed there, and the backward gathers
    again what it reads.

P6. **Hybrid: each part averaged over its replicate group too** (a 2-D ``device_mesh=``, the
    parts' :class:`~graphddp.values.placement.Placement` given). Every gather and
    reduce-scatter runs on the shard group (:mod:`graphddp.graph.invariants`' R); each
    reduce-scatter bucket's part is all-reduced once, over the replicate group (H); and every
    part's gradient (P2's) reads the reduce-scatters only through a replicate all-reduce's wait.

(Given no parts, P2 checks those the backward gathers again: a backward that keeps the
forward's gathered parameters has no part among its inputs, so there it has nothing to map.
P1 and P3 hold for every graph.)
Failures raise :class:`graphddp.graph.verify_common.VerificationError` showing the node in context.
"""
from __future__ import annotations

import re
from typing import Collection, Mapping

import torch
import torch.fx as fx

from graphddp.graph.capture import ancestors
from graphddp.graph.invariants import Memory, from_average, not_returned, on_group, over_replicas, waited_once, written_last
from graphddp.graph.part_collectives import above_reduce_scatters
from graphddp.graph.reshard import kept_gathered, kept_gathered_bytes
from graphddp.graph.verify_common import VerificationError, _fail
from graphddp.values.comm import ROLE_KEY, is_collective, is_wait
from graphddp.values.placement import REPLICATE_WAIT, Placement

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_PRIMAL = re.compile(r"primals_(\d+)$")


def check_part_collectives(
    gm: fx.GraphModule, backward: bool, reshard: bool = False, kept_bytes: int = 0, parts: Collection[str] | None = None,
    placement: Placement | None = None,
) -> None:
    """P1-P3 (module docstring) on one rewritten graph; P2 on a ``backward`` one (for ``parts``,
    the forward inputs' names of the graph's parts, or where not given, those the backward
    gathers), P5 on a forward that ``reshard``s and keeps at most ``kept_bytes`` gathered, P6
    with a hybrid ``placement``."""
    gm.graph.lint()
    for issue in gm.graph.nodes:
        if is_collective(issue):
            waited_once(gm, issue, "P1", f"{issue.target}")
    scatters = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == "reduce_scatter"]
    for issue in scatters:
        again = [a for a in ancestors(issue.args[0]) if is_wait(a) and a.meta.get(ROLE_KEY) == "reduce_scatter_wait"]
        if again:
            _fail(gm, issue, f"P3: {issue.name} reduce-scatters what {again[0].name} received: a gradient averaged twice")
    if placement is not None and placement.hybrid:
        check_replicated(gm, placement, _part_gradients(gm, parts) if backward else [])
    if backward:
        _check_part_gradients(gm, parts)
    elif reshard:
        _check_kept_gathers(gm, kept_bytes)


def _check_kept_gathers(gm: fx.GraphModule, allowed: int) -> None:
    """P5: the forward's outputs hold at most ``allowed`` gathered bytes."""
    held = kept_gathered_bytes(gm)
    if held > allowed:
        out = next(iter(kept_gathered(gm).values()))
        _fail(gm, out, f"P5: the outputs of a forward that reshards hold {held} gathered bytes (e.g. {out.name}), "
                       f"more than the {allowed} of the parts the backward reads first: kept for the backward instead of freed")


def _check_part_gradients(gm: fx.GraphModule, parts: Collection[str] | None) -> None:
    """P2: each part's gradient output reads the tangents through reduce-scatter waits only;
    ``parts`` by their forward inputs' names (``primals_k``), or where not given, the inputs the
    backward gathers."""
    for name, index, grad in _part_gradients(gm, parts):
        through, inputs = above_reduce_scatters(grad)  # stopping at reduce-scatter waits
        around = next((n for n in inputs if n.name.startswith("tangents")), None)
        if around or not through:
            why = f"around a reduce-scatter (via {around.name})" if around else "without a reduce-scatter"
            _fail(gm, grad, f"P2: the gradient of part {name} (output {index}) reads the incoming gradients {why}")


def _part_gradients(gm: fx.GraphModule, parts: Collection[str] | None) -> list[tuple[str, int, fx.Node]]:
    """(part's input name, output index, gradient node) of each part the backward returns a
    gradient for; ``parts`` as :func:`_check_part_gradients` takes them."""
    outs = gm.graph.output_node().args[0]
    if not isinstance(outs, (tuple, list)):
        return []
    if parts is None:
        parts = [n.name for n in gm.graph.nodes if n.op == "placeholder" and any(u.meta.get(ROLE_KEY) == "gather" for u in n.users)]
    found = []
    for name in parts:
        match = _PRIMAL.match(name)
        if match is None:
            continue
        index = int(match.group(1)) - 1
        grad = outs[index] if index < len(outs) else None
        if isinstance(grad, fx.Node):  # else no gradient (a frozen part) or not this graph's to return
            found.append((name, index, grad))
    return found


def check_replicated(gm: fx.GraphModule, placement: Placement, grads: list[tuple[str, int, fx.Node]]) -> None:
    """P6 (module docstring) on a graph of hybrid ``placement``; ``grads``: its part gradients."""
    assert placement.replicate is not None
    nodes = [n for n in gm.graph.nodes if is_collective(n)]
    for issue in nodes:
        if issue.meta.get(ROLE_KEY) in ("gather", "reduce_scatter"):
            on_group(gm, issue, placement.shard.name, "P6", "P6", "the shard group")
    reduces = [n for n in nodes if n.target is _ALL_REDUCE]
    for issue in (n for n in nodes if n.meta.get(ROLE_KEY) == "reduce_scatter"):
        over_replicas(gm, issue, reduces, placement.replicate.name, "P6", "P6")
    for name, index, grad in grads:
        waits, _ = above_reduce_scatters(grad, also=(REPLICATE_WAIT,))  # stopping at either wait
        around = next((w for w in waits if w.meta.get(ROLE_KEY) != REPLICATE_WAIT), None)
        if around is not None:
            _fail(gm, grad, f"P6: the gradient of part {name} (output {index}) reads {around.name} around the replicate all-reduce")
        if not waits:
            _fail(gm, grad, f"P6: the gradient of part {name} (output {index}) is not all-reduced over the replicate group")


def check_part_updates(gm: fx.GraphModule, updated: Mapping[int, str]) -> None:
    """P4 (module docstring) for ``updated`` (backward output index -> part name, every part the
    graph updates); the rest of the graph is checked by :func:`check_part_collectives`."""
    nodes = list(gm.graph.nodes)
    outs = gm.graph.output_node().args[0]
    inputs = {n.name: n for n in nodes if n.op == "placeholder"}
    extra = [n for n in nodes if n.op == "placeholder" and n.name.startswith("update_param_")]
    if len(extra) != len(updated):
        raise VerificationError(f"graphddp verify: P4: {len(updated)} parts updated, {len(extra)} update_param inputs")
    writes: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node.target is torch.ops.aten.copy_.default and node.meta.get(ROLE_KEY) == "update":
            writes.setdefault(node.args[0], []).append(node)  # the update writes its input itself
    memory = Memory(nodes)
    scatter_waits = [n for n in nodes if is_wait(n) and n.meta.get(ROLE_KEY) == "reduce_scatter_wait"]
    for k, (index, name) in enumerate(sorted(updated.items())):
        what = f"P4: the update of part {name!r} (output {index})"
        not_returned(gm, outs[index], "P4", what)
        targets = [t for t in (inputs.get(f"primals_{index + 1}"), extra[k]) if t is not None]
        write = written_last(gm, [w for t in targets for w in writes.get(t, [])], memory, "P4", what, aliases=targets)
        from_average(gm, write, scatter_waits, "P4", what, "a reduce-scatter")

