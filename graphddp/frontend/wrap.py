"""The wrap every mode shares, as DDP's constructor does it: what every mode checks and
broadcasts once, before any graph exists, and :class:`ModelState`, what every mode's state
answers alike.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.config import DDPConfig
from graphddp.hooks.traced import HOOK_STATE_KEY
from graphddp.runtime.agree import check_parameter_agreement
from graphddp.runtime.step import StepState
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
    """Refused by name now, where a sparse gradient would otherwise fail deep in the rewrite."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            raise ValueError(
                f"{where}: parameter {name!r} gets sparse gradients ({type(sub).__name__}(sparse=True)), which graphddp "
                "does not average (its buckets are dense, inside the compiled backward); construct it with sparse=False, "
                "or keep DistributedDataParallel for this model"
            )


def check_module_and_world(where: str, module: Any) -> None:
    """A module to wrap, and an initialized default group: what every check after asks of both."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{where}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
        )


# Why each sharding needs ``optimizer=``: what it keeps per rank is the optimizer's state.
_NEEDS_OPTIMIZER = {
    "optimizer": "shards the optimizer's state, so it needs optimizer= (torch.optim.SGD, Adam or AdamW): each rank then "
    "updates its part of every bucket inside the backward",
    "full": "keeps each parameter's optimizer state 1/N per rank, so it needs optimizer= (a torch.optim optimizer over "
    "model.parameters(), built before graphddp.compile)",
}


def check_optimizer(where: str, config: DDPConfig, optimizer: Any) -> None:
    """``optimizer=`` against the options: at wrap time before any collective, so every rank fails
    alike, and again when :meth:`~graphddp.frontend.replica.Replica.register_comm_hook` adds a hook."""
    missing = optimizer is None or (config.sharding == "full" and not isinstance(optimizer, torch.optim.Optimizer))
    if config.sharding in _NEEDS_OPTIMIZER and missing:
        raise ValueError(f"{where}: sharding={config.sharding!r} {_NEEDS_OPTIMIZER[config.sharding]}")
    if optimizer is not None and config.traced_hook is not None:
        raise ValueError(
            f"{where}: optimizer= with comm_hook={config.traced_hook.name} is not supported yet (the in-graph update "
            "is checked against graphddp's own all-reduce only); compile without optimizer= and step it as usual"
        )
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


class ModelState:
    """A wrapped model's state on this rank, in every mode: what both forms
    (:class:`graphddp.frontend.api.ModelView`) read and run. A mode's class (``Replica``: whole
    replicas, ``FullyShardedState``: this rank's parts) is built after the wrap's last collective,
    from what its :meth:`checked_optimizer` returned before the first, and supplies its residency:
    ``world_size``, ``schedules``, ``named_parameters``, the optimizer's whole state,
    ``compile_graph`` (the torch.compile backend of both forms) and the work around a forward."""

    hook_state: Any = None  # a traced comm hook's state, checkpointed with the module's
    choice: Any = None  # sharding="auto"'s PlacementChoice (graphddp.frontend.auto); None when sharding was given
    step: StepState  # the one owner of the state of a step, the mode's

    @property
    def sync(self) -> bool:
        return self.step.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.step.set_sync(value)

    @property
    def parts(self) -> dict[str, Any]:
        """Whole replicas hold no part (``FullyShardedState`` holds one of every parameter)."""
        return {}

    @property
    def updates(self) -> dict[str, int]:
        """How many synchronising backwards updated inside, and how many left the update to torch's
        step, by reason (:meth:`StepState.not_inside`); empty without an optimizer inside the backward."""
        return self.step.updates()

    def __init__(self, module: nn.Module, group: Any, config: DDPConfig, optimizer: Any) -> None:
        self.module = module
        self.group = group  # every rank: the wrap-time broadcast, the forward's work, the buffers
        self.config = config
        self.optimizer = optimizer
        self.joinable: Any = None  # the view users pass to torch.distributed.algorithms.Join
        self._buffers_next = True  # DDP's require_forward_param_sync: broadcast the buffers before the next forward

    @staticmethod
    def checked_optimizer(where: str, module: nn.Module, config: DDPConfig, optimizer: Any) -> Any:
        """``optimizer=`` as the mode keeps it, checked before any collective."""
        return optimizer

    def buffers_to_broadcast(self) -> list[torch.Tensor]:
        """DDP's rule for ``broadcast_buffers``: the module's buffers go from the group's first rank
        before a forward that follows a synchronising one (the first forward included), so under
        ``no_sync`` and after a ``no_grad`` forward each rank keeps its own until then."""
        if self.config.broadcast_buffers and self._buffers_next and dist.get_world_size(self.group) > 1:
            return list(self.module.buffers())
        return []

    def forward_synchronised(self, syncing: bool) -> None:
        """After a forward: whether it synchronises (grad mode on, outside ``no_sync``), which decides
        the next forward's :meth:`buffers_to_broadcast`."""
        self._buffers_next = syncing

    def finish_gathers(self) -> None:
        """Nothing is left on the wire between steps, unless the mode leaves its all-gathers there."""

    def _whole_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        """The torch optimizer and, where it holds this rank's parts, the ``WholeState`` that takes
        its state whole and back (None: it holds the whole state)."""
        raise NotImplementedError

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        optimizer, whole_state = self._whole_optimizer()
        return optimizer.state_dict() if whole_state is None else whole_state.state_dict(optimizer)

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        optimizer, whole_state = self._whole_optimizer()
        if whole_state is None:
            optimizer.load_state_dict(state)
        else:
            whole_state.load(optimizer, state)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's own, pending all-gathers (``gather="forward"``) completed first."""
        self.finish_gathers()
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # -- checkpoints use the wrapped module's keys; a traced hook's state rides along ------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = self.module.state_dict(*args, **kwargs)
        if self.hook_state is not None:
            out[HOOK_STATE_KEY] = self.hook_state.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        state_dict = dict(state_dict)
        hook = state_dict.pop(HOOK_STATE_KEY, None)
        if hook is not None:
            if self.hook_state is None:
                raise ValueError(f"the checkpoint has {HOOK_STATE_KEY!r} (a comm hook's state), but this module runs no traced comm hook")
            self.hook_state.load_state_dict(hook)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
