"""``sharding="full"``'s optimizer inside the backward: the variant of each backward graph that
updates its parts (:mod:`graphddp.optim.insert_part_update`), and at every backward the choice
between it and the graph as compiled, which returns the parts' gradients to torch's
``opt.step()``.

The user's loop does not change: ``opt.step()`` and ``opt.zero_grad()`` stay torch's. A part
updated inside the backward has no gradient (``grad`` None), and torch's optimizers skip a
parameter without one, so ``opt.step()`` steps exactly the parts the backward left to it. The
update reads the hyperparameters from ``opt.param_groups`` at each backward (an LR scheduler
stepped after the last ``opt.step()`` is in force, as it would be for that ``opt.step()``), and
the state where torch keeps it (``opt.state[part]``), so ``state_dict()`` and a plain optimizer
interchange.

A backward updates inside where that is the whole step for its parts. Where a part holds a
gradient accumulated by earlier micro-steps (the synchronising micro-step after ``no_sync``),
the carrying variant adds it to this backward's gradient, updates, and leaves the part none. Otherwise the
backward returns the gradients and ``opt.step()`` steps them (``FullyShardedGraphDDP.updates``
counts each case: ``"inside"``, ``"inside, carried"``, or the reason):

* ``"no_sync"``: a micro-step under ``no_sync()`` or ``require_backward_grad_sync = False``
  accumulates (a reduce-scatter per micro-step, as before);
* ``"ran twice"``: the graph's forward ran more than once before this backward;
* ``"shared"``: another graph of this step reads one of its parts (a weight tied across a graph
  break), and either its backward is still to come or it returned that part's share already
  (which autograd may add to ``p.grad`` only after this backward has begun, so it is not
  carried);
* ``"other parts"``: Dynamo ran the graph for other modules' parts than it was compiled for
  (their parent's frame runs eagerly), so the state passed by name would be another part's;
* ``"unused"``: no rank used one of its parts this step (an output the loss left out): that
  part's gradient is returned as None and ``opt.step()`` skips it, as it skips a parameter DDP
  leaves without one (:mod:`graphddp.runtime.usage`).
* ``"scaler"``: an enabled ``GradScaler`` scaled the loss (:mod:`graphddp.optim.scaled_step`):
  its ``unscale_``, inf check (agreed across ranks) and ``step`` come after the backward.

Not inside the backward at all (every step through ``opt.step()``): optimizer classes other
than ``torch.optim`` SGD, Adam and AdamW, and ``max_grad_norm`` (the global norm needs every
gradient before any update). Refused by name, as for the replicated optimizer inside
(:mod:`graphddp.optim.guards`): ``clip_grad_norm_`` on the parts (``max_grad_norm=`` does it).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from graphddp.graph.part_facts import input_name
from graphddp.graph.verify_full import check_part_updates
from graphddp.optim import guards
from graphddp.optim.attached import AttachedOptimizer
from graphddp.optim.insert_part_update import insert_part_updates
from graphddp.optim.insert_update import UpdateInputs


@dataclasses.dataclass(frozen=True)
class UpdatingBackward:
    """One backward graph's update variants: the graph that updates its parts, the one that
    adds what they accumulated first (``carrying``: one more input per part), the parts they
    update (in the order of their update inputs) and their param groups."""

    graph: fx.GraphModule
    carrying: fx.GraphModule
    names: tuple[str, ...]
    groups: tuple[int, ...]


Compile = Callable[[], Callable[[list], Any]]  # a variant's compiled code, compiled at the first call if not before


class PartUpdates:
    """The parts' optimizer inside the backward graphs of one fully sharded module (module
    docstring): the rewrite at compile time, the choice at each backward, the counts."""

    def __init__(self, attached: AttachedOptimizer, syncing: Callable[[], bool], verify: bool) -> None:
        self.attached = attached
        self.syncing = syncing  # require_backward_grad_sync, read at each forward
        self.verify = verify
        self.forward_values: dict[int, dict[str, Any]] = {}  # per Dynamo graph: its parts' fake values
        self.parts_of: dict[int, frozenset[str]] = {}  # the parts each graph's forward reads
        self.pending: collections.Counter[int] = collections.Counter()  # forwards whose backward is to come
        self.foreign: collections.Counter[int] = collections.Counter()  # of those, run for other parts
        self.local: collections.Counter[int] = collections.Counter()  # of those, run under no_sync (read at the forward, as DDP reads it)
        # Parts whose gradient a backward of this backward pass returned: autograd may add it to
        # p.grad only after a later graph's backward has begun (seen on a weight tied across a graph break).
        self.returned: set[str] = set()
        self.counts: collections.Counter[str] = collections.Counter()  # "inside" or a reason

    @staticmethod
    def of(optimizer: torch.optim.Optimizer, module: torch.nn.Module, syncing: Callable[[], bool], verify: bool,
           max_grad_norm: float | None) -> "PartUpdates | None":
        """The updates for ``optimizer`` (already over the parts), or None where it cannot run
        inside the backward (module docstring)."""
        if max_grad_norm is not None:
            return None
        try:
            attached = AttachedOptimizer(optimizer, module, "graphddp.compile")
        except (TypeError, ValueError):
            return None
        updates = PartUpdates(attached, syncing, verify)
        optimizer.register_step_post_hook(lambda *_: updates.step_done())
        attached.after_scaler_step = (updates.step_done,)  # a step GradScaler skipped ends the step too
        guards.watch(attached)  # clipping the parts' p.grad is refused by name; an enabled GradScaler marks the step
        return updates

    def step_done(self) -> None:
        """``opt.step()`` ended the step: a forward whose backward never ran (a graph whose
        outputs the loss does not read) no longer counts as pending."""
        for counter in (self.pending, self.foreign, self.local):
            counter.clear()
        self.returned.clear()

    # -- compile time ------------------------------------------------------------------------------
    def forward_compiled(self, index: int, gm: fx.GraphModule, names: Mapping[str, str]) -> None:
        """Keep the fake values of the parts a forward graph reads (their storages: what a
        backward input aliasing one is found by)."""
        values = {names[n.name]: n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and n.name in names}
        self.forward_values[index] = values
        self.parts_of[index] = frozenset(values)

    def backward_variant(self, index: int, gm: fx.GraphModule, names: Mapping[str, str]) -> UpdatingBackward | None:
        """``gm`` (placed, checked) with its parts' updates, on a copy; None when it updates none."""
        outs = gm.graph.output_node().args[0]
        if not isinstance(outs, (list, tuple)):
            return None
        grads = {i: names[input_name(i)] for i in range(len(outs)) if input_name(i) in names}
        values = dict(self.forward_values.get(index, {}))
        for node in gm.graph.nodes:  # a part the backward reads: its own input's value
            if node.op == "placeholder" and node.name in names:
                values[names[node.name]] = node.meta["val"]
        stepped = [n for n in grads.values() if n in values and self.attached.rule(n) is not None]  # the optimizer holds them
        if not stepped:
            return None
        inputs = UpdateInputs(
            rules={n: self.attached.rule(n) for n in stepped},  # type: ignore[misc]
            groups={n: self.attached.group_of[n] for n in stepped},
            values={n: values[n] for n in stepped},
        )
        mine = {i: n for i, n in grads.items() if n in inputs.rules}
        variant, carrying = copy.deepcopy(gm), copy.deepcopy(gm)
        updated = insert_part_updates(variant, mine, inputs)
        if not updated:
            return None
        insert_part_updates(carrying, mine, inputs, carry=True)
        if self.verify:
            for graph in (variant, carrying):
                check_part_updates(graph, {i: n for i, n in grads.items() if n in updated})
        groups = tuple(sorted({self.attached.group_of[n] for n in updated}))
        return UpdatingBackward(variant, carrying, tuple(updated), groups)

    # -- run time ----------------------------------------------------------------------------------
    def forward_ran(self, index: int, inputs: Sequence[Any], part_ids: Mapping[int, int]) -> None:
        """Graph ``index``'s forward ran for training: one more backward to come, under
        ``no_sync`` or not, and with other parts than ``part_ids`` (input position -> id) it was
        compiled for or not."""
        self.pending[index] += 1
        if not self.syncing():
            self.local[index] += 1
        if any(i < len(inputs) and id(inputs[i]) != pid for i, pid in part_ids.items()):
            self.foreign[index] += 1

    def backward(self, index: int, variant: UpdatingBackward, plain: Compile, updating: Compile, carrying: Compile) -> Callable[[list], Any]:
        """What AOTAutograd runs as graph ``index``'s backward: where the update inside is the
        whole step for its parts, the updating variant (or, where they hold gradients
        accumulated before, the carrying one, which adds them and leaves them none); else the
        graph as compiled, returning their gradients to ``opt.step()``."""
        params = [self.attached.params[n] for n in variant.names]

        def run(args: list, unused: frozenset[str] = frozenset()) -> Any:
            why = "unused" if unused.intersection(variant.names) else self._why_not(index, variant.names)
            try:
                if why is not None:
                    self.counts[why] += 1
                    self._returning(self.parts_of.get(index, frozenset()))
                    return plain()(args)
                extra = self.attached.update_args(variant.names, variant.groups)
                args.extend(extra.tensors)  # the same list: the callee frees what it no longer needs
                held = [p.grad for p in params]
                if all(g is None for g in held):
                    out = updating()(args)
                    self.counts["inside"] += 1
                else:
                    args.extend(g if g is not None else torch.zeros_like(p) for g, p in zip(held, params))
                    del held
                    out = carrying()(args)
                    for p in params:
                        p.grad = None  # added in, and stepped
                    self.counts["inside, carried"] += 1
                self.attached.updated(extra)
                return out
            finally:
                self.pending[index] -= 1
                self.foreign[index] = min(self.foreign[index], self.pending[index])
                self.local[index] = min(self.local[index], self.pending[index])

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _returning(self, names: frozenset[str]) -> None:
        """``names``' gradients are returned by a backward now: until this backward pass ends
        (when autograd has added every returned gradient), no later graph updates them."""
        if not self.returned:
            torch.autograd.Variable._execution_engine.queue_callback(self.returned.clear)
        self.returned |= names

    def _why_not(self, index: int, names: Sequence[str]) -> str | None:
        """None when the update inside is the whole step for ``names``, else the reason."""
        mine = set(names)
        if self.attached.scaled:
            return "scaler"
        if self.local[index]:
            return "no_sync"
        if self.pending[index] != 1:
            return "ran twice"
        if self.foreign[index]:
            return "other parts"
        if mine & self.returned or any(self.pending[h] > 0 and self.parts_of.get(h, frozenset()) & mine for h in self.pending if h != index):
            return "shared"
        return None
