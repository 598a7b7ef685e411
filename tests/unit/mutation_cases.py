"""The cases of the verifier's mutation tests (``test_verify_mutations.py``): rewritten backward
graphs with their schedules, each handed to a mutation as its own copy (``fresh``).

Real ones are captured from ``graphddp.compile(..., backend="aot_eager")`` under a fake process
group of 4 ranks (an MLP, two buckets of several gradients, with and without a bf16 compression
hook, and gated as for real ranks); hand-traced ones come from ``test_passes`` (three buckets,
two dtypes, a strided gradient that is cloned; with an fp16 hook, with waits placed before an
interior node, and carrying accumulated gradients). ``Case`` finds graphddp's nodes in a graph;
``add_node`` inserts one.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Callable

import test_passes
import torch
import torch.distributed as dist
import torch.fx as fx

import graphddp
from graphddp.config import DDPConfig
from graphddp.graph.capture import extract_facts, output_nodes
from graphddp.graph.insert_comm import insert_collectives
from graphddp.models import MLP
from graphddp.plan.planner import plan
from graphddp.runtime.agree import standing_in
from graphddp.testing import init_fake_process_group, release_process_group
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY
from graphddp.values.schedule import Bucket, Schedule

WORLD = 4


@dataclasses.dataclass
class Case:
    """One rewritten graph to corrupt: its own copy of the graph; the schedule may be replaced."""

    gm: fx.GraphModule
    schedule: Schedule
    expected: dict[int, str]

    # -- finding graphddp's nodes -----------------------------------------------------------
    def ours(self, bucket: int, role: str) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.meta.get(BUCKET_KEY) == bucket and n.meta.get(ROLE_KEY) == role]

    def one(self, bucket: int, role: str) -> fx.Node:
        (node,) = self.ours(bucket, role)
        return node

    def biggest(self) -> Bucket:
        """The bucket with the most gradients (several, in every case): exercises the cat."""
        return max(self.schedule.buckets, key=lambda b: len(b.slots))

    def compressed(self) -> bool:
        return any(b.comm_dtype for b in self.schedule.buckets)

    def node(self, name: str) -> fx.Node:
        (node,) = [n for n in self.gm.graph.nodes if n.name == name]
        return node

    def outs(self) -> list[Any]:
        return output_nodes(self.gm)

    def set_outs(self, outs: list[Any]) -> None:
        self.gm.graph.output_node().args = (tuple(outs),)


def add_node(case: Case, where: fx.Node, target: Callable[..., Any], args: tuple, like: fx.Node,
             kwargs: dict | None = None, tag: tuple[int, str] | None = None, before: bool = False) -> fx.Node:
    """Insert a node after (or before) ``where``, with ``like``'s fake value and an optional tag."""
    graph = case.gm.graph
    with (graph.inserting_before(where) if before else graph.inserting_after(where)):
        node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = like.meta["val"]
    if tag is not None:
        node.meta[BUCKET_KEY], node.meta[ROLE_KEY] = tag
    return node


# ---------------------------------------------------------------------------------------------
# cases


def _real(comm_hook: str | None, gated: bool = False) -> tuple[fx.GraphModule, Schedule, dict[int, str]]:
    """The backward graph graphddp.compile rewrote (and verified) for an MLP on 4 fake ranks;
    ``gated``: planned as for 4 real ranks, whose graphs read the agreement at their first
    bucket's issue (graphddp.runtime.gate: no division in the graph, the gate's group)."""
    init_fake_process_group(WORLD)
    try:
        torch.manual_seed(0)
        with standing_in(dist.group.WORLD) if gated else contextlib.nullcontext():
            model = graphddp.compile(MLP(width=32, depth=4), backend="aot_eager", bucket_cap_mb=0.005, comm_hook=comm_hook)
            model(torch.randn(8, 16)).sum().backward()
        (record,) = model.records
        assert record.schedule.gated == gated
    finally:
        release_process_group()
    expected = {s.output_index: s.param_name for b in record.schedule.buckets for s in b.slots}
    return record.graph, record.schedule, expected


def _hand(comm_hook: str | None = None, early_waits: bool = False, carry: bool = False) -> tuple[fx.GraphModule, Schedule, dict[int, str]]:
    gm = test_passes.trace()
    first, rest = test_passes.MIXED
    config = DDPConfig(first_bucket_cap_mb=first, bucket_cap_mb=rest, comm_hook=comm_hook)
    schedule = plan(extract_facts(gm, test_passes.PARAMS), config, world_size=WORLD, group_name="0")
    if early_waits:  # every bucket but the last waits before the first compute after their issue points
        names = [n.name for n in schedule.nodes]
        last_issue = max(names.index(b.issue_after) for b in schedule.buckets[:-1])
        wait_at = next(n.name for n in schedule.nodes[last_issue + 1:] if n.is_compute)
        assert names.index(wait_at) < names.index(schedule.buckets[-1].issue_after), "an interior node"
        early = {f"b{b.index}": dict(wait_before=wait_at) for b in schedule.buckets[:-1]}
        schedule = test_passes.with_buckets(schedule, **early)
    insert_collectives(gm, schedule, carry=carry)
    return gm, schedule, dict(test_passes.PARAMS)


BUILDERS: dict[str, Callable[[], tuple[fx.GraphModule, Schedule, dict[int, str]]]] = {
    "mlp": lambda: _real(None),
    "mlp-bf16": lambda: _real("bf16_compress"),
    "mlp-gated": lambda: _real(None, gated=True),
    "hand": lambda: _hand(),
    "hand-fp16": lambda: _hand("fp16_compress"),
    "hand-early-wait": lambda: _hand(early_waits=True),
    "hand-carry": lambda: _hand(carry=True),  # the step after no_sync: accumulated gradients in the buckets
}
ALL = tuple(BUILDERS)
COMPRESSED = ("mlp-bf16", "hand-fp16")
PLAIN = tuple(c for c in ALL if c not in COMPRESSED)
EARLY = ("hand-early-wait",)
CARRYING = ("hand-carry",)
GATED = ("mlp-gated",)
DIVIDED = tuple(c for c in ALL if c not in GATED)  # the graph divides each bucket (a gate does not)


@functools.lru_cache(maxsize=None)
def _pristine(name: str) -> tuple[fx.GraphModule, Schedule, dict[int, str]]:
    return BUILDERS[name]()


def fresh(name: str) -> Case:
    gm, schedule, expected = _pristine(name)
    return Case(copy.deepcopy(gm), schedule, dict(expected))
