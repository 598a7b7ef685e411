"""Wrap-time work, as DDP's constructor does it: what every mode checks and broadcasts once, before
any graph exists. Kept apart from :mod:`graphddp.frontend.replica`'s per-forward work: this runs
once and leaves behind only what it returns.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.config import DDPConfig
from graphddp.frontend.mesh import MeshGroups, flat_groups
from graphddp.optim.attached import AttachedOptimizer
from graphddp.optim.shard import ShardedState
from graphddp.runtime.agree import check_parameter_agreement
from graphddp.runtime.calibrate import resolve_cost
from graphddp.runtime.sync import broadcast_tensors


def _check_devices(module: nn.Module) -> torch.device | None:
    devices: dict[torch.device, str] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        spread = ", ".join(f"{name!r} on {dev}" for dev, name in devices.items())
        raise ValueError(
            "graphddp: module parameters and buffers must live on one device "
            f"(data parallelism replicates the whole module per rank); found {spread}"
        )
    return next(iter(devices), None)


def _refuse_sparse_gradients(where: str, module: nn.Module) -> None:
    """Refused by name now: graphddp's buckets are dense, and a sparse gradient failed deep in the
    rewrite."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            raise ValueError(
                f"{where}: parameter {name!r} gets sparse gradients ({type(sub).__name__}(sparse=True)), which graphddp "
                "does not average (its buckets are dense, inside the compiled backward); construct it with sparse=False, "
                "or keep DistributedDataParallel for this model"
            )


def resolve_group(where: str, module: Any, process_group: Any, options: dict[str, Any]) -> Any:
    """``process_group`` or WORLD, after checking the module's type and an initialized default group."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
        )
    return process_group if process_group is not None else dist.group.WORLD


def _refuse_optimizer_with_traced_hook(where: str, config: DDPConfig, optimizer: Any) -> None:
    if optimizer is not None and config.traced_hook is not None:
        raise ValueError(
            f"{where}: optimizer= with comm_hook={config.traced_hook.name} is not supported yet (the in-graph update "
            "is checked against graphddp's own all-reduce only); compile without optimizer= and step it as usual"
        )


def _refuse_clipping_without_the_optimizer(where: str, config: DDPConfig, optimizer: Any) -> None:
    if config.max_grad_norm is not None and optimizer is None:
        raise ValueError(
            f"{where}: max_grad_norm={config.max_grad_norm} clips the gradients inside the backward, before the "
            "update of optimizer=, and there is none: without optimizer= every p.grad holds the average after "
            "backward(), so clip as usual (torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between "
            "backward() and optimizer.step()), or pass optimizer= to have graphddp clip and step inside the backward"
        )


def check_and_broadcast(where: str, module: nn.Module, group: Any, config: DDPConfig) -> torch.device | None:
    """What every mode checks at wrap time, then DDP's broadcast of parameters (and, with
    ``broadcast_buffers``, buffers) from the group's first rank; returns the module's device. The
    parameters' agreement is checked in band, so a mismatch fails on every rank before any broadcast."""
    _refuse_sparse_gradients(where, module)
    device = _check_devices(module)
    config.check_devices(where, device)
    config.check_inductor_settings(where, device)
    check_parameter_agreement(module, group)
    if dist.get_world_size(group) > 1:
        buffers = list(module.buffers()) if config.broadcast_buffers else []
        broadcast_tensors(list(module.parameters()) + buffers, group)
    return device


def prepare(
    where: str, module: nn.Module, group: Any, config: DDPConfig, optimizer: Any = None, groups: MeshGroups | None = None,
) -> tuple[AttachedOptimizer | None, DDPConfig]:
    """The replicated and ``sharding="optimizer"`` wrap: checks, broadcast, ``optimizer`` attached;
    returns it and ``config`` with its cost model resolved (measured on ``group`` now, since
    compiling never talks). The optimizer is checked before any collective, so every rank fails
    alike, and attached after the last one."""
    assert config.sharding != "full", "sharding='full' wraps through graphddp.frontend.full.compile_fully_sharded"
    _refuse_optimizer_with_traced_hook(where, config, optimizer)
    if config.sharding is not None and optimizer is None:
        raise ValueError(
            f"{where}: sharding={config.sharding!r} shards the optimizer's state, so it needs optimizer= (torch.optim.SGD, "
            "Adam or AdamW): each rank then updates its part of every bucket inside the backward"
        )
    _refuse_clipping_without_the_optimizer(where, config, optimizer)
    attached = AttachedOptimizer(optimizer, module, where, config.max_grad_norm, config.grad_norm_type) if optimizer is not None else None
    device = check_and_broadcast(where, module, group, config)
    config = resolve_cost(config, group, device)
    if attached is not None:
        attached.attach()
        if config.sharding == "optimizer":
            groups = groups or flat_groups(group)
            attached.sharded = ShardedState(optimizer, attached.params, attached.rules, attached.group_of, groups.shard, groups.placement)
    return attached, config
