"""``sharding="auto"`` at wrap time: trace ``example=`` once, predict every placement's step and
memory from that trace, choose, and check that every rank chose the same before the chosen mode
is built. An earlier run's choice for the same model, batch, optimizer and group is kept while it
stays in the tie band.

Why at wrap time and from an example batch: full sharding cuts the parameters when the model is
wrapped, so the placement must be known then, and a placement's peak depends on the activations
the backward keeps, which only a trace of a real batch shows. The trace runs one forward (no
backward) on the whole parameters the module holds anyway.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.compiler.model_trace import trace_model
from graphddp.compiler.optimizer_probe import update_seconds_per_byte
from graphddp.config import MB, DDPConfig
from graphddp.frontend.mesh import MeshGroups
from graphddp.plan.choose import choose, memory_placement, placements
from graphddp.plan.memory import predict as predict_memory
from graphddp.plan.step import compute_scale, predict_step
from graphddp.runtime import choice_store
from graphddp.runtime.agree import max_over_ranks
from graphddp.runtime.calibrate import calibrate
from graphddp.values.choice import PlacementChoice


def choose_placement(
    where: str, module: nn.Module, groups: MeshGroups, optimizer: Any, config: DDPConfig, example: Any, device: torch.device | None,
) -> tuple[DDPConfig, PlacementChoice]:
    """The config of the chosen placement (``sharding``, ``gather``, ``reshard_after_forward`` set)
    and the choice. Every rank calls it at once: the budget is every rank's smallest."""
    if example is None:
        raise ValueError(f"{where}: sharding='auto' needs example=, a batch as the model is called with (a tuple of positional "
                         "inputs, a dict of keyword inputs, or one input): the choice is made from a trace of it")
    if config.mp_policy is not None and optimizer is None:
        raise ValueError(f"{where}: sharding='auto' with mp_policy weighs full sharding's placements only (the mode that "
                         "runs a mixed-precision policy), and they need optimizer=")
    cost = config.cost or calibrate(groups.whole, device)
    budget = _budget(config.memory_budget, device, groups.whole)
    timed = _times_the_model(config, groups.whole)
    trace = trace_model(module, example, optimizer, min_cut=config.backend == "inductor", dynamic=config.dynamic, timed=timed,
                        mp_policy=config.mp_policy)
    placement = groups.placement
    world = dist.get_world_size(groups.whole)
    compute, update_per_byte = (1.0, 1.0), None
    if timed:
        assert trace.measured is not None
        own = update_seconds_per_byte(optimizer, device or torch.device("cpu"))
        measured = max_over_ranks([*trace.measured, own or 0.0], groups.whole, torch.float64)
        compute = compute_scale(trace.steps, cost, (measured[0], measured[1]))
        update_per_byte = float(f"{measured[2]:.2g}") if own is not None else None
    entries = max((r.per_element / _itemsize(r.dtype) for r in trace.memory.state), default=0.0)
    precision = _precision(trace.memory)

    def predict(options: dict[str, Any]) -> tuple[float, int, int, float, float]:
        sharding, gather, reshard = options.get("sharding"), options.get("gather", "backward"), options.get("reshard_after_forward", True)
        whole_below = int(options.get("replicate_below_mb", 0) * MB)
        step = predict_step(trace.steps, cost, world, sharding, gather=gather, reshard_after_forward=reshard, placement=placement,
                            state_entries=entries, compute=compute, update_per_byte=update_per_byte, whole_below=whole_below,
                            precision=precision)
        memory = predict_memory(trace.memory, memory_placement(sharding, gather, reshard, optimizer is not None), world,
                                placement.shard.size if sharding else None, whole_below)
        return step.seconds, memory.peak, memory.between_steps, step.forward, step.backward

    sizes = [p.numel * p.itemsize for p in trace.memory.params if p.requires_grad]
    candidates = [c for c in placements(optimizer is not None, sizes, config.mp_policy is not None)
                  if not (placement.hybrid and c[0] == "replicated")]
    names = [name for name, _ in candidates]
    key = choice_store.key_of(trace.memory, world, placement.shape(), config.backend, names)  # not the budget: choose checks the fit
    choice = choose(candidates, predict, budget, choice_store.earlier(key, names, groups.whole))
    _check_agreed(choice, groups.whole)
    choice_store.remember(key, choice.chosen, groups.whole)
    options = {"gather": "backward", "reshard_after_forward": None, "replicate_below_mb": None, **choice.options()}
    return dataclasses.replace(config, memory_budget=None, **options), choice


def _times_the_model(config: DDPConfig, group: Any) -> bool:
    """Whether the step's compute is measured on the traced model rather than only estimated per
    node: where the cost model was measured on this machine (not given, not a fake group's
    defaults) and the run's compiled code runs the traced ops one by one as an eager run does (not
    inductor's fused kernels, which an eager run would overprice)."""
    return config.cost is None and dist.get_backend(group) != "fake" and config.backend != "inductor"


def _precision(facts: Any) -> tuple[float, float]:
    """``predict_step``'s ``precision`` of a trace under a mixed-precision policy: the parameters'
    bytes (the largest dtype among them) and the reduce's, per byte computed."""
    if not facts.compute_itemsize:
        return 1.0, 1.0
    own = max((p.itemsize for p in facts.params if p.requires_grad), default=facts.compute_itemsize)
    return own / facts.compute_itemsize, facts.reduce_itemsize / facts.compute_itemsize


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _budget(budget: float | int | None, device: torch.device | None, group: Any) -> int | None:
    """The bytes a rank may hold: given, a fraction of the device's memory, or a GPU's free memory
    now; every rank's smallest. None on CPU without one."""
    cuda = device is not None and device.type == "cuda"
    if budget is None and not cuda:
        return None
    if budget is None or isinstance(budget, float):
        free, total = torch.cuda.mem_get_info(device) if cuda else (0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        budget = free if budget is None else int(budget * total)
    return -int(max_over_ranks([-int(budget)], group)[0])


def _check_agreed(choice: PlacementChoice, group: Any) -> None:
    """Every rank's choice, compared: ranks that predicted differently (another device's free
    memory was already agreed; a model that differs between ranks would show here) fail together."""
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (choice.chosen, choice.fingerprint()), group=group)
    if len(set(seen)) > 1:
        raise RuntimeError(f"graphddp: sharding='auto' chose differently on different ranks: {seen}; "
                           "the model, example= and options must be the same on every rank")

