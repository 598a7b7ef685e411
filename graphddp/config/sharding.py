"""``sharding=``'s own options, checked once: ``"auto"``'s budget and the knobs it chooses,
``sharding="full"``'s ``reshard_after_forward``, ``replicate_below_mb`` and ``mp_policy`` (FSDP2's
policy object), and what full sharding does not run, refused by name.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from graphddp.config import DDPConfig


def check_auto(config: DDPConfig) -> None:
    """``memory_budget`` belongs to ``sharding="auto"``: bytes (an int) or a fraction of the device's
    memory (a float in (0, 1]); the knobs auto chooses are refused beside it, never overridden."""
    budget = config.memory_budget
    if budget is not None:
        if config.sharding != "auto":
            raise ValueError("memory_budget is an option of sharding='auto' (what its choice must fit); it needs that option")
        fraction = isinstance(budget, float) and 0 < budget <= 1
        if isinstance(budget, bool) or not (fraction or (isinstance(budget, int) and budget > 0)):
            raise ValueError(f"memory_budget must be bytes (a positive int) or a fraction in (0, 1] of the device's memory, got {budget!r}")
    if config.sharding != "auto":
        return
    chosen = [n for n, given in (("gather", config.gather != "backward"), ("reshard_after_forward", config.reshard_after_forward is not None),
                                 ("replicate_below_mb", config.replicate_below_mb is not None)) if given]
    if chosen:
        raise ValueError(f"sharding='auto' chooses gather, reshard_after_forward and replicate_below_mb itself; "
                         f"leave {chosen} out, or choose sharding= yourself")
    _check_mp_policy(config.mp_policy)


def check_full_sharding(config: DDPConfig) -> None:
    """``reshard_after_forward`` and ``mp_policy`` belong to ``sharding="full"`` (None there
    means True, FSDP2's default); what full sharding does not run is refused by name, never
    ignored: first, last and per-bucket caps, a comm hook, the eager backend."""
    if config.sharding != "full":
        for name in ("reshard_after_forward", "replicate_below_mb", "mp_policy"):
            if getattr(config, name) is not None and not (name == "mp_policy" and config.sharding == "auto"):
                whose = {"replicate_below_mb": "", "mp_policy": " (FSDP2's, same meaning) and of 'auto' (which then weighs full "
                         "sharding's placements only)"}.get(name, " (FSDP2's, same meaning)")
                raise ValueError(f"{name} is an option of sharding='full'{whose}; it needs that option")
        return
    _check_mp_policy(config.mp_policy)
    if config.reshard_after_forward is None:
        object.__setattr__(config, "reshard_after_forward", True)
    if not isinstance(config.reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True or False, got {config.reshard_after_forward!r}")
    below = config.replicate_below_mb
    if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 <= below < math.inf):
        raise ValueError(f"replicate_below_mb must be a number of MB >= 0, got {below!r}")
    from graphddp.config import AUTO  # what leaves a cap to the plan

    caps = [n for n in ("first_bucket_cap_mb", "last_bucket_cap_mb", "bucket_cap_mb_list")
            if getattr(config, n) not in (None, AUTO)]
    refused = caps + (["comm_hook"] if config.comm_hook is not None else [])
    if refused:
        raise ValueError(
            f"sharding='full' does not take {refused} yet: its gather and reduce-scatter buckets have one cap, "
            "bucket_cap_mb (or one planned from cost when it is left out), and no comm hook; leave them out"
        )
    if config.backend == "eager":
        raise ValueError("sharding='full' needs backend='inductor' or 'aot_eager' (AOTAutograd places the gathers)")


def _check_mp_policy(policy: Any) -> None:
    """``mp_policy`` is FSDP2's own ``MixedPrecisionPolicy`` (users pass what they pass to
    ``fully_shard``), its dtypes floating point or None."""
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"mp_policy.{name} must be a floating-point torch.dtype or None, got {dtype!r}")
