"""``graphddp.explain``: see the plan for N ranks without N ranks.

Runs the same compile path as a real job (same options, so the same backward graph and the
same buckets) in this one process, under a fake process group that pretends to have
``world_size`` ranks. One forward and backward on the example inputs triggers the backward
compile; the model is deep-copied first, so its parameters, gradients and buffers are left
untouched.

It leaves nothing behind: the fake group is destroyed, the exception hook that
``init_process_group`` installs is put back, and the compiled copy counts its recompiles in
its own region, so later compiles of the same model class do not inherit them.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from graphddp.config import DDPConfig
from graphddp.frontend.api import compile as compile_ddp
from graphddp.runtime.agree import standing_in
from graphddp.values.schedule import Schedule


def _default_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("graphddp.explain: the model output has no tensor that requires grad; pass loss_fn=")
    return sum(t.float().sum() for t in leaves)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` pretend ranks for the duration of the block.

    The fake backend (torch's, registered by importing its module) runs no collective; planning
    needs only the group's size and name. ``init_process_group`` replaces ``sys.excepthook``
    with one that prefixes ``[rank0]``; the original is restored on exit.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers backend "fake"

    if dist.is_initialized():
        raise RuntimeError(
            "graphddp.explain plans under its own fake process group and must run before "
            "init_process_group; in a running job read compiled.schedules instead"
        )
    hook = sys.excepthook
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def explain(
    model: nn.Module,
    *example_inputs: Any,
    world_size: int = 8,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **options: Any,
) -> list[Schedule]:
    """Plan ``model`` for ``world_size`` ranks in this process; returns one Schedule per graph.

    ``options`` are ``graphddp.compile``'s (:class:`~graphddp.config.DDPConfig`'s fields) and
    mean the same, so the plan shown is the plan a run with those options would use.
    ``loss_fn(output)`` makes the scalar to differentiate (default: the sum of every output
    tensor that requires grad).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    config = DDPConfig.from_options("graphddp.explain", options)  # bad options fail before any tracing
    if config.sharding == "full":
        raise NotImplementedError(
            "graphddp.explain: sharding='full' has no Schedule yet (its gathers and reduce-scatters are bucketed by a "
            "fixed cap inside each compiled graph, not planned); a run's model.graphs shows where each bucket's "
            "collectives are"
        )
    with fake_process_group(world_size), standing_in(dist.group.WORLD):
        copied = copy.deepcopy(model)
        # sharding="optimizer" and max_grad_norm plan around the update inside the backward; which
        # optimizer does not change the buckets, so a still one (lr 0) stands in for the user's.
        needs = options.get("sharding") or options.get("max_grad_norm") is not None
        sgd = torch.optim.SGD(copied.parameters(), lr=0.0) if needs else None
        compiled = compile_ddp(copied, optimizer=sgd, **options)
        out = compiled(*example_inputs)
        (loss_fn or _default_loss)(out).backward()
        return compiled.schedules
