"""Apply the optimizer inside a backward graph: each parameter updated right after its gradient
arrives, by one splice (:class:`_Updates`) for every placement.

* Replicated buckets (:func:`insert_update`, after the collectives, if any): each bucket's
  ``Bucket.updates`` are spliced after the bucket's unflatten views, so bucket ``i``'s update runs
  before bucket ``i + 1``'s wait, while later buckets are on the wire. With ``max_grad_norm`` every
  update waits for the clip coefficient (``Schedule.update_after``).
* ``sharding="full"``'s parts (:func:`insert_part_updates`): each part's gradient (a reduce-scatter
  bucket's wait cut back into parts) updates the part there; the carrying variant first adds what
  the part accumulated earlier in the step.

New inputs follow the existing placeholders in ``optim.layout`` order, role ``update_input``.

Aliasing. A saved parameter, or a saved view of one (``t(weight)``), is an input of the backward;
a compiler cannot know two inputs share memory, so an in-place update could be reordered before a
read of the view. Nor is a saved input sure to be the parameter: inductor may save a channels-last
copy of a convolution weight, and an update through it would miss the parameter. So (a) a parameter
is updated through its own new input, which the runtime fills with the parameter itself, and (b)
every read of a saved input aliasing it becomes an ``as_strided`` view of that input: all reads go
through the one node the update mutates, and come first. The runtime checks on the first call that
each written input is its parameter's memory (``WRITES``).

Postcondition (U1-U7 of :mod:`graphddp.optim.verify`; P4 for parts): every updated parameter
written once, after its gradient's wait and every other read of its memory; its gradient output None.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.capture import storage_of, views_of
from graphddp.graph.part_collectives import above_reduces
from graphddp.graph.trace import add_inputs, after_all, set_outputs, splice, trace
from graphddp.optim import attached as optim
from graphddp.optim.clip import insert_clip, insert_scaled
from graphddp.values.collectives import SHARDED
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

    @staticmethod
    def of(optimizer: optim.AttachedOptimizer, names: Sequence[str], values: Mapping[str, torch.Tensor]) -> UpdateInputs:
        """For ``names``, parameters ``optimizer`` holds, whose forward values ``values`` has."""
        rules = {n: optimizer.rule(n) for n in names}
        return UpdateInputs(rules, {n: optimizer.group_of[n] for n in names}, {n: values[n] for n in names})  # type: ignore[arg-type]


def read_through(graph: fx.Graph, new: Mapping[str, fx.Node], inputs: UpdateInputs) -> None:
    """Each parameter read and updated through its own new input ``new[name]``: saved aliases
    rewritten to views of it (module docstring: Aliasing)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ROLE_KEY) != UPDATE_INPUT]
    by_storage: dict[int, list[fx.Node]] = {}
    for ph in placeholders:
        ref = storage_of(ph.meta.get("val"))
        if ref is not None:
            by_storage.setdefault(ref, []).append(ph)
    for name, node in new.items():
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


def written_inputs(gm: fx.GraphModule) -> tuple[tuple[int, str], ...]:
    """Each input an update writes a parameter through, ``(position, name)``: what the runtime checks
    is the parameter's memory."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return tuple((i, ph.meta[WRITES]) for i, ph in enumerate(placeholders) if WRITES in ph.meta)


def append_update_inputs(
    graph: fx.Graph, names: Sequence[str], inputs: UpdateInputs
) -> tuple[dict[str, list[fx.Node]], dict[int, list[fx.Node]]]:
    """Append the placeholders of ``names``' updates; returns per name its parameter's and state's
    nodes, per param group its hyperparameters'."""
    rules = [inputs.rules[n] for n in names]
    group_of = [inputs.groups[n] for n in names]
    labels, groups = optim.layout(rules, group_of)
    vals: list[torch.Tensor] = []
    with detect_fake_mode(tuple(inputs.values.values())):
        for name, rule in zip(names, rules):
            p = inputs.values[name]
            vals += [p, *optim.fake_state(rule, p, lambda: torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device))]
        vals.extend(optim.fake_hyper(rules[group_of.index(g)] for g in groups))
    nodes = add_update_inputs(graph, labels, vals)
    cut = optim.cut(nodes, [1 + len(r.state) for r in rules] + [len(rules[group_of.index(g)].hyper) for g in groups])
    return dict(zip(names, cut)), dict(zip(groups, cut[len(names):]))


