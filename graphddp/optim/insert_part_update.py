"""``sharding="full"``: each part updated inside the backward, right after its gradient arrives.

A fully sharded backward returns each gathered part's gradient (a reduce-scatter bucket's wait cut
back into parts, :mod:`graphddp.graph.part_collectives`). This pass updates the part there instead,
with the optimizer update the other modes splice (traced once per signature), and returns None
for its gradient, so one bucket's update runs while later buckets are on the wire.

Each part is updated through a new placeholder the runtime fills with the part itself, never a
tensor the forward saved (it may be a copy); a part the backward reads already (re-gathered from
``primals_k``) is read through a view of that placeholder, so the update comes after the gather
(:func:`graphddp.optim.insert_update.parameter_nodes`). Each update goes after its gradient and every
read of its part. :func:`graphddp.graph.verify.check_part_updates` (P4) checks the result.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.capture import views_of
from graphddp.graph.part_collectives import above_reduce_scatters
from graphddp.graph.trace import after_all, set_outputs, splice
from graphddp.optim.insert_update import UpdateInputs, UpdateTraces, add_update_inputs, append_update_inputs, parameter_nodes
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY


def insert_part_updates(gm: fx.GraphModule, grads: Mapping[int, str], inputs: UpdateInputs, carry: bool = False) -> list[str]:
    """Update every part in ``grads`` (output index -> part name) that ``inputs`` has a rule for and
    whose gradient the graph computes; returns their names in input order (empty: unchanged). With
    ``carry``, one more input per part (``carried_k``): what it accumulated earlier in the step
    (``no_sync``, or a weight tied across a graph break), added before the update."""
    from torch._inductor.decomposition import select_decomp_table

    graph = gm.graph
    outs: list[Any] = list(graph.output_node().args[0])
    chosen = [(i, name) for i, name in sorted(grads.items()) if isinstance(outs[i], fx.Node) and name in inputs.rules]
    if not chosen:
        return []
    names = [name for _, name in chosen]
    per_name, per_group = append_update_inputs(graph, names, inputs)
    carried = _carried_inputs(graph, [outs[i] for i, _ in chosen]) if carry else {}
    param_node = parameter_nodes(graph, names, inputs, {n: per_name[n][0] for n in names})
    traces = UpdateTraces(select_decomp_table())
    for i, name in chosen:
        grad = outs[i]
        param = param_node[name]
        readers = [user for view in views_of(param) for user in view.users if user.op != "output"]
        point = after_all(graph, [grad, *readers])
        if carry:
            grad = _added(graph, grad, carried[grad], point)
        args = [grad, param, *per_name[name][1:], *per_group[inputs.groups[name]]]
        traced = traces.traced(inputs.rules[name], False, [a.meta["val"] for a in args], f"the optimizer update of part {name!r}")
        splice(graph, traced, args, point, _bucket_of(grad))
        outs[i] = None
    set_outputs(graph, outs)
    graph.lint()
    gm.recompile()
    return names


def _carried_inputs(graph: fx.Graph, grads: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    vals = []
    fake_mode = detect_fake_mode(tuple(g.meta["val"] for g in grads))
    with fake_mode:
        for g in grads:
            v = g.meta["val"]
            vals.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
    nodes = add_update_inputs(graph, [f"carried_{k}" for k in range(len(grads))], vals)
    return dict(zip(grads, nodes))


def _added(graph: fx.Graph, grad: fx.Node, carried: fx.Node, before: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(torch.ops.aten.add.Tensor, (grad, carried))
    with detect_fake_mode((grad.meta["val"],)):
        node.meta["val"] = grad.meta["val"] + carried.meta["val"]
    node.meta[ROLE_KEY] = "carry"
    return node


def _bucket_of(grad: fx.Node) -> int:
    """The reduce-scatter bucket a gradient came from (the latest, for a tied weight's sum)."""
    waits, _ = above_reduce_scatters(grad)
    return max((w.meta.get(BUCKET_KEY, -1) for w in waits), default=-1)
