"""The compiler of ``sharding="full"``: each Dynamo graph through the inner compiler, with the
gathers of parts tagged for recomputation when the forward reshards.

With full sharding the collectives are in the graphs before graphddp sees them: every
parameter read is an all-gather of the ranks' parts (:mod:`graphddp.frontend.parts`) and
AOTAutograd derives its reduce-scatter in the backward. What this module adds is which graph
gathers what (forward only, or again in the backward), where in each graph the collectives are
issued and waited, in buckets (kept in that order by inductor), the check of that placement,
what each graph does, and each backward's variant that updates its parts. The buckets' cap is
planned per graph from the cost model unless ``bucket_cap_mb`` gives one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.custom_graph_pass import CustomGraphPass

from graphddp.compiler.aot import Compiler, Passes, compile_aot
from graphddp.compiler.front import GraphFront
from graphddp.compiler.full_updates import Compile, PartUpdates, UpdatingBackward, part_gradients
from graphddp.compiler.record import UPDATING, GraphRecord
from graphddp.config import MB, DDPConfig
from graphddp.config.inductor_settings import INDUCTOR_FX_ORDER_CONFIG
from graphddp.graph import reshard
from graphddp.graph.describe_parts import describe_part_collectives
from graphddp.graph.part_collectives import place_part_collectives
from graphddp.graph.part_facts import input_name, whole_bytes
from graphddp.graph.reshard import Kept, tag_regathers
from graphddp.graph.verify_common import VerificationError
from graphddp.graph.verify import check_part_collectives
from graphddp.plan.parts import planned_cap_bytes
from graphddp.runtime.agree import layout_hash
from graphddp.runtime.usage import GradientUsage, NoneOutputs
from graphddp.values.part_schedule import PartCap, PartGraph
from graphddp.values.placement import Placement, Whole


@dataclasses.dataclass
class Compiled:
    """What the compiler of one fully sharded module keeps: a record of every compiled forward and
    backward graph with its plan (its buckets as planned and placed: ``model.schedules``) and a
    backward's variant that updates its parts (:data:`UPDATING`). ``names_by_id``: the parts'
    names, by the id of the part Dynamo passes as a graph input. ``updates``: the optimizer
    inside the backward, None where it steps after it."""

    names_by_id: Mapping[int, str]
    world_size: int  # the ranks a part is cut over (the shard group's)
    updates: PartUpdates | None = None
    group: Any = None  # every rank's process group: what they agree over (an unused part)
    placement: Placement | None = None  # where the parts' gradients are averaged (hybrid: the replicate group too)
    replicated: Whole | None = None  # where the gradients of parameters held whole are averaged (replicate_below_mb)
    records: list[GraphRecord] = dataclasses.field(default_factory=list)
    reads: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # per Dynamo graph: the parts it reads
    ran: list[int] = dataclasses.field(default_factory=list)  # the Dynamo graphs called since the ranks last agreed
    layouts: dict[int, tuple[tuple, int]] = dataclasses.field(default_factory=dict)  # per Dynamo graph: what it sends, its hash

    def take_ran(self) -> tuple[list[tuple], int]:
        """What the graphs called since the last agreement sent, and its hash, taken
        (:meth:`FullyShardedState._check_same_forward`): a training graph's forward buckets as
        placed, an inference graph's parts read (each its own gather)."""
        for index in set(self.ran) - set(self.layouts):
            forward = next((r.schedule for r in self.records if r.kind == "forward" and r.index == index), None)
            layout = ("forward", forward.wire_layout()) if forward is not None else ("inference", self.reads.get(index, ()))
            self.layouts[index] = layout, layout_hash(layout)
        ran, self.ran = self.ran, []
        return [self.layouts[i][0] for i in ran], layout_hash([self.layouts[i][1] for i in ran])


