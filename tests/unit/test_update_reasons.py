"""StepState.not_inside: the one vocabulary of reasons an optimizer update does not run inside
a backward graph, in its order, over the step's record of forwards and backwards (the
replicated optimizer and sharding="full" both ask it)."""
from __future__ import annotations

import torch

from graphddp.runtime.step import StepState


class _Id(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


def _node() -> torch.Tensor:
    """An output whose autograd node, like a compiled graph's, can be held weakly."""
    return _Id.apply(torch.ones(1, requires_grad=True))


def _step(*params: set[str]) -> StepState:
    step = StepState()
    for names in params:
        step.add_graph(None, names)
    return step


def _kind(step: StepState, index: int = 0, names: tuple[str, ...] = ("a", "b"), **kw) -> str | None:
    reason = step.not_inside(index, names, scaled=kw.pop("scaled", False), **kw)
    return None if reason is None else reason.kind


def test_one_forward_one_backward_updates_inside() -> None:
    step, out = _step({"a", "b"}), _node()
    step.record_run(0, out.grad_fn)
    assert _kind(step) is None


def test_each_reason_and_what_it_names() -> None:
    step, outs = _step({"a", "b"}, {"b", "c"}), [_node(), _node()]
    step.record_run(0, outs[0].grad_fn)
    assert _kind(step, held=("b",)) == "accumulated"
    assert step.not_inside(0, ("a", "b"), scaled=False, unused=frozenset({"b", "z"})).names == ("b",)
    step.record_run(1, outs[1].grad_fn)  # graph 1 reads b too, and runs in this step
    shared = step.not_inside(0, ("a", "b"), scaled=False)
    assert (shared.kind, shared.names) == ("shared", ("b",)) and shared.why
    assert _kind(step, names=("a",)) is None
    assert _kind(step, names=("a",), in_norm=lambda g: True) == "clip spans graphs"
    assert _kind(step, names=("a",), in_norm=lambda g: False) is None  # a graph that adds nothing to the norm


def test_the_record_of_the_forward_decides() -> None:
    step, outs = _step({"a"}), [_node(), _node()]
    step.record_run(0, outs[0].grad_fn, local=True)
    assert _kind(step, names=("a",)) == "no_sync"
    step.optimizer_stepped()
    step.record_run(0, outs[0].grad_fn, foreign=True)
    assert _kind(step, names=("a",)) == "other parts"
    step.record_run(0, outs[1].grad_fn)
    ran = step.not_inside(0, ("a",), scaled=False)
    assert ran.kind == "ran twice" and "2 times" in ran.why
    del outs[0]  # a forward whose output is dropped never reaches a backward
    assert _kind(step, names=("a",)) is None


ORDER = ("scaler", "unused", "no_sync", "ran twice", "other parts", "shared", "clip spans graphs", "accumulated")


def _first(facts: set[str]) -> str | None:
    """The reason given for graph 0's update of "a" in a step where ``facts`` hold."""
    step, outs = _step({"a"}, {"a"} if "shared" in facts else {"z"}), [_node() for _ in range(3)]
    step.record_run(0, outs[0].grad_fn, local="no_sync" in facts, foreign="other parts" in facts)
    if "ran twice" in facts:
        step.record_run(0, outs[1].grad_fn)
    if facts & {"shared", "clip spans graphs"}:
        step.record_run(1, outs[2].grad_fn)
    return _kind(
        step, names=("a",), scaled="scaler" in facts, unused=frozenset({"a"} if "unused" in facts else ()),
        held=("a",) if "accumulated" in facts else (), in_norm=(lambda g: True) if "clip spans graphs" in facts else None,
    )


def test_the_reasons_in_order() -> None:
    """Each reason alone, and each before every later one."""
    for i, kind in enumerate(ORDER):
        assert _first({kind}) == kind
        assert _first(set(ORDER[i:])) == kind, ORDER[i:]
    assert _first(set()) is None
