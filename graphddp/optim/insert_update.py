"""Apply the optimizer inside a backward graph: each bucket's update right after its wait.

Runs after :func:`~graphddp.graph.insert_comm` (at world size 1, on the graph as it is). Each
bucket's ``Bucket.updates`` are traced (:func:`graphddp.optim.attached.bucket_update_fn`) and
spliced after the bucket's unflatten views, so bucket ``i``'s update runs before bucket ``i + 1``'s
wait, while later buckets are on the wire; their gradients are then returned as None. With
``Schedule.max_grad_norm`` every update waits for the clip coefficient (``Schedule.update_after``).
New inputs follow the existing placeholders in ``optim.layout`` order, role ``update_input``.

Aliasing. A saved parameter, or a saved view of one (``t(weight)``), is an input of the backward;
a compiler cannot know two inputs share memory, so an in-place update could be reordered before a
read of the view. Nor is a saved input sure to be the parameter: inductor may save a channels-last
copy of a convolution weight, and an update through it would miss the parameter. So (a) a parameter
is updated through its own new input, which the runtime fills with the parameter itself, and (b)
every read of a saved input aliasing it becomes an ``as_strided`` view of that input: all reads go
through the one node the update mutates, and come first. The runtime checks on the first call that
each written input is its parameter's memory (``WRITES``).

Postcondition (``graphddp.optim.verify``): every updated parameter written once, after its
bucket's wait and every other read of its memory; its gradient output None.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.capture import storage_of, views_of
from graphddp.graph.trace import add_inputs, after_all, set_outputs, splice, trace
from graphddp.optim import attached as optim
from graphddp.optim.clip import insert_clip, insert_scaled
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY
from graphddp.values.schedule import Schedule

aten = torch.ops.aten

UPDATE_INPUT = "update_input"  # ROLE_KEY of the placeholders this pass adds
WRITES = "graphddp_writes"  # meta of the input an update writes a parameter through: its name


@dataclasses.dataclass(frozen=True)
class UpdateInputs:
    """Per parameter the schedule updates: its rule, its param group, and its forward value (a fake
    tensor: the storage its aliases share)."""

    rules: Mapping[str, optim.UpdateRule]
    groups: Mapping[str, int]
    values: Mapping[str, torch.Tensor]


def replicated(schedule: Schedule) -> list:
    return [b for b in schedule.buckets if b.collective != "reduce_scatter"]


def parameter_nodes(graph: fx.Graph, names: list[str], inputs: UpdateInputs, new: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """The node each parameter is read and updated through: ``new[name]``, saved aliases rewritten
    to views of it (module docstring: Aliasing)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ROLE_KEY) != UPDATE_INPUT]
    by_storage: dict[int, list[fx.Node]] = {}
    for ph in placeholders:
        ref = storage_of(ph.meta.get("val"))
        if ref is not None:
            by_storage.setdefault(ref, []).append(ph)
    chosen: dict[str, fx.Node] = {}
    for name in names:
        chosen[name] = node = new[name]
        node.meta[WRITES] = name
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for alias in by_storage.get(storage_of(inputs.values[name]), []):
            if not alias.users:
                continue
            val = alias.meta["val"]
            with graph.inserting_before(first):
                view = graph.call_function(aten.as_strided.default, (node, list(val.shape), list(val.stride()), val.storage_offset()))
            view.meta["val"] = val
            view.meta[ROLE_KEY] = "alias"
            alias.replace_all_uses_with(view)
    return chosen


def append_update_inputs(
    graph: fx.Graph, names: Sequence[str], inputs: UpdateInputs
) -> tuple[dict[str, list[fx.Node]], dict[int, list[fx.Node]]]:
    """Append the placeholders of ``names``' updates; returns per name its parameter's and state's
    nodes, per param group its hyperparameters'."""
    rules = [inputs.rules[n] for n in names]
    group_of = [inputs.groups[n] for n in names]
    labels, groups = optim.layout(rules, group_of)
    fake_mode = detect_fake_mode(tuple(inputs.values.values()))
    vals: list[torch.Tensor] = []
    with fake_mode:
        for name, rule in zip(names, rules):
            p = inputs.values[name]
            vals.append(p)
            vals.extend(optim.fake_state(rule, p, lambda: torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)))
        for g in groups:
            vals.extend(torch.empty((), dtype=optim.F64) for _ in rules[group_of.index(g)].hyper)
    nodes = add_update_inputs(graph, labels, vals)
    per_name: dict[str, list[fx.Node]] = {}
    at = 0
    for name, rule in zip(names, rules):
        per_name[name] = nodes[at:at + 1 + len(rule.state)]
        at += 1 + len(rule.state)
    per_group: dict[int, list[fx.Node]] = {}
    for g in groups:
        width = len(rules[group_of.index(g)].hyper)
        per_group[g], at = nodes[at:at + width], at + width
    return per_name, per_group


def add_update_inputs(graph: fx.Graph, labels: Sequence[str], vals: Sequence[torch.Tensor]) -> list[fx.Node]:
    return add_inputs(graph, labels, [{"val": val, ROLE_KEY: UPDATE_INPUT} for val in vals])


