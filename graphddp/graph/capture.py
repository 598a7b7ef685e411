"""From a compiled backward graph to plain facts: which output is which parameter's gradient,
which nodes compute, and what each node costs.

AOTAutograd's backward graph returns one output per input of the Dynamo graph, in the same
order (``None`` where the input gets no gradient). Dynamo lifts parameters to graph inputs and
hands the real ``nn.Parameter`` objects to the backend as example inputs, so output ``i`` is
the gradient of whatever parameter example input ``i`` *is* (by identity). Everything the
planner needs is extracted here into :class:`GraphFacts`, a frozen value with no references
to the graph, so planning is a pure function that tests can feed by hand.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry

from graphddp.values.schedule import GradSlot, GraphFacts, NodeFact, dtype_name, production_order

# Views whose schema does not say so: ``_unsafe_view`` is a view that skips the alias checks.
_UNMARKED_VIEWS = {torch.ops.aten._unsafe_view.default}


def is_view(node: fx.Node) -> bool:
    """A node that returns an alias of its input, as its op schema says (but ``_unsafe_view``)."""
    if node.op != "call_function":
        return False
    target = node.target
    return target in _UNMARKED_VIEWS or (isinstance(target, torch._ops.OpOverload) and target.is_view)


def reach(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> list[fx.Node]:
    """``start`` and every node ``step`` leads to from one, transitively, each once, in the order met."""
    seen: dict[fx.Node, None] = {}
    todo = list(start)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen[node] = None
            todo.extend(step(node))
    return list(seen)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it depends on, transitively."""
    return set(reach([node], lambda n: n.all_input_nodes))


def descendants(start: Sequence[fx.Node]) -> set[fx.Node]:
    """Every node in ``start`` and every node that reads one, transitively (the output node left out)."""
    return set(reach([n for n in start if n.op != "output"], lambda n: [u for u in n.users if u.op != "output"]))


def views_of(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view of it, transitively (they share its storage); ``split``'s
    pieces are reached through their ``getitem``."""
    return reach([node], lambda n: [u for u in n.users if is_view(u) or u.target is operator.getitem])


def storage_of(val: Any) -> int | None:
    """Identity of the memory behind a (fake) tensor value, shared by its views; None for anything
    else. It is trace-time aliasing: a compiled forward may still save a copy of a parameter."""
    return StorageWeakRef(val.untyped_storage()).cdata if isinstance(val, torch.Tensor) else None


def byte_size(val: torch.Tensor) -> int:
    return val.numel() * val.element_size()


def is_compute(node: fx.Node) -> bool:
    """A node that runs a kernel: a call that is neither a view nor a tuple lookup."""
    return node.op == "call_function" and node.target is not operator.getitem and not is_view(node)


def output_nodes(gm: fx.GraphModule) -> list[object]:
    out = gm.graph.output_node().args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def parameter_of_inputs(
    example_inputs: Sequence[object], names_by_id: Mapping[int, str]
) -> dict[int, str]:
    """Input index -> parameter name, for the example inputs that are our parameters."""
    return {
        i: names_by_id[id(t)]
        for i, t in enumerate(example_inputs)
        if isinstance(t, torch.Tensor) and id(t) in names_by_id
    }


def graph_nodes(gm: fx.GraphModule) -> tuple[NodeFact, ...]:
    """Every node of ``gm`` in order, with what the cost model prices it by."""
    return tuple(_node_fact(n, i) for i, n in enumerate(gm.graph.nodes))


def _node_fact(node: fx.Node, position: int) -> NodeFact:
    flops, nbytes = node_flops_and_bytes(node)
    inputs = tuple(n.name for n in node.all_input_nodes)
    return NodeFact(node.name, position, is_compute(node), flops, nbytes, inputs)


class _Symbolic(Exception):
    """A size that is not a constant (dynamic shapes): the node gets no estimate."""


def node_flops_and_bytes(node: fx.Node) -> tuple[int, int]:
    """FLOPs (torch's flop-counter formulas) and bytes read + written by one graph node; symbolic
    sizes give ``(0, 0)`` rather than a guard: an estimate must never change what gets compiled."""
    if node.op != "call_function":
        return 0, 0
    try:
        return _flops_and_bytes(node)
    except _Symbolic:
        return 0, 0


def _concrete(x: Any) -> int:
    """An int without specialising: a symbolic value raises ``_Symbolic`` instead of guarding."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and x.node.is_constant():
        return int(x)
    raise _Symbolic(x)


def _flops_and_bytes(node: fx.Node) -> tuple[int, int]:
    val = node.meta.get("val")
    args_vals = tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    nbytes = sum(_concrete(t.numel()) * t.element_size() for t in tree_leaves((args_vals, val)) if isinstance(t, torch.Tensor))
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in flop_registry:
        return 0, nbytes
    return _concrete(flop_registry[packet](*args_vals[0], out_val=val, **args_vals[1])), nbytes


def gradient_sources(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, ...]]:
    """Per node, the positions of the ``tangents_*`` its value is computed from. Autograd hands a
    compiled backward zeros for an output the loss did not use: a parameter whose every source was
    such an output was unused in the step, and DDP leaves its ``grad`` None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]
    bit_of = {placeholders[i]: 1 << k for k, i in enumerate(tangents)}
    mask: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        m = bit_of.get(node, 0)
        for used in node.all_input_nodes:
            m |= mask.get(used, 0)
        mask[node] = m
    return {node: tuple(i for k, i in enumerate(tangents) if m >> k & 1) for node, m in mask.items() if m}


def extract_facts(gm: fx.GraphModule, param_inputs: Mapping[int, str]) -> GraphFacts:
    """Read production order and gradient slots out of a backward graph (no mutation)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    sources = gradient_sources(gm)
    nodes = graph_nodes(gm)
    outs = output_nodes(gm)
    slots = []
    for index in sorted(param_inputs):
        if index >= len(outs):
            raise RuntimeError(
                f"graphddp: backward graph has {len(outs)} outputs but parameter "
                f"{param_inputs[index]!r} is forward input {index}; cannot map gradients"
            )
        grad = outs[index]
        if not isinstance(grad, fx.Node):
            continue  # no gradient flows to this parameter in this graph
        val = grad.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise RuntimeError(f"graphddp: gradient node {grad.name} has no tensor meta['val']")
        if val.layout != torch.strided:
            raise RuntimeError(
                f"graphddp: the gradient of {param_inputs[index]!r} is {val.layout} (sparse), which graphddp does not "
                "average (its buckets are dense); make it dense (e.g. nn.Embedding(sparse=False))"
            )
        shape = tuple(int(s) for s in val.shape)
        numel = int(val.numel())
        slots.append(
            GradSlot(
                output_index=index,
                param_name=param_inputs[index],
                shape=shape,
                dtype=dtype_name(val.dtype),
                device=str(val.device),
                numel=numel,
                nbytes=numel * val.element_size(),
                producer=grad.name,
                position=order[grad],
                sources=sources.get(grad, ()),
            )
        )
    slots.sort(key=production_order)
    return GraphFacts(nodes=nodes, slots=tuple(slots))


def autograd_nodes(outputs: Any) -> Iterator[Any]:
    """Every autograd node the tensors of ``outputs`` were computed through, once each, depth first."""
    todo = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(n for n, _ in node.next_functions)


def names_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """id(tensor) -> first name; tied parameters keep their first (canonical) name."""
    out: dict[int, str] = {}
    for name, t in named:
        out.setdefault(id(t), name)
    return out
