"""Apply the optimizer inside a backward graph: each bucket's update right after its wait.

Runs after :func:`~graphddp.graph.insert_comm` (or, at world size 1, on the graph as
it is). For every bucket with ``Bucket.updates`` it traces the optimizer step of those
parameters (:func:`graphddp.optim.attached.bucket_update_fn`, inductor's decompositions applied) on
the graph's fake values and splices it right after the bucket's last node (its unflatten
views), so bucket ``i``'s update runs before bucket ``i + 1``'s wait: while later buckets are
still on the wire. The updated parameters' gradients are then no longer returned (``None``):
no gradient memory outlives the update. With ``Schedule.max_grad_norm`` the gradients are
clipped first (:mod:`graphddp.optim.clip`): each bucket's norms after its wait, the
coefficient after the last one, and every update after that (``Schedule.update_after``).

New inputs, appended after the existing placeholders, in this order (``optim.layout``): per
updated parameter, in bucket and slot order, the parameter and its state tensors; then per
param group used, its hyperparameters (float64 scalars). Each carries
``meta[ROLE_KEY] == "update_input"`` and a fake ``meta["val"]``; the runtime passes the real
tensors in the same order (:class:`graphddp.optim.attached.AttachedOptimizer`).

Aliasing (why the pass needs each parameter's forward value). AOTAutograd saves tensors for
the backward; a saved parameter is an input of the backward graph already, and a saved view
of one (``t(weight)``) is an input too, backed by the parameter's memory at trace time. A
compiler cannot know two inputs share memory, so an in-place update of the parameter could be
reordered before a read of the view. Nor is a saved input sure to be the parameter at run
time: the compiled forward may save a copy instead (inductor's layout optimization saves a
channels-last copy of each convolution weight), and an update written through it would miss
the parameter. The pass therefore (a) updates a parameter always through its own new input,
which the runtime fills with the parameter itself, and (b) rewrites every read of a saved
input that aliases it at trace time into an ``as_strided`` view of that input. Every read of
the parameter's memory then goes through one node, which the update mutates, and the
compiler orders the reads first; a read sees the old values whether the forward saved the
parameter or a copy. The runtime checks, on the first call, that each written input is its
parameter's memory (``WRITES``).

Postcondition (``graphddp.optim.verify`` checks it): every updated parameter is written
(``copy_``) exactly once, after its bucket's wait and after every other read of its memory;
its gradient output is None; other outputs are unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.capture import storage_of, views_of
from graphddp.graph.trace import after_all, set_outputs, splice, trace
from graphddp.optim import attached as optim
from graphddp.optim.clip import insert_clip, insert_scaled
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY
from graphddp.values.schedule import Schedule

aten = torch.ops.aten

UPDATE_INPUT = "update_input"  # ROLE_KEY of the placeholders this pass adds
WRITES = "graphddp_writes"  # meta of the input an update writes a parameter through: its name


@dataclasses.dataclass(frozen=True)
class UpdateInputs:
    """What the pass needs beyond the schedule, per parameter the schedule updates: its rule,
    its param group, and its forward value (a fake tensor: the storage its aliases share)."""

    rules: Mapping[str, optim.UpdateRule]
    groups: Mapping[str, int]
    values: Mapping[str, torch.Tensor]


def replicated(schedule: Schedule) -> list:
    """The buckets this pass updates: all but the sharded ones (:mod:`graphddp.optim.insert_shard`)."""
    return [b for b in schedule.buckets if b.collective != "reduce_scatter"]


def parameter_nodes(graph: fx.Graph, names: list[str], inputs: UpdateInputs, new: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """The node each parameter is read and updated through: its new input ``new[name]``, never
    a saved input (module docstring: Aliasing); saved aliases rewritten to views of it."""
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


def _new_inputs(graph: fx.Graph, schedule: Schedule, inputs: UpdateInputs) -> tuple[list[str], dict[str, list[fx.Node]], dict[int, list[fx.Node]]]:
    """Append the update's placeholders; returns updated names, per-name and per-group nodes."""
    names = [n for b in replicated(schedule) for n in b.updates]
    per_name, per_group = append_update_inputs(graph, names, inputs)
    return names, per_name, per_group


def append_update_inputs(
    graph: fx.Graph, names: Sequence[str], inputs: UpdateInputs
) -> tuple[dict[str, list[fx.Node]], dict[int, list[fx.Node]]]:
    """Append the placeholders of ``names``' updates (module docstring: the order); returns
    per name its parameter's and state's nodes, per param group its hyperparameters'."""
    rules = [inputs.rules[n] for n in names]
    group_of = [inputs.groups[n] for n in names]
    labels, groups = optim.layout(rules, group_of)
    fake_mode = detect_fake_mode(tuple(inputs.values.values()))
    vals: list[torch.Tensor] = []
    with fake_mode:
        for name, rule in zip(names, rules):
            p = inputs.values[name]
            vals.append(p)
            for s in rule.state:
                if s == "step":
                    vals.append(optim.adam_step(rule, p))
                elif s == "first":
                    vals.append(torch.empty((), dtype=torch.bool))
                else:
                    vals.append(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device))
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
    """New placeholders after the last one, tagged as the update's inputs, with fake values."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    nodes = []
    for label, val in zip(labels, vals, strict=True):
        with graph.inserting_after(last):
            last = graph.placeholder(label)
        last.meta["val"] = val
        last.meta[ROLE_KEY] = UPDATE_INPUT
        nodes.append(last)
    return nodes


class UpdateTraces:
    """Each parameter's update, traced once per signature and reused for its lookalikes.

    A transformer's layers repeat the same parameter shapes, and tracing the update (make_fx
    with inductor's decompositions) is costly: once per parameter, it is a large part of a large
    model's compile (docs/gpu.md has the figures). A parameter whose rule, clipping and inputs (shape, strides, dtype, device of the
    gradient, the parameter, its state and its group's hyperparameters) equal an earlier one's
    gets that graph again, with every node's fake value computed afresh from its own inputs
    (a run of the traced graph in the values' fake mode, far cheaper than tracing): no two
    parameters' nodes share a fake value, so storages (which the verifiers and inductor read
    to know what aliases what) stay each parameter's own. Symbolic shapes are traced each
    time. One cache per graph rewrite: nothing outlives it."""

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
    """Run a traced graph on fake values, recording each node's new value as its meta["val"]."""

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
    """The node bucket ``index``'s update goes before: right after the nodes of bucket ``after``
    (:meth:`Schedule.update_after`: its own wait and unflatten views, or with clipping the last
    bucket's, its norms and the coefficient), its gradients (at world size 1 there is no wait),
    every read of its parameters and the earlier buckets' updates (updates run in bucket
    order), whichever is last."""
    last = [
        n for n in graph.nodes
        if n.meta.get(BUCKET_KEY) == after or (n.meta.get(ROLE_KEY) == "update" and n.meta.get(BUCKET_KEY, index) < index)
    ] + list(grads)
    readers = [user for p in params for view in views_of(p) for user in view.users]
    return after_all(graph, last + readers)


def insert_update(gm: fx.GraphModule, schedule: Schedule, inputs: UpdateInputs) -> fx.GraphModule:
    """Splice every bucket's optimizer update after its wait (module docstring).

    A no-op when no bucket updates a parameter.
    """
    if not any(b.updates for b in replicated(schedule)):
        return gm
    from torch._inductor.decomposition import select_decomp_table

    graph = gm.graph
    output = graph.output_node()
    outs: list[Any] = list(output.args[0])
    names, per_name, per_group = _new_inputs(graph, schedule, inputs)
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