def add_update_inputs(graph: fx.Graph, labels: Sequence[str], vals: Sequence[torch.Tensor]) -> list[fx.Node]:
    return add_inputs(graph, labels, [{"val": val, ROLE_KEY: UPDATE_INPUT} for val in vals])


# Per fake mode (one Dynamo graph's, shared by its backward and every variant of it): each update
# signature's traced graph.
_TRACED: weakref.WeakKeyDictionary[Any, dict[tuple, fx.GraphModule]] = weakref.WeakKeyDictionary()


def traced_update(rule: optim.UpdateRule, clipped: bool, vals: list[torch.Tensor], what: str, decompositions: Mapping[Any, Any]) -> fx.GraphModule:
    """A parameter's update, traced once per signature and reused for its lookalikes: a
    transformer's layers repeat shapes, and a backward's carrying variant repeats its updates, so
    tracing each one would weigh on a large model's compile. A reused graph gets every node's fake
    value computed afresh from its own inputs, so no two parameters share a storage, which the
    verifiers and inductor read for aliasing. Symbolic shapes are traced each time; a graph is
    reused only under the fake mode it was traced in."""
    fake_mode = detect_fake_mode(tuple(vals))
    key = _signature(rule, clipped, vals)
    graphs = _TRACED.setdefault(fake_mode, {}) if key is not None and fake_mode is not None else {}
    cached = graphs.get(key)
    if cached is None:
        cached = graphs[key] = trace(optim.param_update_fn(rule, clipped), vals, what, decompositions)
        return cached
    with fake_mode:
        _FakeValues(cached).run(*vals)
    return cached


def splice_update(
    graph: fx.Graph, rule: optim.UpdateRule, args: Sequence[fx.Node], point: fx.Node, bucket: int, what: str,
    decompositions: Mapping[Any, Any], clipped: bool = False,
) -> fx.Node:
    """One update (:func:`~graphddp.optim.attached.param_update_fn`'s arguments ``args``) spliced
    before ``point`` from :func:`traced_update`; returns the node of the parameter as written."""
    traced = traced_update(rule, clipped, [a.meta["val"] for a in args], what, decompositions)
    return splice(graph, traced, args, point, bucket)


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


class _Updates:
    """One graph's updates as they are spliced: the update inputs appended, every saved alias of a
    parameter read through its own input (module docstring: Aliasing), and each update traced
    once per signature."""

    def __init__(self, graph: fx.Graph, names: list[str], inputs: UpdateInputs) -> None:
        from torch._inductor.decomposition import select_decomp_table

        self.graph, self.inputs = graph, inputs
        self.per_name, self.per_group = append_update_inputs(graph, names, inputs)
        read_through(graph, {n: self.per_name[n][0] for n in names}, inputs)
        self.decompositions = select_decomp_table()

    def point(self, names: Sequence[str], grads: Sequence[fx.Node], after: Sequence[fx.Node] = ()) -> fx.Node:
        """The node the updates of ``names`` go before: after their gradients, every read of their
        parameters' memory and ``after``, whichever is last."""
        readers = [user for n in names for view in views_of(self.per_name[n][0]) for user in view.users if user.op != "output"]
        return after_all(self.graph, [*after, *grads, *readers])

    def splice(
        self, name: str, grad: fx.Node, point: fx.Node, bucket: int, coef: fx.Node | None = None, carried: fx.Node | None = None,
    ) -> None:
        """Parameter ``name`` updated from ``grad`` before ``point``, its nodes tagged ``bucket``:
        ``carried`` added to the gradient first, scaled by the clip coefficient ``coef``."""
        if carried is not None:
            grad = _added(self.graph, grad, carried, point)
        args = [grad, *self.per_name[name], *self.per_group[self.inputs.groups[name]]]
        if coef is not None:
            args.append(coef)
        what = f"the optimizer update of {name!r}"
        splice_update(self.graph, self.inputs.rules[name], args, point, bucket, what, self.decompositions, coef is not None)