class FullyShardedCompiler(GraphFront):
    """Full sharding's passes behind the front every mode shares; a forward call is recorded while
    grad mode is on, for the parts' update inside the backward."""

    tracked = staticmethod(torch.is_grad_enabled)

    def __init__(self, config: DDPConfig, compiled: Compiled) -> None:
        super().__init__(config, compiled.names_by_id, compiled.records.append)
        self.compiled = compiled
        self.updates = compiled.updates
        self.optimizer = None if compiled.updates is None else compiled.updates.attached

    def compile_graph(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], param_inputs: Mapping[int, str], patches: dict[str, Any],
        index: int,
    ) -> Callable[..., Any]:
        names = {input_name(i): name for i, name in param_inputs.items()}
        graph = _Graph(self.config, self.compiled, index, names)
        joint = graph if self.config.reshard_after_forward else None
        passes = Passes(graph.forward_pass, graph.backward_pass, lambda _: {}, boxed_nop, joint, min_cut=True)
        fn = compile_aot(self.config.backend, gm, example_inputs, passes, {**patches, **INDUCTOR_FX_ORDER_CONFIG})
        self.compiled.reads[index] = tuple(param_inputs.values())
        called = self.runtime(fn, index, param_inputs, example_inputs, graph.none_outputs, graph.may_be_unused)

        def noted(*args: Any) -> Any:
            """Every call, with autograd or without, kept for the next forward's agreement."""
            self.compiled.ran.append(index)
            return called(*args)

        noted._boxed_call = called._boxed_call  # type: ignore[attr-defined]
        return noted

    def before_call(self, index: int, param_inputs: Mapping[int, str], renamed: dict[str, str] | None) -> None:
        return None

    def wants_node(self, before: Any, noting: bool, renamed: dict[str, str] | None) -> bool:
        return self.updates is not None or noting

    def forward_ran(self, index: int, node: Any, before: Any, renamed: dict[str, str] | None) -> None:
        if node is not None and self.updates is not None:
            self.updates.forward_ran(index, node, foreign=renamed is not None)


