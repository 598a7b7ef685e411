"""``graphddp.explain`` and ``graphddp.predict_memory``: the plan and the bytes of N ranks, without N ranks.

``explain`` runs the same compile path as a real job (same options, so the same backward graph and
the same buckets) in this one process, under a fake process group of ``world_size`` ranks, on a
deep copy of the model, whose one forward and backward trigger the compile. It leaves nothing
behind: the fake group is destroyed, ``sys.excepthook`` put back, and the copy counts its
recompiles in its own region, so later compiles of the same model class do not inherit them.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from graphddp.compiler.aot import first_compile_shapes
from graphddp.compiler.model_trace import floating_outputs, trace_model
from graphddp.config import DDPConfig
from graphddp.frontend.api import compile as compile_ddp
from graphddp.plan.memory import PLACEMENTS, SHARDED, MemoryPrediction, predict
from graphddp.runtime.agree import standing_in
from graphddp.values.schedule_table import ScheduleValue


def _default_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in floating_outputs(out) if t.requires_grad]
    if not leaves:
        raise ValueError("graphddp.explain: the model output has no tensor that requires grad; pass loss_fn=")
    return sum(t.float().sum() for t in leaves)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` pretend ranks for the block: torch's fake backend
    runs no collective, and planning needs only the group's size and name. ``init_process_group``
    replaces ``sys.excepthook`` (to prefix ``[rank0]``); the original is restored on exit."""
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
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    device_mesh: tuple[int, int] | None = None,
    **options: Any,
) -> list[ScheduleValue]:
    """Plan ``model`` for ``world_size`` ranks in this process; returns one schedule per graph:
    a :class:`~graphddp.values.schedule.Schedule`, or with ``sharding="full"`` a
    :class:`~graphddp.values.part_schedule.FullSchedule` (every gather and reduce-scatter of the
    compiled forward and backward, and the memory each rank holds).

    ``options`` are ``graphddp.compile``'s and mean the same, so the plan shown is the plan a run
    with those options would use. ``loss_fn(output)`` makes the scalar to differentiate (default:
    the sum of every output tensor that requires grad). ``optimizer``: what makes the run's
    optimizer from parameters (``torch.optim.AdamW``, or ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``),
    compiled into the backward as ``optimizer=``; with ``sharding="full"`` it steps once after the
    backward so that the schedule counts its state. Without it, the modes that need one plan with a
    still SGD (lr 0), which keeps no state. ``device_mesh=(replicate, shard)``: hybrid sharding's
    mesh shape (``world_size`` is then their product; each sharded bucket's placement shows both
    levels). ``sharding="auto"`` chooses from ``example_inputs`` as a run would from ``example=``,
    weighing the sharded placements only with ``optimizer=``; each schedule carries the choice
    (``schedule.choice``: every placement weighed, its predicted step and peak, why it won or lost).
    """
    world_size = _world(world_size, device_mesh)
    if optimizer is not None and not callable(optimizer):
        raise ValueError(f"graphddp.explain: optimizer= makes the optimizer from parameters (e.g. torch.optim.AdamW), got {optimizer!r}")
    config = DDPConfig.from_options("graphddp.explain", options)  # bad options fail before any tracing
    with fake_process_group(world_size), standing_in(dist.group.WORLD), first_compile_shapes(config.dynamic):
        copied = copy.deepcopy(model)
        opt = _optimizer(copied, optimizer, config.sharding in ("optimizer", "full") or config.max_grad_norm is not None)
        mesh = init_device_mesh("cpu", tuple(device_mesh), mesh_dim_names=("replicate", "shard")) if device_mesh is not None else None
        example = {"example": tuple(example_inputs)} if config.sharding == "auto" else {}
        compiled = compile_ddp(copied, optimizer=opt, device_mesh=mesh, **example, **options)
        out = compiled(*example_inputs)
        (loss_fn or _default_loss)(out).backward()
        if compiled.config.sharding == "full":
            opt.step()  # the state of the parts, for the schedule's memory
        return compiled.schedules


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _world(world_size: Any, mesh: Any) -> int:
    """``world_size`` or, given a hybrid mesh's shape ``(replicate, shard)``, their product; checked."""
    if mesh is not None:
        if not (isinstance(mesh, (tuple, list)) and len(mesh) == 2 and all(_positive_int(d) for d in mesh)):
            raise ValueError(f"graphddp.explain: device_mesh= is a shape (replicate, shard) of positive ints, got {mesh!r}")
        world_size = mesh[0] * mesh[1]
    if not _positive_int(world_size):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _optimizer(model: nn.Module, make: Callable[..., torch.optim.Optimizer] | None, needed: bool) -> torch.optim.Optimizer | None:
    """The user's optimizer over the copy; else, where a mode needs one (sharding, or
    max_grad_norm, plan around the update inside the backward, and which optimizer does not
    change the buckets), a still SGD (lr 0) standing in."""
    if make is None:
        return torch.optim.SGD(model.parameters(), lr=0.0) if needed else None
    made = make(model.parameters())
    if not isinstance(made, torch.optim.Optimizer):
        raise ValueError(f"graphddp.explain: optimizer= must make a torch.optim.Optimizer from parameters, it made {type(made).__name__}")
    return made


def predict_memory(
    model: nn.Module,
    *example_inputs: Any,
    world_size: int = 8,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    device_mesh: tuple[int, int] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    backend: str = "inductor",
    mp_policy: Any = None,
) -> list[MemoryPrediction]:
    """Each placement's bytes on one of ``world_size`` ranks, between steps and at the step's
    peak (:mod:`graphddp.plan.memory` says what is counted), for a loop of ``model(*example_inputs,
    **example_kwargs)``, a backward and the ``optimizer`` (made from parameters, as :func:`explain`
    takes it; None: no state), compiled by ``backend`` (its partition decides what the backward
    keeps). One trace of the model, no process group: every placement is predicted from the same
    facts. ``device_mesh=(replicate, shard)`` predicts the sharded placements as hybrid sharding
    over that mesh. ``mp_policy``: full sharding's mixed-precision policy, traced as a run computes
    under it; only full sharding's placements (the mode that runs one) are predicted then.
    ``graphddp.plan.memory.table(predictions)`` prints them."""
    world_size = _world(world_size, device_mesh)
    shard = device_mesh[1] if device_mesh is not None else None
    example = dict(example_kwargs) if example_kwargs else tuple(example_inputs)
    if example_kwargs and example_inputs:
        raise ValueError("graphddp.predict_memory: pass the inputs positionally or as example_kwargs=, not both")
    made = _optimizer(model, optimizer, False)
    DDPConfig.from_options("graphddp.predict_memory", {"sharding": "full", "mp_policy": mp_policy})  # a bad policy fails before the trace
    facts = trace_model(model, example, made, min_cut=backend == "inductor", mp_policy=mp_policy).memory
    placements = [p for p in PLACEMENTS if mp_policy is None or p.startswith("full")]
    return [predict(facts, p, world_size, shard if p in SHARDED else None) for p in placements]
