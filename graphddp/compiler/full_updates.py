"""``sharding="full"``'s optimizer inside the backward: the variant of each backward graph that
updates its parts, and at every backward the choice between it and the graph as compiled, which
returns the parts' gradients to torch's ``opt.step()``.

The user's loop does not change: ``opt.step()`` and ``opt.zero_grad()`` stay torch's. A part
updated inside the backward has no gradient (``grad`` None), and torch's optimizers skip a
parameter without one, so ``opt.step()`` steps exactly the parts the backward left to it. The
update reads the hyperparameters from ``opt.param_groups`` at each backward (an LR scheduler
stepped after the last ``opt.step()`` is in force, as it would be for that ``opt.step()``), and
the state where torch keeps it (``opt.state[part]``), so ``state_dict()`` and a plain optimizer
interchange.

A backward updates inside where that is the whole step for its parts. Where a part holds a
gradient accumulated by earlier micro-steps (the synchronising micro-step after ``no_sync``),
the carrying variant adds it to this backward's gradient, updates, and leaves the part none.
Otherwise the backward returns the gradients and ``opt.step()`` steps them, for one of the
reasons of ``StepState.not_inside``; the step counts each case (``GraphDDP.updates``).

Not inside the backward at all (every step through ``opt.step()``): optimizer classes other
than ``torch.optim`` SGD, Adam and AdamW, and ``max_grad_norm`` (the global norm needs every
gradient before any update). ``clip_grad_norm_`` on the parts is refused by name, as for the
replicated optimizer inside (``max_grad_norm=`` does it).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from graphddp.compiler.record import GraphRecord
from graphddp.graph.part_facts import input_name
from graphddp.graph.verify import check_part_updates
from graphddp.optim import guards
from graphddp.optim.attached import AttachedOptimizer
from graphddp.optim.insert_update import UpdateInputs, insert_part_updates, written_inputs
from graphddp.runtime.step import NotInside, StepState
from graphddp.runtime.variants import InGraphUpdate


@dataclasses.dataclass(frozen=True)
class UpdatingBackward:
    """One backward graph's update variants: the graph that updates its parts, the one that
    adds what they accumulated first (``carrying``: one more input per part), and the parts they
    update (in the order of their update inputs)."""

    graph: fx.GraphModule
    carrying: fx.GraphModule
    names: tuple[str, ...]


Compile = Callable[[], Callable[[list], Any]]  # a variant's compiled code, compiled at the first call if not before


def part_values(gm: fx.GraphModule, names: Mapping[str, str]) -> dict[str, Any]:
    """The fake values of the parts ``gm`` reads, by part name (``names``: input name -> part)."""
    return {names[n.name]: n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if n.name in names}


def part_gradients(gm: fx.GraphModule, names: Mapping[str, str]) -> dict[int, str]:
    """A backward's outputs that are parts' gradients (input ``i``'s at output ``i``), by index."""
    outs = gm.graph.output_node().args[0]
    count = len(outs) if isinstance(outs, (list, tuple)) else 1
    return {i: names[input_name(i)] for i in range(count) if input_name(i) in names}


class PartUpdates:
    """The parts' optimizer inside the backward graphs of one fully sharded module (module
    docstring): the rewrite at compile time, the choice at each backward, the counts."""

    def __init__(self, attached: AttachedOptimizer, step: StepState, verify: bool) -> None:
        self.attached = attached
        self.step = step  # the model's: require_backward_grad_sync, the forwards whose backward is to come, the counts
        self.verify = verify
        self.forward_values: dict[int, dict[str, Any]] = {}  # per Dynamo graph: its parts' fake values
        self.entries: dict[int, int] = {}  # Dynamo graph -> its entry in the step (reading its parts)
        self.warned: set[tuple[int, str]] = set()  # (graph, reason) warned of once (GraphRecord.fell_back)

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, module: torch.nn.Module, step: StepState, verify: bool,
           max_grad_norm: float | None) -> "PartUpdates | None":
        """The updates for ``optimizer`` (already over the parts), or None where it cannot run
        inside the backward (module docstring)."""
        if max_grad_norm is not None:
            return None
        try:
            attached = AttachedOptimizer(optimizer, module, "graphddp.compile")
        except (TypeError, ValueError):
            return None
        updates = PartUpdates(attached, step, verify)
        # opt.step() ends the step; so does one GradScaler skipped
        optimizer.register_step_post_hook(lambda *_: updates.step.optimizer_stepped())
        attached.after_scaler_step = (updates.step.optimizer_stepped,)
        guards.watch(attached)  # clipping the parts' p.grad is refused by name; an enabled GradScaler marks the step
        return updates

    # -- compile time ------------------------------------------------------------------------------
    def forward_compiled(self, index: int, gm: fx.GraphModule, names: Mapping[str, str]) -> None:
        """Keep the fake values of the parts a forward graph reads (their storages: what a
        backward input aliasing one is found by)."""
        values = self.forward_values[index] = part_values(gm, names)
        self.entries[index] = self.step.add_graph(None, values).index

    def backward_variant(self, index: int, gm: fx.GraphModule, names: Mapping[str, str]) -> UpdatingBackward | None:
        """``gm`` (placed, checked) with its parts' updates, on a copy; None when it updates none."""
        if not isinstance(gm.graph.output_node().args[0], (list, tuple)):
            return None
        grads = part_gradients(gm, names)
        values = {**self.forward_values.get(index, {}), **part_values(gm, names)}  # a part the backward reads: its own input's
        stepped = [n for n in grads.values() if n in values and self.attached.rule(n) is not None]  # the optimizer holds them
        if not stepped:
            return None
        inputs = UpdateInputs.of(self.attached, stepped, values)
        variant, carrying = copy.deepcopy(gm), copy.deepcopy(gm)
        updated = insert_part_updates(variant, grads, inputs)  # the parts ``inputs`` has a rule for
        if not updated:
            return None
        insert_part_updates(carrying, grads, inputs, carry=True)
        if self.verify:
            for graph in (variant, carrying):
                check_part_updates(graph, {i: n for i, n in grads.items() if n in updated})
        return UpdatingBackward(variant, carrying, tuple(updated))

    # -- run time ----------------------------------------------------------------------------------
    def forward_ran(self, index: int, node: Any, foreign: bool) -> None:
        """Graph ``index``'s forward made ``node``, whose backward is to come: under ``no_sync``
        or not, and with other parts than it was compiled for (``foreign``) or not."""
        self.step.record_run(self.entries[index], node, local=not self.step.sync, foreign=foreign)

    def backward(
        self, index: int, variant: UpdatingBackward, plain: Compile, updating: Compile, carrying: Compile, record: GraphRecord,
    ) -> Callable[[list], Any]:
        """What AOTAutograd runs as graph ``index``'s backward: where the update inside is the
        whole step for its parts, the updating (or carrying) variant; else the graph as compiled,
        returning their gradients to ``opt.step()``, and the reason on its ``record``."""
        params = [self.attached.params[n] for n in variant.names]

        def not_inside(unused: frozenset[str]) -> NotInside | None:
            reason = self.step.not_inside(self.entries[index], variant.names, scaled=self.attached.scaled, unused=unused)
            if reason is not None:
                record.fell_back(reason.kind, reason.names, reason.why, self.warned)
            return reason

        update = InGraphUpdate(self.attached, variant.names, not_inside, plain, written_inputs(variant.graph))

        def run(args: list, unused: frozenset[str] = frozenset()) -> Any:
            entry = self.entries[index]
            self.step.synchronising_backward(entry)
            reason = update.not_inside(unused)
            if reason is not None:
                self.step.count_update(entry, reason.kind)
                return update.after(args)
            if all(p.grad is None for p in params):
                out, kind = update.inside(updating, args), "inside"
            else:
                out, kind = update.inside(carrying, args, params), "inside, carried"
            self.step.count_update(entry, kind)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run
