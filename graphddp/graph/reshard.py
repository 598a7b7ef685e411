"""``sharding="full", reshard_after_forward=True``: the backward gathers parameters again instead
of keeping the forward's gathered copies.

Why a tag on the joint graph. Each parameter is read through an all-gather of the ranks' parts, so
left alone the partitioner saves the gathered parameter for the backward (FSDP2's
``reshard_after_forward=False``). SimpleFSDP re-gathers through a selective activation checkpoint,
but a checkpointed region cannot contain a graph break (docs/design-full-sharding.md). The same
policy written straight onto the joint graph needs no region: each gather of a graph input, its wait
and the views of its result are tagged ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE``, so the min-cut
partitioner saves the part and the backward re-issues the gather where it first needs it. A gather
of an activation (a user's own collective) is left to the partitioner.

**The backward's first bucket is kept** (``keep_bytes``, a bucket's cap): the backward needs first
what the forward read last, and a gather at its top has nothing to hide behind. So the parameters
the backward reads first, up to ``keep_bytes``, stay untagged, as FSDP2 keeps its root module's. In
one graph this costs no peak: the backward would gather them again at once, every activation alive.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphddp.graph.capture import byte_size, descendants, is_view, output_nodes, reach, views_of
from graphddp.graph.part_facts import part_input, wait_of
from graphddp.values.collectives import ALL_GATHER_OP
from graphddp.values.comm import ROLE_KEY, is_wait
from graphddp.values.part_schedule import GATHER, WAIT_OF

# One id for every tagged node: the partitioner's cleanup forces a save where a tagged node
# feeds a tagged node of a *later* checkpoint region; here there is one "region".
_REGION = 0


@dataclasses.dataclass(frozen=True)
class Kept:
    """The parts a resharding forward keeps gathered for its backward (their inputs' names, in the
    order the backward reads them) and their bytes: what P5 allows."""

    inputs: tuple[str, ...] = ()
    nbytes: int = 0


def tag_regathers(graph: fx.Graph, keep_bytes: int = 0) -> Kept:
    """Tag every all-gather of a graph input, its wait and its views for recomputation, but the
    first ``keep_bytes`` the backward reads; returns the parts kept."""
    gathers = [n for n in graph.nodes if n.target is ALL_GATHER_OP and part_input(n) is not None]
    kept = _first_read_by_backward(graph, gathers, keep_bytes)
    for node in gathers:
        if part_input(node).name in kept.inputs:
            continue
        _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
        if node.args[0] is not part_input(node):  # a policy's cast of the part: recomputed with it
            _tag(node.args[0], CheckpointPolicy.MUST_RECOMPUTE)
        for user in reach(node.users, lambda u: u.users if is_wait(u) or is_view(u) else []):
            if is_wait(user):
                _tag(user, CheckpointPolicy.MUST_RECOMPUTE)
            elif is_view(user):
                _tag(user, CheckpointPolicy.PREFER_RECOMPUTE)
    return kept


def _first_read_by_backward(graph: fx.Graph, gathers: list[fx.Node], keep_bytes: int) -> Kept:
    """In the joint graph (the backward is what reads its ``tangents``), the parts in the order
    the backward first reads their gathered values, until their bytes reach ``keep_bytes``."""
    if keep_bytes <= 0:
        return Kept()
    backward = descendants([n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")])
    order = {n: i for i, n in enumerate(graph.nodes)}
    first: dict[fx.Node, int] = {}  # part input -> the backward's first read of its gathered value
    sizes: dict[fx.Node, int] = {}
    for gather in gathers:
        wait = wait_of(gather)
        if wait is None:
            continue
        reads = [order[u] for v in views_of(wait) for u in v.users if u in backward]
        if reads:
            part = part_input(gather)
            first[part] = min(reads + [first.get(part, len(order))])
            sizes[part] = byte_size(wait.meta["val"])
    inputs: list[str] = []
    nbytes = 0
    for part in sorted(first, key=first.__getitem__):
        if nbytes >= keep_bytes:
            break
        inputs.append(part.name)
        nbytes += sizes[part]
    return Kept(tuple(inputs), nbytes)


# Key of a forward graph's meta: the position of its first output saved for the backward (the
# ones before it are what the forward returns to the user, kept as long as the user holds them).
SAVED_FROM = "graphddp_saved_from"


def mark_saved_outputs(gm: fx.GraphModule) -> None:
    """Record where a forward graph's outputs saved for the backward begin (:data:`SAVED_FROM`),
    from AOTAutograd's metadata of the graph being compiled; none recorded outside a trace."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None:
        gm.meta[SAVED_FROM] = meta.num_forward_returns


def kept_gathered(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each distinct gathered tensor (role ``gather_wait``) a compiled forward's saved outputs are, or
    are views of, and the first output that holds it."""
    roots: dict[fx.Node, fx.Node] = {}
    for out in output_nodes(gm)[gm.meta.get(SAVED_FROM, 0):]:
        node = out
        while isinstance(node, fx.Node) and node.meta.get(ROLE_KEY) != WAIT_OF[GATHER] and is_view(node):
            node = node.args[0]
        if isinstance(node, fx.Node) and node.meta.get(ROLE_KEY) == WAIT_OF[GATHER]:
            roots.setdefault(node, out)
    return roots


def kept_gathered_bytes(gm: fx.GraphModule) -> int:
    return sum(byte_size(node.meta["val"]) for node in kept_gathered(gm))


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = _REGION
