"""The passes of one Dynamo graph: a list for the forward graph and a list for the backward,
each pass ``fn(gm, plan, **opts) -> plan`` (None: the plan is unchanged).

Lists, so that a feature adds its pass where it belongs (the optimizer's update after the
collectives) once for every compile path (aot_eager, eager, inductor, a warm restart's
derivation). AOTAutograd hands over the forward graph first; what a pass learns for a later one
goes into ``opts["shared"]`` (:class:`Shared`), one per Dynamo graph.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.verify import verify
from graphddp.plan.planner import with_wire_bytes
from graphddp.values.collectives import SHARDED
from graphddp.values.comm import wire_bytes
from graphddp.values.schedule import Schedule

log = logging.getLogger("graphddp")

Pass = Callable[..., "Schedule | None"]


@dataclasses.dataclass
class Shared:
    """What the passes of one Dynamo graph hand each other."""

    fw_values: dict[str, Any] = dataclasses.field(default_factory=dict)  # parameter -> forward value (fake)
    without_update: fx.GraphModule | None = None  # the backward before the optimizer's pass
    tied: tuple[str, ...] = ()  # parameters the optimizer's pass left to torch's step
    before_comm: fx.GraphModule | None = None  # with sharded buckets: the backward before insert_comm


def run_passes(passes: Sequence[Pass], gm: fx.GraphModule, plan: Schedule | None, **opts: Any) -> Schedule | None:
    """``plan`` after every pass of ``passes`` ran on ``gm`` in order."""
    for one in passes:
        out = one(gm, plan, **opts)
        plan = plan if out is None else out
    return plan


# -- the forward --------------------------------------------------------------------------------------


def record_parameter_values(gm: fx.GraphModule, plan: Schedule | None, *, param_inputs: Mapping[int, str], shared: Shared, **_: Any) -> None:
    """Each parameter's fake value in the forward graph, with its storage: the update pass writes through it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, name in param_inputs.items():
        if i < len(placeholders):
            shared.fw_values[name] = placeholders[i].meta.get("val")


# -- the backward -------------------------------------------------------------------------------------


def insert_comm(
    gm: fx.GraphModule, plan: Schedule, *, world_size: int, hook: Any, hook_context: Any, graph_index: int, shared: Shared,
    carry: bool = False, **_: Any,
) -> Schedule:
    """Each bucket's collective (its kind, or the traced hook) and its wait; with a hook, the bytes
    its collectives put on the wire. One rank: nothing."""
    if any(b.collective == SHARDED for b in plan.buckets):  # the all-reduce variant starts from it
        shared.before_comm = copy.deepcopy(gm)
    if world_size == 1:
        return plan
    log.debug("backward graph %d before insert_collectives:\n%s", graph_index, gm.code)
    insert_collectives(gm, plan, hook=hook, context=hook_context, carry=carry)
    log.debug("backward graph %d after insert_collectives:\n%s", graph_index, gm.code)
    return with_wire_bytes(plan, wire_bytes(gm)) if hook is not None else plan


def verify_comm(gm: fx.GraphModule, plan: Schedule, *, world_size: int, check: bool, outputs: Mapping[int, str], **_: Any) -> None:
    """The verifier after the collectives (``verify=False`` turns it off)."""
    if world_size > 1 and check:
        verify(gm, plan, outputs)
