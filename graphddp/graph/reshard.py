"""``sharding="full", reshard_after_forward=True``: the backward gathers parameters again instead
of keeping the forward's gathered copies.

Why a tag on the joint graph. With full sharding each parameter is read through an all-gather
of the ranks' parts (:mod:`graphddp.frontend.parts`), so AOTAutograd's joint graph holds, per
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

**The backward's first bucket is kept** (``keep_bytes``, a bucket's cap). The backward needs
first what the forward read last, and a gather at the top of the backward has nothing to hide
behind: re-gathering it would put one bucket's link time on every step (on the benchmark's GPT,
the 2 MB tied embedding its head reads). So the parameters the backward reads first, in that
order until their gathered bytes reach ``keep_bytes``, are left untagged: the partitioner saves
them, and the backward starts computing at once. FSDP2 does the same for its root module's
parameters. In one graph this costs no peak: the backward would gather that bucket again right
away, with every activation still alive; a forward followed by more graphs (a graph break)
holds it through them.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphddp.graph.capture import descendants, is_view, output_nodes, views_of
from graphddp.graph.part_facts import part_input
from graphddp.values.comm import ROLE_KEY, is_wait

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# One id for every tagged node: the partitioner's cleanup forces a save where a tagged node
# feeds a tagged node of a *later* checkpoint region; here there is one "region".
_REGION = 0


@dataclasses.dataclass(frozen=True)
class Kept:
    """The parts whose forward gathers a resharding forward keeps for its backward (their
    inputs' names, ``primals_k``, in the order the backward reads them) and their gathered
    bytes: what the graph's P5 check allows (:mod:`graphddp.graph.verify_full`)."""

    inputs: tuple[str, ...] = ()
    nbytes: int = 0


def tag_regathers(graph: fx.Graph, keep_bytes: int = 0) -> Kept:
    """Tag every all-gather of a graph input, its wait and the views of its result for
    recomputation, but those of the parts the backward reads first, up to ``keep_bytes``
    (module docstring); returns the parts kept."""
    gathers = [n for n in graph.nodes if n.target is _ALL_GATHER and part_input(n) is not None]
    kept = _first_read_by_backward(graph, gathers, keep_bytes)
    for node in gathers:
        if part_input(node).name in kept.inputs:
            continue
        _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
        if node.args[0] is not part_input(node):  # a policy's cast of the part: recomputed with it
            _tag(node.args[0], CheckpointPolicy.MUST_RECOMPUTE)
        todo = list(node.users)
        while todo:
            user = todo.pop()
            if is_wait(user):
                _tag(user, CheckpointPolicy.MUST_RECOMPUTE)
            elif is_view(user):
                _tag(user, CheckpointPolicy.PREFER_RECOMPUTE)
            else:
                continue
            todo.extend(user.users)
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
        wait = next((u for u in gather.users if is_wait(u)), None)
        if wait is None:
            continue
        reads = [order[u] for v in views_of(wait) for u in v.users if u in backward]
        if reads:
            part = part_input(gather)
            first[part] = min(reads + [first.get(part, len(order))])
            val = wait.meta["val"]
            sizes[part] = val.numel() * val.element_size()
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
    """What a compiled forward keeps of its gathered parameters for the backward: each distinct
    gathered tensor its saved outputs (:data:`SAVED_FROM`) are, or are views of (a parameter cut from a gather bucket's
    result, or the result itself: the bucket's nodes carry the ``gather_wait`` role,
    :mod:`graphddp.graph.part_collectives`), and the first output that holds it."""
    roots: dict[fx.Node, fx.Node] = {}
    for out in output_nodes(gm)[gm.meta.get(SAVED_FROM, 0):]:
        node = out
        while isinstance(node, fx.Node) and node.meta.get(ROLE_KEY) != "gather_wait" and is_view(node):
            node = node.args[0]
        if isinstance(node, fx.Node) and node.meta.get(ROLE_KEY) == "gather_wait":
            roots.setdefault(node, out)
    return roots


def kept_gathered_bytes(gm: fx.GraphModule) -> int:
    """The bytes of :func:`kept_gathered`'s tensors."""
    return sum(node.meta["val"].numel() * node.meta["val"].element_size() for node in kept_gathered(gm))


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = _REGION