class _Graph(CustomGraphPass):
    """One Dynamo graph's passes: with resharding, the joint graph's (inductor's joint-graph
    pre-pass, with a key for its caches); each forward and backward placed and kept with what it
    does, a backward with the parts' updates compiled in a variant of its own beside the graph
    as it is."""

    def __init__(self, config: DDPConfig, compiled: Compiled, index: int, names: Mapping[str, str]) -> None:
        self.config, self.compiled, self.index, self.names = config, compiled, index, names
        self.kept = Kept()
        self.usage: GradientUsage | None = None  # read from the backward graph when it is compiled
        self.none_outputs = NoneOutputs()

    def may_be_unused(self) -> bool:
        """May the backward leave a part unused (until it is compiled: yes)?"""
        return self.usage is None or self.usage.may_be_unused

    def __call__(self, joint: fx.Graph) -> None:
        """The joint graph's gathers tagged for the backward to gather again, but the backward's
        first bucket (a bucket's cap, as planned for the whole graph); what it keeps is read by the
        P5 check."""
        keep = bucket_cap(self.config, whole_bytes(joint), self.compiled.world_size, self.compiled.placement).nbytes
        self.kept = tag_regathers(joint, keep)

    def uuid(self) -> bytes:
        with open(reshard.__file__, "rb") as f:  # the keep budget's inputs too: bucket_cap's
            shape = None if self.compiled.placement is None else self.compiled.placement.shape()
            key = (self.config.bucket_cap_mb, self.config.cost, self.compiled.world_size, shape)
            return hashlib.sha256(f.read() + repr(key).encode()).digest()

    def keep(self, gm: fx.GraphModule, backward: bool) -> tuple[GraphRecord, UpdatingBackward | None]:
        if backward:  # before the rewrite merges gradients into buckets
            self.usage = GradientUsage.of_graph(gm, part_gradients(gm, self.names))
        else:
            reshard.mark_saved_outputs(gm)  # a user's output that views a gathered parameter is not kept for the backward
        plan = _placed(gm, self.config, self.compiled, backward, self.kept, tuple(self.names))
        kind = "backward" if backward else "forward"
        compiled, updates = self.compiled, self.compiled.updates
        variant = None
        if updates is not None and not backward:
            updates.forward_compiled(self.index, gm, self.names)
        elif updates is not None:
            variant = updates.backward_variant(self.index, gm, self.names)
        described, wrong = describe_part_collectives(gm, plan, compiled.world_size, self.names)
        if self.config.verify and wrong:
            raise VerificationError(f"graphddp: the {kind} graph's buckets are not the ones planned: " + "; ".join(wrong))
        record = GraphRecord(described, gm, kind=kind, index=self.index)
        if variant is not None:
            record.schedule = dataclasses.replace(described, updates=variant.names)
            record.variants[UPDATING] = GraphRecord(record.schedule, variant.graph, kind=UPDATING, index=self.index)
        compiled.records.append(record)
        return record, variant

    def forward_pass(self, gm: fx.GraphModule, compiler: Compiler, inference: bool) -> Any:
        """The forward placed and kept, then compiled (an inference graph as it is)."""
        if not inference:
            self.keep(gm, False)
        return compiler.now(gm)

    def backward_pass(self, gm: fx.GraphModule, compiler: Compiler) -> Any:
        """The backward placed and kept, and what AOTAutograd runs for it: the graph as compiled,
        or where the parts are updated inside, the choice between it and the variants
        (:meth:`PartUpdates.backward`), the updating one compiled now, the graph as it is and the
        carrying one when a step first needs them."""
        record, variant = self.keep(gm, True)
        if variant is None:
            plain, choose = compiler.now(gm), None
        else:
            def lazily(graph: fx.GraphModule) -> Compile:
                return functools.cache(compiler.later(compiler.copy(graph)))  # its inputs past AOTAutograd's as extra

            updating = lazily(variant.graph)()
            choose = self.compiled.updates.backward(self.index, variant, lazily(gm), lambda: updating, lazily(variant.carrying), record)
        usage = self.usage
        if usage is None or not usage.may_be_unused:
            return choose if choose is not None else plain
        group, names = self.compiled.group, tuple(usage.outputs)

        def dropping(args: list) -> Any:
            """Gradients of the parts no rank used this step returned as None, and not updated inside."""
            unused = GradientUsage.unused_anywhere(names, usage.unused(*self.none_outputs.take(), args), group)
            out = choose(args, unused) if choose is not None else plain(args)
            return GradientUsage.drop(out, usage.outputs, unused)

        dropping._boxed_call = True  # type: ignore[attr-defined]
        return dropping


def _placed(gm: fx.GraphModule, config: DDPConfig, compiled: Compiled, backward: bool, kept: Kept, parts: tuple[str, ...]) -> PartGraph:
    """The graph's collectives bucketed under :func:`bucket_cap` and placed where a step wants
    them, checked after the rewrite when ``config.verify`` (a resharding forward may keep the
    gathers ``kept``); returns the buckets planned."""
    placement, replicated = compiled.placement, compiled.replicated
    cap = bucket_cap(config, whole_bytes(gm.graph), compiled.world_size, placement)
    plan = place_part_collectives(gm.graph, "backward" if backward else "forward", cap, placement=placement, replicated=replicated)
    gm.recompile()
    if config.verify:
        check_part_collectives(gm, backward, config.reshard_after_forward, kept.nbytes, parts, placement, replicated)
    return plan


def bucket_cap(config: DDPConfig, whole: int, world_size: int, placement: Placement | None = None) -> PartCap:
    """The cap of a graph's gather and reduce-scatter buckets, ``whole`` the bytes its
    collectives carry whole, ``world_size`` the ranks a part is cut over (``placement``'s shard
    group, whose replicate group adds its all-reduce): ``bucket_cap_mb`` where given, else planned
    from ``config.cost`` (calibrated when the model was wrapped, or the given one)."""
    if isinstance(config.bucket_cap_mb, (int, float)):
        return PartCap(int(config.bucket_cap_mb * MB), "bucket_cap_mb")
    cost = config.cost
    assert cost is not None, "sharding='full' resolves its cost model when the model is wrapped (FullyShardedState)"
    return PartCap(planned_cap_bytes(cost, whole, world_size, bool(config.reshard_after_forward), placement), f"planned ({cost.source})")
