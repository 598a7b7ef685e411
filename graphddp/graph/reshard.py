"""``sharding="full", reshard_after_forward=True``: the backward gathers parameters again instead
of keeping the forward's gathered copies.

Why a tag on the joint graph. With full sharding each parameter is read through an all-gather
of the ranks' parts (:mod:`graphddp.frontend.full`), so AOTAutograd's joint graph holds, per
read, ``part -> all_gather_into_tensor -> wait_tensor -> views``. Left alone, the partitioner
saves what the backward needs of the gathered parameter as a forward output, and the full
parameter lives from the forward to the backward: FSDP2's ``reshard_after_forward=False``.
To free it after the forward (FSDP2's default) the backward must gather again. SimpleFSDP gets
that from a selective activation checkpoint whose policy must recompute every gather; but a
checkpointed region cannot contain a graph break (around a whole Hugging Face GPT-2 Dynamo gave
up and ran it eagerly: docs/design-full-sharding.md). The same policy written straight onto the
joint graph needs no region: each gather of a part, its wait and the views of its result are
tagged ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``, which the min-cut partitioner honours (it
never saves a node it must recompute), so it saves the part, a graph input, and the backward
re-issues the gather where it first needs the parameter.

Only gathers of a graph input are tagged: a part is always an input (a parameter of the graph),
and a gather of an activation (a user's own collective) is left to the partitioner.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphddp.graph.part_collectives import part_input
from graphddp.values.comm import is_wait

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# One id for every tagged node: the partitioner's cleanup forces a save where a tagged node
# feeds a tagged node of a *later* checkpoint region; here there is one "region".
_REGION = 0


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view


def tag_regathers(graph: fx.Graph) -> int:
    """Tag every all-gather of a graph input, its wait and the views of its result for
    recomputation (module docstring); returns how many gathers were tagged."""
    tagged = 0
    for node in graph.nodes:
        if node.target is not _ALL_GATHER or part_input(node) is None:
            continue
        tagged += 1
        _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
        if node.args[0] is not part_input(node):  # a policy's cast of the part: recomputed with it
            _tag(node.args[0], CheckpointPolicy.MUST_RECOMPUTE)
        todo = list(node.users)
        while todo:
            user = todo.pop()
            if is_wait(user):
                _tag(user, CheckpointPolicy.MUST_RECOMPUTE)
            elif _is_view(user):
                _tag(user, CheckpointPolicy.PREFER_RECOMPUTE)
            else:
                continue
            todo.extend(user.users)
    return tagged


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = _REGION
