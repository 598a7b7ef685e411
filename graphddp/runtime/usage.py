"""Which parameters a backward got no gradient for, as DDP would leave them: ``grad`` None.

A forward output the loss did not use still reaches the compiled backward, as zeros autograd puts
in place of its missing gradient, and the graph turns them into zero gradients. DDP (and FSDP2)
leave such a parameter's ``grad`` None, so ``torch.optim`` skips it, where Adam would move it on a
zero gradient. A pre-hook on the call's autograd node (:class:`NoneOutputs`) records which output
gradients were None; a parameter whose every source was such a zero was not used by this rank, and
one OR over the ranks says which no rank used: a parameter some rank used gets the average with the
others' zeros, as in DDP. A gradient the loss multiplied by zero is still a gradient. Graphs where
every gradient depends on every output gradient are never asked (``may_be_unused``).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx

from graphddp.graph.capture import gradient_sources, output_nodes
from graphddp.runtime.agree import any_rank
from graphddp.values.schedule import Schedule


class NoneOutputs:
    """Which output gradients of a graph's next backward were None (autograd makes them zeros)."""

    def __init__(self) -> None:
        self._pattern: tuple[bool, ...] | None = None
        self._given: set[int] = set()  # the ids of the output gradients that were not None

    def note(self, grad_outputs: Any) -> None:
        if any(g is None for g in grad_outputs):
            self._pattern = tuple(g is None for g in grad_outputs)
            self._given = {id(g) for g in grad_outputs if g is not None}

    def take(self) -> tuple[tuple[bool, ...] | None, set[int]]:
        taken = self._pattern, self._given
        self._pattern, self._given = None, set()
        return taken


class GradientUsage:
    """Per graph: which parameters a backward got gradients for only from unused outputs.
    ``outputs``: each gradient's output position; ``sources``: the inputs it is computed from."""

    def __init__(self, outputs: Mapping[str, int], sources: Mapping[str, Iterable[int]]) -> None:
        self.outputs = dict(outputs)
        self.sources = {n: frozenset(s) for n, s in sources.items() if s}
        everything = frozenset().union(*self.sources.values())
        self.inputs = tuple(sorted(everything))
        self.may_be_unused = any(src != everything for src in self.sources.values())
        self._absent: dict[tuple[bool, ...], frozenset[int]] = {}

    @classmethod
    def of_schedule(cls, schedule: Schedule) -> "GradientUsage":
        """From a replicated graph's plan, whose slots carry their sources."""
        slots = [s for b in schedule.buckets for s in b.slots if not s.zero_filled]
        return cls({s.param_name: s.output_index for s in slots}, {s.param_name: s.sources for s in slots})

    @classmethod
    def of_graph(cls, gm: fx.GraphModule, names: Mapping[int, str]) -> "GradientUsage":
        """From a backward graph before any rewrite, ``names`` its parameters by output position."""
        sources, outs = gradient_sources(gm), output_nodes(gm)
        found = {i: outs[i] for i in names if i < len(outs) and isinstance(outs[i], fx.Node)}
        return cls({names[i]: i for i in found}, {names[i]: sources.get(node, ()) for i, node in found.items()})

    def unused(self, pattern: tuple[bool, ...] | None, given: set[int], args: list[Any]) -> frozenset[str]:
        """Parameters whose every gradient source was a None output gradient, on this rank."""
        if pattern is None or not self.may_be_unused:
            return frozenset()
        absent = self._absent.get(pattern)
        if absent is None:
            absent = self._absent[pattern] = frozenset(
                i for i in self.inputs
                if isinstance(args[i], torch.Tensor) and id(args[i]) not in given and not bool(args[i].any())
            )
        return frozenset(n for n, src in self.sources.items() if src <= absent)

    @staticmethod
    def unused_anywhere(names: Iterable[str], unused: frozenset[str], group: Any) -> frozenset[str]:
        """Which of ``names`` no rank used: one OR over the ranks, every rank passing the same names."""
        names = list(names)
        anywhere = any_rank([n not in unused for n in names], group)
        return frozenset(n for n, used in zip(names, anywhere) if not used)

    @staticmethod
    def drop(out: Any, outputs: Mapping[str, int], names: Iterable[str]) -> Any:
        """``out`` with the gradients of ``names`` replaced by None (autograd leaves them)."""
        names = [n for n in names if n in outputs]
        if not names:
            return out
        out = list(out)
        for n in names:
            out[outputs[n]] = None
        return out
