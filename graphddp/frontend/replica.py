"""One rank's replica of a data-parallel model (replicated and ``sharding="optimizer"``): the work
around every forward call.

DDP does at forward time what no compiled graph can: it broadcasts buffers (``broadcast_buffers``)
and, once a synchronising forward begins, starts averaging gradients accumulated under ``no_sync``;
and in graphddp a parameter no compiled graph of the forward covers must not keep an un-averaged
gradient. :class:`Replica` does that work in both forms, between the compiled forward's two
Dynamo-disabled calls, :meth:`Replica.before_forward` and :meth:`Replica.after_forward`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, JoinHook

from graphddp.compiler.graph_compiler import GraphCompiler
from graphddp.compiler.record import GraphRecord
from graphddp.config import DDPConfig
from graphddp.frontend.ddp_hooks import as_comm_hook
from graphddp.frontend.mesh import MeshGroups
from graphddp.frontend.wrap import ModelState, check_optimizer
from graphddp.graph.capture import autograd_nodes, names_by_identity
from graphddp.optim.attached import AttachedOptimizer
from graphddp.optim.shard import ShardedState
from graphddp.runtime.join import JoinState, join, join_hook
from graphddp.runtime.step import StepState
from graphddp.runtime.sync import PendingAverage, average_async, broadcast_tensors
from graphddp.values.schedule import Schedule


class Replica(ModelState):
    """Whole replicas: the module's own parameters, an attached optimizer's state whole or, with
    ``sharding="optimizer"``, this rank's part of every bucket's."""

    optimizer: AttachedOptimizer | None

    def __init__(self, module: nn.Module, groups: MeshGroups, config: DDPConfig, optimizer: AttachedOptimizer | None) -> None:
        super().__init__(module, groups.whole, config, optimizer)
        if optimizer is not None:
            optimizer.attach()
            if config.sharding == "optimizer":
                optimizer.sharded = ShardedState(
                    optimizer.optimizer, optimizer.params, optimizer.rules, optimizer.group_of, groups.shard, groups.placement
                )
        self.records: list[GraphRecord] = []  # every compiled graph's, in order
        self._build(config)
        self._hook_registered = False  # register_comm_hook was called (DDP allows it once)
        self._forwards_began = False  # register_comm_hook comes before the first forward, as in DDP
        self._guard_handles: dict[str, Any] = {}
        self._pending: PendingAverage | None = None
        self._syncing = True
        if optimizer is not None and config.gather == "forward":
            self._finish_gathers_on_checkpoints()

    @staticmethod
    def checked_optimizer(where: str, module: nn.Module, config: DDPConfig, optimizer: Any) -> AttachedOptimizer | None:
        """Attached (compiled into the backward) once the wrap's collectives are done."""
        return AttachedOptimizer(optimizer, module, where, config.max_grad_norm, config.grad_norm_type) if optimizer is not None else None

    def _build(self, config: DDPConfig, sync: bool = True) -> None:
        """The step and the compiler for ``config``; again when :meth:`register_comm_hook` changes
        the hook before anything ran (only ``sync``, the user's switch, has state yet)."""
        self.config = config
        # Which graphs ran is asked only by the optimizer inside the backward and by a traced hook.
        self.step = StepState(track_runs=self.optimizer is not None or config.traced_hook is not None)
        self.step.set_sync(sync)
        self.step.set_accumulated_average(self._average_accumulated)
        self.backend = GraphCompiler(
            config, names_by_identity(self.module.named_parameters()), self.records.append, self.group,
            step=self.step, optimizer=self.optimizer, parameters=dict(self.module.named_parameters()),
        )
        if self.optimizer is not None:
            self.step.on_end_of_step(self.optimizer.finish)

    def _average_accumulated(self, shadow: bool) -> None:
        """Average the gradients accumulated under ``no_sync`` now (a joined rank: zeros), for a
        step that cannot carry them into its buckets."""
        average_async(self._trainable(), self.group, shadow=shadow).wait()

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def compile_graph(self, gm: Any, example_inputs: Any, **compile_kwargs: Any) -> Any:
        return self.backend(gm, example_inputs, **compile_kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's hook made a ``comm_hook=`` value: once, before the first forward (it is compiled
        into every backward), and not on top of ``comm_hook=``."""
        where = "register_comm_hook"
        comm_hook, what = as_comm_hook(where, state, hook, self.group)
        if self._hook_registered:
            raise RuntimeError(f"{where}: a communication hook can only be registered once (as in DDP); {what} is the second")
        if self._forwards_began:
            raise RuntimeError(
                f"{where}: {what} must be registered before the first forward (as in DDP): graphddp compiles the hook "
                "into each backward graph when the first forward compiles it"
            )
        if self.config.comm_hook is not None:
            given = self.config.traced_hook.name if self.config.traced_hook is not None else repr(self.config.comm_hook)
            raise ValueError(
                f"{where}: this model was compiled with comm_hook={given}; registering {what} as well would be a second "
                "hook: pass one of them (comm_hook= to graphddp.compile, or register_comm_hook), not both"
            )
        config = dataclasses.replace(self.config, comm_hook=comm_hook)
        check_optimizer(where, config, self.optimizer)
        self._build(config, sync=self.step.sync)
        self._hook_registered = True

    def _finish_gathers_on_checkpoints(self) -> None:
        """gather="forward": any parameter-holding submodule's state dict calls first complete the
        pending all-gathers, so a checkpoint holds the updated values and a late write cannot
        overwrite a load."""
        def finish(*_: Any, **__: Any) -> None:
            self.step.gathers.finish()

        for sub in self.module.modules():
            if any(True for _ in sub.parameters(recurse=False)):
                sub.register_state_dict_pre_hook(finish)
                sub.register_load_state_dict_pre_hook(finish)

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def schedules(self) -> list[Schedule]:
        return [r.schedule for r in self.records if r.kind == "backward"]

    @property
    def hook_state(self) -> Any:
        return self.backend.hook_state

    def finish_gathers(self) -> None:
        self.step.gathers.finish()

    def join(self, view: Any, *args: Any) -> Join:
        self.finish_gathers()
        return join(view, *args)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return join_hook(self, **kwargs)

    def _whole_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        """Its own state, or with ``sharding="optimizer"`` this rank's part of every bucket's."""
        assert self.optimizer is not None, "graphddp.frontend.api._state_of refuses a model without optimizer="
        self.finish_gathers()  # gather="forward": the parameters as the state describes them
        sharded = self.optimizer.sharded
        return self.optimizer.optimizer, None if sharded is None else sharded.whole_state

    def before_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Broadcast buffers; start averaging gradients accumulated under ``no_sync``; inside
        ``join()``, tell the joined ranks what this step does."""
        distributed = self.world_size > 1
        step = self.step
        self._forwards_began = True
        step.begin_forward()
        self._syncing = step.sync and torch.is_grad_enabled()
        buffers = self.buffers_to_broadcast()
        eager_hook = distributed and self._syncing and step.accumulated and self.backend.hook_runs_now()
        pending = distributed and self._syncing and step.accumulated and not eager_hook
        if pending and self.backend.carries():  # the backward's buckets average them: nothing to do now
            step.carry_accumulated()
            pending = False
        source = 0
        config = getattr(self.joinable, "_join_config", None)
        in_join = distributed and config is not None and config.enable
        step.allow_headers(not in_join)  # a joined rank shadows the classic agreement only
        if in_join:
            Join.notify_join_context(self.joinable)
            state = JoinState.exchange(self, (self._syncing, bool(buffers), pending, eager_hook), active=True)
            source = state.buffer_source
        if buffers:
            broadcast_tensors(buffers, self.group, source)
        if eager_hook:
            step.hook_accumulated()  # a user's hook must see the accumulated total
        elif pending:
            self._pending = average_async(self._trainable(), self.group)  # hidden behind the forward
        return args, kwargs

    def after_forward(self, out: Any) -> Any:
        """Finish the average; guard parameters no compiled graph of this forward covered."""
        step = self.step
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            step.accumulated_averaged()
        step.gathers.finish()  # gather="forward": those no graph of this forward took
        # One walk of the module per forward, for both checks below (it finds none in the steady state).
        checks = step.carrying or (torch.is_grad_enabled() and self._syncing and self.world_size > 1)
        uncovered = [(name, p) for name, p in self._trainable() if name not in step.ran_params] if checks else []
        if step.carrying and any(p.grad is not None for _, p in uncovered):
            step.block_carry()  # an accumulated gradient no graph of this step takes into a bucket
        if torch.is_grad_enabled():
            self._guard_uncovered_parameters(self._syncing, out, uncovered)
            if self._syncing and self.world_size > 1:
                self._take_returned_parameters(out)
            if not step.sync:
                step.accumulate()
        self.forward_synchronised(self._syncing)
        return out

    def _take_returned_parameters(self, out: Any) -> None:
        """A parameter the forward returns as it is (or an eager view of it) gets its gradient past
        the buckets, as Dynamo hands it back without a graph: the step takes it as eager code's,
        averaged at the step's end. (A view made inside a graph: :mod:`graphddp.graph.alias_outputs`.)"""
        from torch.utils._pytree import tree_leaves

        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_leaf or t._base is not None)]
        if not leaves:
            return
        params = {id(p): (name, p) for name, p in self.module.named_parameters()}
        for t in leaves:
            found = params.get(id(t if t._base is None else t._base))
            if found is not None and found[0] not in self.step.eager:
                self.step.expect_eager_gradient(found[0], found[1].grad)

    def _guard_uncovered_parameters(self, syncing: bool, out: Any, uncovered_params: list[tuple[str, Any]]) -> None:
        """Average, or fail loudly on, gradients produced outside the compiled graphs that ran.

        A parameter no compiled graph of this forward covers (eager code between graph breaks, a
        frame Dynamo ran eagerly) would get a gradient nobody averages. If ``out`` depends on it
        (an autograd walk, as DDP's ``find_unused_parameters``), the step takes it as eager and
        averages it at its end (:mod:`graphddp.runtime.union`); any other gets a hook that raises
        if a gradient reaches it. Nothing runs in the steady state.
        """
        step = self.step
        covered = step.ran_params
        for name, (_, handle) in list(self._guard_handles.items()):
            if name in covered or not syncing:
                handle.remove()
                del self._guard_handles[name]
        if self.world_size == 1 or not syncing:
            return
        uncovered = {id(p): (name, p) for name, p in uncovered_params}
        if not uncovered:
            return
        reached = _reached_parameters(out, set(uncovered))
        for key, (name, p) in uncovered.items():
            kind = "eager" if key in reached else "error"
            if kind == "eager":
                step.expect_eager_gradient(name, p.grad)
            held = self._guard_handles.get(name)
            if held is not None and held[0] == kind:
                continue
            if held is not None:
                held[1].remove()
            # An eager gradient ends the step even where no backward graph runs (a frame Dynamo
            # ran eagerly as a whole): the end of the step averages it.
            hook = (lambda _p: step.queue_end()) if kind == "eager" else _uncovered_error(name)
            self._guard_handles[name] = (kind, p.register_post_accumulate_grad_hook(hook))


def _reached_parameters(out: Any, wanted: set[int]) -> set[int]:
    """Which of the tensors with ids ``wanted`` the autograd graph of ``out`` leads to."""
    found: set[int] = set()
    for node in autograd_nodes(out):
        if found == wanted:
            break
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if variable is not None and id(variable) in wanted:
            found.add(id(variable))
    return found


def _uncovered_error(name: str) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        raise RuntimeError(
            f"graphddp: parameter {name!r} received a gradient outside graphddp's compiled "
            "graphs, though the forward's output does not depend on it (used in the loss outside "
            "the forward?), so nothing was set up to average it across ranks. Use it inside the "
            "model's forward."
        )

    return hook