class UpdateTraces:
    """Each parameter's update, traced once per signature and reused for its lookalikes.

    Tracing once per parameter is a large part of a large model's compile (docs/gpu.md), and a
    transformer's layers repeat shapes. A reused graph gets every node's fake value computed afresh
    from its own inputs (a fake run, far cheaper than tracing), so no two parameters share a storage,
    which the verifiers and inductor read for aliasing. Symbolic shapes are traced each time; one
    cache per graph rewrite."""

    def __init__(self, decompositions: Mapping[Any, Any]) -> None:
        self.decompositions = decompositions
        self.graphs: dict[tuple, fx.GraphModule] = {}

    def traced(self, rule: optim.UpdateRule, clipped: bool, vals: list[torch.Tensor], what: str) -> fx.GraphModule:
        key = _signature(rule, clipped, vals)
        cached = self.graphs.get(key) if key is not None else None
        if cached is None:
            fn = optim.bucket_update_fn([rule], [0], [0], clipped=clipped)
            cached = trace(fn, vals, what, self.decompositions)
            if key is not None:
                self.graphs[key] = cached
            return cached
        fake_mode = detect_fake_mode(tuple(vals))
        with fake_mode:
            _FakeValues(cached).run(*vals)
        return cached


class _FakeValues(fx.Interpreter):

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "output":
            n.meta["val"] = result
            n.meta.pop("tensor_meta", None)  # derived from the old value: splice copies what is there
        return result


def _signature(rule: optim.UpdateRule, clipped: bool, vals: list[torch.Tensor]) -> tuple | None:
    """What an update's traced graph depends on; None where a shape is symbolic."""
    metas = []
    for v in vals:  # not the storage offset: the ops traced do not depend on it (a gradient is a view of its bucket)
        if any(not isinstance(d, int) for d in (*v.shape, *v.stride())):
            return None
        metas.append((tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad))
    return (rule, clipped, tuple(metas))


def _update_point(graph: fx.Graph, index: int, after: int, params: list[fx.Node], grads: list[fx.Node]) -> fx.Node:
    """The node bucket ``index``'s update goes before: after the nodes of bucket ``after``
    (:meth:`Schedule.update_after`), its gradients, every read of its parameters and the earlier
    buckets' updates (updates run in bucket order), whichever is last."""
    last = [
        n for n in graph.nodes
        if n.meta.get(BUCKET_KEY) == after or (n.meta.get(ROLE_KEY) == "update" and n.meta.get(BUCKET_KEY, index) < index)
    ] + list(grads)
    readers = [user for p in params for view in views_of(p) for user in view.users]
    return after_all(graph, last + readers)


def insert_update(gm: fx.GraphModule, schedule: Schedule, inputs: UpdateInputs) -> fx.GraphModule:
    """Splice every bucket's optimizer update; a no-op when no bucket updates a parameter."""
    if not any(b.updates for b in replicated(schedule)):
        return gm
    from torch._inductor.decomposition import select_decomp_table

    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    names = [n for b in replicated(schedule) for n in b.updates]
    per_name, per_group = append_update_inputs(graph, names, inputs)
    param_node = parameter_nodes(graph, names, inputs, {n: per_name[n][0] for n in names})
    decompositions = select_decomp_table()
    updates = UpdateTraces(decompositions)
    coef = None
    if schedule.max_grad_norm is not None:  # the norm of every gradient first (graphddp.optim.clip)
        graded = [(b.index, [outs[s.output_index] for s in b.slots if not s.zero_filled]) for b in replicated(schedule)]
        coef = insert_clip(graph, graded, schedule.max_grad_norm, schedule.grad_norm_type, decompositions)
    for bucket in replicated(schedule):
        if coef is not None:  # what the graph still returns is clipped too
            kept = [s for s in bucket.slots if s.param_name not in bucket.updates and not s.zero_filled]
            for s, scaled in zip(kept, insert_scaled(graph, coef, [outs[s.output_index] for s in kept], bucket.index, decompositions)):
                outs[s.output_index] = scaled
        if not bucket.updates:
            continue
        slots = {s.param_name: s for s in bucket.slots}
        updated = [slots[n] for n in bucket.updates]
        rules = [inputs.rules[s.param_name] for s in updated]
        group_of = [inputs.groups[s.param_name] for s in updated]
        grads = [outs[s.output_index] for s in updated]
        point = _update_point(graph, bucket.index, schedule.update_after(bucket.index), [param_node[s.param_name] for s in updated], grads)
        for s, rule, g, grad in zip(updated, rules, group_of, grads):  # in slot order, each before the point
            args = [grad, param_node[s.param_name], *per_name[s.param_name][1:], *per_group[g]]
            if coef is not None:
                args.append(coef)
            traced = updates.traced(rule, coef is not None, [a.meta["val"] for a in args], f"the optimizer update of {s.param_name!r}")
            splice(graph, traced, args, point, bucket.index)
            outs[s.output_index] = None
    set_outputs(graph, outs)
    graph.lint()
    gm.recompile()
    return gm
