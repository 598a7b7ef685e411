"""The functional ops and node tags of graphddp's collectives, and the predicates every pass and verifier
recognises them by (each kind's lowerings: :mod:`graphddp.values.collectives`)."""
from __future__ import annotations

import torch
import torch.fx as fx

ALL_REDUCE = torch.ops._c10d_functional.all_reduce_.default
WAIT = torch.ops._c10d_functional.wait_tensor.default

# Meta keys graphddp sets on nodes it creates; the verifier and renderers read them.
BUCKET_KEY = "graphddp_bucket"
ROLE_KEY = "graphddp_role"
# ROLE_KEY of a backward input that carries a gradient accumulated under no_sync into its bucket
# (graph.insert_comm), and the meta key naming its parameter.
CARRIED = "carried_gradient"


def is_collective(node: fx.Node) -> bool:
    """Any functional collective (a user hook may issue others than all-reduce); not a wait."""
    target = node.target
    return (
        node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional" and target != WAIT
    )


def group_of(node: fx.Node) -> object:
    """The ``group_name`` argument of a functional collective."""
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    i = names.index("group_name")
    return node.args[i] if len(node.args) > i else node.kwargs.get("group_name")


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == WAIT


def is_ours(node: fx.Node, bucket: int | None = None) -> bool:
    """Made by graphddp (tagged with a bucket), and for ``bucket`` when one is given."""
    tag = node.meta.get(BUCKET_KEY)
    return tag is not None and (bucket is None or tag == bucket)


# The cast graphddp emits for compression hooks: a prim, because the backward graph it is
# written into is already decomposed, and inductor refuses a decomposable aten._to_copy there.
CAST = torch.ops.prims.convert_element_type.default


def is_cast(node: fx.Node) -> bool:
    """A dtype cast as graphddp emits them (compress before the all-reduce, decompress after)."""
    return node.op == "call_function" and node.target == CAST


# The name under which graphddp registers the gate of a process group (graphddp.runtime.gate): a
# gated graph's all-reduces run on it.
GATE_PREFIX = "graphddp.gate."


def gate_name(group_name: str) -> str:
    """The group name a gated graph's all-reduces use for the user's group ``group_name``."""
    return GATE_PREFIX + group_name


def group_name_of(process_group: object) -> str:
    """The registered name functional collectives use to find ``process_group``."""
    return str(process_group.group_name)  # type: ignore[attr-defined]


def wire_bytes(gm: fx.GraphModule) -> dict[int, int]:
    """Per bucket, the bytes graphddp's collectives send per rank: the sum of their inputs."""
    out: dict[int, int] = {}
    for node in gm.graph.nodes:
        if is_collective(node) and is_ours(node):
            val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            size = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
            out[node.meta[BUCKET_KEY]] = out.get(node.meta[BUCKET_KEY], 0) + int(size)
    return out


def gather_flat(output: torch.Tensor, part: torch.Tensor, group: object = None, async_op: bool = False) -> object:
    """Eager all-gather of every rank's ``part`` into ``output``, rank-major: torch >= 2.13 calls
    it ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` warns there). With
    ``async_op`` the work to wait for."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return gather(output, part, group=group, async_op=async_op)
