"""DDP's ``register_comm_hook(state, hook)``, as a value of graphddp's ``comm_hook=`` option.

DDP's own hooks are written for eager execution (Futures, state mutated in Python), so tracing them
would fail; four have an in-graph equivalent (:data:`_GROUP_HOOKS`, and ``powerSGD_hook`` as
:class:`graphddp.hooks.PowerSGD`), so a swap from DDP keeps working. DDP's other hooks are refused by
name; any other hook is the user's own, traced as ``comm_hook=(state, hook)``. The user's view of
each case: docs/options.md.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd

from graphddp.hooks.powersgd import PowerSGD
from graphddp.values.comm import group_name_of

_TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
# DDP's hooks whose state is the process group they average over, and graphddp's hook for each.
_GROUP_HOOKS: dict[Callable[..., Any], str | None] = {
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: "fp16_compress",
    default_hooks.bf16_compress_hook: "bf16_compress",
}
MAPPED = ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "powerSGD_hook")
# A PowerSGDState's settings, which graphddp's PowerSGD takes under the same names.
_POWERSGD_SETTINGS = (
    "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback", "warm_start",
    "orthogonalization_epsilon", "batch_tensors_with_same_shape",
)


def as_comm_hook(where: str, state: object, hook: Callable[..., Any], group: Any) -> tuple[Any, str]:
    """``(comm_hook= value, the hook's name for messages)`` for DDP's ``(state, hook)``."""
    if not callable(hook):
        raise TypeError(f"{where}: hook must be callable, as DDP's register_comm_hook requires; got {hook!r}")
    name = getattr(hook, "__qualname__", None) or repr(hook)
    for ddp_hook, comm_hook in _GROUP_HOOKS.items():
        if hook is ddp_hook:  # by identity: a user's callable need not be hashable
            _check_group(where, f"{name}'s state (its process group)", state, group)
            return comm_hook, name
    if hook is ddp_powersgd.powerSGD_hook:
        return _powersgd(where, state, group), name
    if (getattr(hook, "__module__", None) or "").startswith(_TORCH_HOOKS):
        raise ValueError(
            f"{where}: DDP's {hook.__module__}.{name} has no in-graph equivalent in graphddp, which maps DDP's "
            f"{', '.join(MAPPED)}; write it as a traced hook (docs/comm-hooks.md) and pass that"
        )
    return (state, hook), name


def _check_group(where: str, what: str, state_group: Any, group: Any) -> None:
    """The group a DDP hook's state names (None: WORLD) must be the model's."""
    named = state_group if state_group is not None else dist.group.WORLD
    if named is group or group_name_of(named) == group_name_of(group):
        return
    raise ValueError(
        f"{where}: {what} is process group {group_name_of(named)!r}{' (None: WORLD)' if state_group is None else ''}, "
        f"but this model averages over group {group_name_of(group)!r} (graphddp.compile's process_group=): "
        "graphddp runs a hook on the model's group only"
    )


def _powersgd(where: str, state: Any, group: Any) -> PowerSGD:
    """graphddp's PowerSGD with a ``PowerSGDState``'s settings, random stream and step count. The state is
    read once: the hook keeps its own, so the DDP state's ``iter`` and statistics do not move."""
    if not isinstance(state, ddp_powersgd.PowerSGDState):
        raise TypeError(f"{where}: powerSGD_hook's state must be a PowerSGDState, got {type(state).__name__}")
    _check_group(where, "the PowerSGDState's process_group", state.process_group, group)
    used = [f for f in ("error_dict", "p_memory_dict", "q_memory_dict") if getattr(state, f)]
    if used:
        raise ValueError(
            f"{where}: the PowerSGDState has compressed already: its {used} hold tensors of DDP's buckets, "
            "which graphddp's buckets do not reuse; register a fresh PowerSGDState"
        )
    hook = PowerSGD(**{setting: getattr(state, setting) for setting in _POWERSGD_SETTINGS})
    # random_seed is not kept by PowerSGDState, only the stream it seeded: continue that stream.
    hook.load_extra_state({"iter": state.iter, "rng": state.rng.get_state()})
    return hook
