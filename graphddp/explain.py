"""``graphddp.explain``: see the plan for N ranks without N ranks.

Runs the same compile path as a real job (same backend, same options, so the same backward
graph and the same buckets) in this one process, under a fake process group that pretends to
have ``world_size`` ranks. One forward and backward on the example inputs triggers the
backward compile; the model is deep-copied first, so its parameters, gradients and buffers
are left untouched.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from graphddp.schedule import Schedule


def _default_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("graphddp.explain: the model output has no tensor that requires grad; pass loss_fn=")
    return sum(t.float().sum() for t in leaves)


def explain(
    model: nn.Module,
    *example_inputs: Any,
    world_size: int = 8,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float | None = None,
    last_bucket_cap_mb: float | None = None,
    bucket_cap_mb_list: list[float] | tuple[float, ...] | None = None,
    backend: str = "inductor",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> list[Schedule]:
    """Plan ``model`` for ``world_size`` ranks in this process; returns one Schedule per graph.

    The cap options mean what they mean to ``graphddp.compile`` (DDP's rules: None is DDP's
    default, 25 MB after a 1 MB first bucket), so the plan shown is the plan a run would use.
    """
    import graphddp
    from graphddp.testing import init_fake_process_group

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError(
            "graphddp.explain plans under its own fake process group and must run before "
            "init_process_group; in a running job read compiled.schedules instead"
        )
    init_fake_process_group(world_size)
    try:
        compiled = graphddp.compile(
            copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
            last_bucket_cap_mb=last_bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list, backend=backend, fullgraph=fullgraph, dynamic=dynamic,
        )
        out = compiled(*example_inputs)
        (loss_fn or _default_loss)(out).backward()
        return compiled.schedules
    finally:
        dist.destroy_process_group()