def insert_update(gm: fx.GraphModule, schedule: Schedule, inputs: UpdateInputs) -> fx.GraphModule:
    """Splice every replicated bucket's optimizer update; a no-op when no bucket updates a parameter."""
    buckets = [b for b in schedule.buckets if b.collective != SHARDED]
    if not any(b.updates for b in buckets):
        return gm
    graph = gm.graph
    outs: list[Any] = list(graph.output_node().args[0])
    updates = _Updates(graph, [n for b in buckets for n in b.updates], inputs)
    coef = None
    if schedule.max_grad_norm is not None:  # the norm of every gradient first
        graded = [(b.index, [outs[s.output_index] for s in b.slots if not s.zero_filled]) for b in buckets]
        coef = insert_clip(graph, graded, schedule.max_grad_norm, schedule.grad_norm_type, updates.decompositions)
    for bucket in buckets:
        if coef is not None:  # what the graph still returns is clipped too
            kept = [s for s in bucket.slots if s.param_name not in bucket.updates and not s.zero_filled]
            scaled = insert_scaled(graph, coef, [outs[s.output_index] for s in kept], bucket.index, updates.decompositions)
            for s, grad in zip(kept, scaled):
                outs[s.output_index] = grad
        if not bucket.updates:
            continue
        slots = {s.param_name: s for s in bucket.slots}
        updated = [slots[n] for n in bucket.updates]
        # after the nodes of bucket update_after (Schedule.update_after) and the earlier buckets' updates
        after, index = schedule.update_after(bucket.index), bucket.index
        last = [
            n for n in graph.nodes
            if n.meta.get(BUCKET_KEY) == after or (n.meta.get(ROLE_KEY) == "update" and n.meta.get(BUCKET_KEY, index) < index)
        ]
        point = updates.point(bucket.updates, [outs[s.output_index] for s in updated], last)
        for s in updated:  # in slot order, each before the point
            updates.splice(s.param_name, outs[s.output_index], point, bucket.index, coef)
            outs[s.output_index] = None
    return _rewritten(gm, outs)


def insert_part_updates(gm: fx.GraphModule, grads: Mapping[int, str], inputs: UpdateInputs, carry: bool = False) -> list[str]:
    """Update every part in ``grads`` (output index -> part name) that ``inputs`` has a rule for and
    whose gradient the graph computes; returns their names in input order (empty: unchanged). With
    ``carry``, one more input per part (``carried_k``): what it accumulated earlier in the step
    (``no_sync``, or a weight tied across a graph break), added before the update."""
    graph = gm.graph
    outs: list[Any] = list(graph.output_node().args[0])
    chosen = [(i, name) for i, name in sorted(grads.items()) if isinstance(outs[i], fx.Node) and name in inputs.rules]
    if not chosen:
        return []
    updates = _Updates(graph, [name for _, name in chosen], inputs)
    carried = _carried_inputs(graph, [outs[i] for i, _ in chosen]) if carry else {}
    for i, name in chosen:
        point = updates.point([name], [outs[i]])
        updates.splice(name, outs[i], point, _bucket_of(outs[i]), carried=carried.get(outs[i]))
        outs[i] = None
    _rewritten(gm, outs)
    return [name for _, name in chosen]


def _rewritten(gm: fx.GraphModule, outs: list[Any]) -> fx.GraphModule:
    set_outputs(gm.graph, outs)
    gm.graph.lint()
    gm.recompile()
    return gm


def _carried_inputs(graph: fx.Graph, grads: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    vals = []
    with detect_fake_mode(tuple(g.meta["val"] for g in grads)):
        for g in grads:
            v = g.meta["val"]
            vals.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
    return dict(zip(grads, add_update_inputs(graph, [f"carried_{k}" for k in range(len(grads))], vals)))


def _added(graph: fx.Graph, grad: fx.Node, carried: fx.Node, before: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(aten.add.Tensor, (grad, carried))
    with detect_fake_mode((grad.meta["val"],)):
        node.meta["val"] = grad.meta["val"] + carried.meta["val"]
    node.meta[ROLE_KEY] = "carry"
    return node


def _bucket_of(grad: fx.Node) -> int:
    """The reduce bucket a part's gradient came from (the latest, for a tied weight's sum)."""
    waits, _ = above_reduces(grad)
    return max((w.meta.get(BUCKET_KEY, -1) for w in waits), default=-1)
