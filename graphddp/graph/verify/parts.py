"""The collectives of ``sharding="full"`` (P1-P3, P5-P7), checked on every graph it rewrites: each part
reduce-scattered once after its gradients, averaged over its replicas, resharded as planned; each
parameter held whole all-reduced over every rank."""
from __future__ import annotations

from typing import Collection

import torch.fx as fx

from graphddp.graph.capture import ancestors
from graphddp.graph.invariants import on_group, over_replicas, waited_once
from graphddp.graph.part_collectives import above_reduces
from graphddp.graph.part_facts import input_name
from graphddp.graph.reshard import kept_gathered, kept_gathered_bytes
from graphddp.graph.verify_common import _fail
from graphddp.values.collectives import ALL_REDUCE_OUT_OP
from graphddp.values.comm import ROLE_KEY, is_collective, is_wait
from graphddp.values.part_schedule import ALL_REDUCE, GATHER, REDUCE_SCATTER, REDUCE_WAITS, REDUCES, WAIT_OF
from graphddp.values.placement import REPLICATE_WAIT, Placement, Whole


def check_part_collectives(
    gm: fx.GraphModule, backward: bool, reshard: bool = False, kept_bytes: int = 0, parts: Collection[str] | None = None,
    placement: Placement | None = None, replicated: Whole | None = None,
) -> None:
    """P1-P3 on one rewritten graph; P2 on a ``backward`` (``parts``: the forward inputs' names of its
    parts), P5 on a forward that ``reshard``s, P6 with a hybrid ``placement``, P7 on the all-reduces
    of parameters held whole (``replicated``: their placement)."""
    gm.graph.lint()
    for issue in gm.graph.nodes:
        if is_collective(issue):
            waited_once(gm, issue, "P1", f"{issue.target}")
    reduces = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) in REDUCES]
    for issue in reduces:
        again = [a for a in ancestors(issue.args[0]) if is_wait(a) and a.meta.get(ROLE_KEY) in REDUCE_WAITS]
        if again:
            _fail(gm, issue, f"P3: {issue.name} reduces what {again[0].name} received: a gradient averaged twice")
    for issue in (n for n in reduces if n.meta.get(ROLE_KEY) == ALL_REDUCE):
        if replicated is None:
            _fail(gm, issue, f"P7: {issue.name} all-reduces a gradient, and no parameter is held whole")
        on_group(gm, issue, replicated.shard.name, "P7", "P7", "every rank's group")
    if placement is not None and placement.hybrid:
        check_replicated(gm, placement, _part_gradients(gm, parts) if backward else [])
    if backward:
        _check_part_gradients(gm, parts)
    elif reshard:
        _check_kept_gathers(gm, kept_bytes)


def _check_kept_gathers(gm: fx.GraphModule, allowed: int) -> None:
    held = kept_gathered_bytes(gm)
    if held > allowed:
        out = next(iter(kept_gathered(gm).values()))
        _fail(gm, out, f"P5: the outputs of a forward that reshards hold {held} gathered bytes (e.g. {out.name}), "
                       f"more than the {allowed} of the parts the backward reads first: kept for the backward instead of freed")


def _check_part_gradients(gm: fx.GraphModule, parts: Collection[str] | None) -> None:
    for name, index, grad in _part_gradients(gm, parts):
        through, inputs = above_reduces(grad)  # stopping at the reduces' waits
        around = next((n for n in inputs if n.name.startswith("tangents")), None)
        if around or not through:
            why = f"around a reduce (via {around.name})" if around else "without a reduce"
            _fail(gm, grad, f"P2: the gradient of part {name} (output {index}) reads the incoming gradients {why}")


def _part_gradients(gm: fx.GraphModule, parts: Collection[str] | None) -> list[tuple[str, int, fx.Node]]:
    """(part's input name, output index, gradient node) of each part the backward returns a
    gradient for; ``parts`` None: the inputs the backward gathers."""
    outs = gm.graph.output_node().args[0]
    if not isinstance(outs, (tuple, list)):
        return []
    if parts is None:
        parts = [n.name for n in gm.graph.nodes if n.op == "placeholder" and any(u.meta.get(ROLE_KEY) == GATHER for u in n.users)]
    index = {input_name(i): i for i in range(len(outs))}  # output i is the gradient of input i
    found = [(name, index[name], outs[index[name]]) for name in parts if name in index]
    return [f for f in found if isinstance(f[2], fx.Node)]  # else no gradient (a frozen part) or not this graph's to return


def check_replicated(gm: fx.GraphModule, placement: Placement, grads: list[tuple[str, int, fx.Node]]) -> None:
    """P6 on a graph of hybrid ``placement``; ``grads``: its part gradients."""
    assert placement.replicate is not None
    nodes = [n for n in gm.graph.nodes if is_collective(n)]
    for issue in nodes:
        if issue.meta.get(ROLE_KEY) in (GATHER, REDUCE_SCATTER):
            on_group(gm, issue, placement.shard.name, "P6", "P6", "the shard group")
    reduces = [n for n in nodes if n.target is ALL_REDUCE_OUT_OP]
    for issue in (n for n in nodes if n.meta.get(ROLE_KEY) == REDUCE_SCATTER):
        over_replicas(gm, issue, reduces, placement.replicate.name, "P6", "P6")
    for name, index, grad in grads:
        waits, _ = above_reduces(grad, also=(REPLICATE_WAIT,))  # stopping at either wait
        if waits and all(w.meta.get(ROLE_KEY) == WAIT_OF[ALL_REDUCE] for w in waits):
            continue  # held whole: all-reduced over every rank (P7)
        around = next((w for w in waits if w.meta.get(ROLE_KEY) != REPLICATE_WAIT), None)
        if around is not None:
            _fail(gm, grad, f"P6: the gradient of part {name} (output {index}) reads {around.name} around the replicate all-reduce")
        if not waits:
            _fail(gm, grad, f"P6: the gradient of part {name} (output {index}) is not all-reduced over the replicate group")
