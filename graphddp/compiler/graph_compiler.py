"""The torch.compile backend of replicated and ``sharding="optimizer"`` models: graphddp's
forward and backward passes on every graph AOTAutograd splits a Dynamo graph into, before it is
compiled (:mod:`graphddp.compiler.inductor`).

Under inductor its comm reordering (``raise_comms``, ``sink_waits``) issues each all-reduce when
its bucket is ready and waits late (inductor's defaults issue and wait back to back: no overlap).
``aot_eager`` runs the graphs as plain FX code (fast to compile, for tests), ``eager`` node by
node (for a debugger). A traced hook with phases (PowerSGD) gets one rewritten graph per phase,
compiled on first use.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from graphddp.compiler import cache as compile_cache
from graphddp.compiler.compose import Shared, insert_comm, record_parameter_values, run_passes, verify_comm
from graphddp.compiler.forward_slot import ForwardSlots
from graphddp.compiler.frames import FramePlans
from graphddp.compiler.front import GraphFront
from graphddp.compiler.hook_runtime import HookRuntime
from graphddp.compiler.inductor import ReplicatedCompile
from graphddp.compiler.record import CARRY, GraphRecord
from graphddp.compiler.rewrite import BackwardRewrite
from graphddp.compiler.updates import InGraphUpdates
from graphddp.config import DEFAULT_BUCKET_CAP_MB, MB, DDPConfig
from graphddp.graph.alias_outputs import copy_parameter_outputs
from graphddp.graph.bucket_function import HookContext
from graphddp.hooks.traced import HookState
from graphddp.optim.attached import AttachedOptimizer
from graphddp.runtime.dispatch import BackwardDispatch
from graphddp.runtime.gate import gate_for
from graphddp.runtime.gathers import ForwardDispatch
from graphddp.runtime.step import StepState, current_frame
from graphddp.runtime.union import UnionAverage
from graphddp.runtime.variants import GraphState, Synced
from graphddp.values.comm import group_name_of


class GraphCompiler(GraphFront, InGraphUpdates, HookRuntime, BackwardRewrite):
    """A torch.compile backend that rewrites every backward graph per the bucket plan.

    Each Dynamo graph's backward comes in variants: synchronising, local (``no_sync``) and, with
    an optimizer, without the update. Which one runs is read from the step at every forward call,
    never at compile time: the backend tells the step what ran, it never decides a step's phase."""

    def __init__(
        self,
        config: DDPConfig,
        names_by_id: Mapping[int, str],
        on_record: Callable[[GraphRecord], None],
        group: Any,
        step: StepState | None = None,
        optimizer: AttachedOptimizer | None = None,
        parameters: Mapping[str, torch.nn.Parameter] | None = None,
    ) -> None:
        super().__init__(config, names_by_id, on_record)
        self.group = group
        # Facts of the job, not options: the planner records them in every Schedule.
        self.world_size = dist.get_world_size(group)
        self.group_name = group_name_of(group)
        self.step = step if step is not None else StepState()  # the replica's: read, never written here
        self.states: list[GraphState] = []  # one per compiled graph
        self.optimizer = optimizer
        # A user's traced hook runs only where there is someone to talk to.
        self.hook = config.traced_hook if self.world_size > 1 else None
        self.hook_state = HookState(self.hook) if self.hook is not None else None
        # By name: max_grad_norm asks which hold a gradient; a carrying backward takes their .grad.
        self.parameters = dict(parameters or {})
        self._hook_context = HookContext(group, self.parameters)
        self.dispatches: dict[int, BackwardDispatch] = {}
        self.forward_slots = ForwardSlots(self.step.gathers, config.verify)  # gather="forward": the training forwards
        self.frames = FramePlans()  # what a recompile inherits from its frame's graphs
        # The passes every graph goes through: features add theirs.
        self.forward_passes: list[Any] = [record_parameter_values]
        self.backward_passes: list[Any] = [insert_comm, verify_comm] + ([self._optimizer_pass] if optimizer is not None else [])
        self.rank = dist.get_rank(group)
        # Where sharded buckets live (sharding="optimizer"): the sharded state's groups.
        sharded = getattr(optimizer, "sharded", None)
        self.placement = sharded.placement if sharded is not None else None
        if optimizer is not None and config.sharding == "optimizer":  # which buckets are sharded: before the collectives
            self.backward_passes.insert(0, self._shard_plan_pass)
        # Warnings about updates left to torch's step, once per graph and reason.
        self._warned: set[tuple[int, str]] = set()
        self.union = UnionAverage(
            group, self.parameters, _cap_bytes(config), config.comm_dtype, self.hook, self.hook_state,
            self._hook_context, lambda: [d.schedule for d in self.dispatches.values()],
        )
        self.step.carry_ready = lambda index: index in self.dispatches and self.dispatches[index].can_carry
        self.step.on_end_of_step(self._union_end_of_step)  # first: the others read the averages
        if self.hook is not None:
            self.step.on_end_of_step(self._hook_end_of_step)

    def before_call(self, index: int, param_inputs: Mapping[int, str], renamed: dict[str, str] | None) -> bool:
        """Does this call run the synchronising backward? gather="forward": what another graph's
        backward left pending is gathered first. A traced hook refuses a call with other parameters."""
        syncing = self.step.graph_syncs()
        if renamed and self.hook is not None:
            raise RuntimeError(
                f"graphddp: comm_hook {self.hook.name!r}: Dynamo runs one compiled graph for several modules' parameters "
                "(their parent's frame runs eagerly, e.g. after a graph break inside a loop), and a traced hook's state "
                "belongs to one bucket of parameters; remove the graph break from the loop, or use a built-in comm_hook"
            )
        if self.step.gathers:
            names = renamed.values() if renamed else param_inputs.values()
            self.step.gathers.before_graph(index, names, own=not renamed and index in self.forward_slots)
        return syncing

    def wants_node(self, syncing: bool, noting: bool, renamed: dict[str, str] | None) -> bool:
        step = self.step
        return bool(step.track_runs or not syncing or noting or renamed or step.carrying)

    def forward_ran(self, index: int, node: Any, syncing: bool, renamed: dict[str, str] | None) -> None:
        """The step's record of the call; a renamed call tells its backward which parameters it reduces."""
        state = self.states[index]
        if node is not None and renamed:
            node.register_prehook(lambda _grads, names=renamed: state.rename_next(names))
        self.step.forward_ran(index, node, syncing, renamed)
        if syncing and node is not None:
            self.refuse_split_gradients(index)
        if not syncing and node is not None:
            node.register_prehook(state.mark_local)

    def compile_graph(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], param_inputs: Mapping[int, str], patches: dict[str, Any],
        graph_index: int,
    ) -> Callable[..., Any]:
        self.step.add_graph(current_frame(), param_inputs.values())  # the step's entry ``graph_index``: one per graph
        state = GraphState()
        self.states.append(state)
        copy_parameter_outputs(gm, param_inputs)  # their gradients then go through the buckets
        shared = Shared()  # what this graph's forward passes hand its backward passes

        def record_forward(fw: fx.GraphModule) -> None:
            like = self.frames.like(self._frame(graph_index), param_inputs.values())
            run_passes(self.forward_passes, fw, like, param_inputs=param_inputs, shared=shared, graph_index=graph_index)
            self.on_record(GraphRecord(None, fw, kind="forward", index=graph_index))

        phases = self.hook.phases if self.hook is not None else ("sync",)  # keys of self._phase()

        def rewrite(bw: fx.GraphModule) -> dict[str, GraphRecord]:
            """One record per phase, each from its own copy of the untouched graph, and the
            carrying variant (:data:`CARRY`) where a step after ``no_sync`` can carry."""
            carrying = copy.deepcopy(bw) if self.carries() and not self.gates() else None  # before the rewrite edits bw
            graphs = [copy.deepcopy(bw) for _ in phases[1:]] + [bw]
            records = {
                phase: self.rewrite_backward(g, param_inputs, graph_index, shared.fw_values, phase=phase)
                for phase, g in zip(phases, graphs)
            }
            if carrying is not None and self.carries_for(records[phases[-1]].schedule):
                records[CARRY] = self.rewrite_backward(carrying, param_inputs, graph_index, shared.fw_values, carry=True)
                records[CARRY].kind = CARRY
            return records

        def dispatch(
            records: dict[str, GraphRecord], compile_synced: Callable[[GraphRecord], Callable[[], Any]],
            compile_grads: Callable[[GraphRecord], Callable[[], Any]], compile_plain: Callable[[], Any],
            compiled: dict[str, Any], derive_carry: Callable[[], Callable[[], Any] | None] | None = None,
        ) -> BackwardDispatch:
            """``derive_carry``: a cache hit's way to the carrying variant its entry does not
            hold (compiled from the hit's one cold derivation, on first use)."""
            main = records[phases[-1]]  # the steady state is what people inspect
            by_phase = {phase: record for phase, record in records.items() if phase != CARRY}
            if len(by_phase) > 1:
                main.phases = dict(by_phase)
            main.index = graph_index
            self.on_record(main)
            variants = {
                phase: Synced(
                    record.schedule, compile_synced(record), self._in_graph_update(record, graph_index, compile_grads(record)),
                    self._hook_args(record, graph_index), compiled.get(phase),
                )
                for phase, record in records.items()
            }
            carry = variants.pop(CARRY, None)
            if carry is not None:
                main.variants[CARRY] = records[CARRY]
            elif derive_carry is not None and self.carries_for(main.schedule) and not main.schedule.gated:  # as a cold compile decides
                carry = Synced(main.schedule, lambda: derive_carry()())
            self.dispatches[graph_index] = BackwardDispatch(
                state, variants, compile_plain, self.group, self.step, self._phase, self._on_sync if self.hook else None,
                carry=carry, parameters=self.parameters,
                gate_carries=main.schedule.gated and self.carries_for(main.schedule),
                gate=gate_for(self.group) if main.schedule.gated else None,
            )
            update = variants[phases[-1]].update
            if graph_index in self.forward_slots and update is not None and update.deferred_shards:
                self.forward_slots.planned(graph_index, update.deferred_shards)
            return self.dispatches[graph_index]

        gathers = self.optimizer is not None and self.config.gather == "forward"  # each training forward: a dispatcher
        wrap_forward = functools.partial(self.forward_slots.wrap, graph_index, param_inputs=param_inputs) if gathers else None

        phase, cache = self._phase(), None
        if self.config.backend == "inductor":
            cache = compile_cache.plan_key(self, gm, example_inputs, param_inputs, graph_index, phase)
        compiled = ReplicatedCompile(
            self.config.backend, gm, record_forward, rewrite, dispatch, patches, phase, graph_index, cache, wrap_forward
        ).compile(example_inputs)

        def noting() -> bool:
            """May the backward leave a parameter unused (until its first backward: yes)?"""
            made = self.dispatches.get(graph_index)  # at the first backward
            return made is None or made.usage.may_be_unused

        return self.runtime(compiled, graph_index, param_inputs, example_inputs, state.none_outputs, noting)

    @property
    def forwards(self) -> dict[int, ForwardDispatch]:
        """gather="forward": each training graph's forward dispatcher (for people and tests)."""
        return self.forward_slots.forwards


def _cap_bytes(config: DDPConfig) -> float:
    """The union average's bucket size: the user's cap, or DDP's default under an auto plan."""
    cap = config.bucket_cap_mb
    return float(cap if isinstance(cap, (int, float)) else DEFAULT_BUCKET_CAP_MB) * MB
