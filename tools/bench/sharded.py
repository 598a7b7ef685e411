"""The sharded optimizer next to what users run instead (``--modes sharded``).

Four ways to train with AdamW on N ranks, besides graphddp replicated (``graphddp_optim``) and
eager DDP (``ddp_cap1``):

* ``graphddp_sharded``: ``graphddp.compile(model, optimizer=opt, sharding="optimizer")``: each
  bucket reduce-scattered, this rank's part updated inside the backward, all-gathered and
  written at the end of the backward;
* ``graphddp_sharded_fwd``: the same with ``gather="forward"``: each all-gather completes in the
  next forward, right before the bucket's parameters are first read. Its parameters count the
  all-gathers pending between steps (:func:`param_bytes`); each timed step is preceded by an
  untimed one, so that it waits for that step's all-gathers as a training step does;
* ``ddp_zero``: eager DDP (graphddp's first cap, 1 MB) + ``ZeroRedundancyOptimizer`` (AdamW on
  this rank's parameters, a broadcast of each after the step);
* ``fsdp2``: ``fully_shard`` on every block and the root with ``reshard_after_forward=False``
  (the ZeRO-2 shape: parameters stay whole between forward and backward), AdamW on the local
  shards.

And clipping by the global norm (``--modes sharded_clip``: nanoGPT's ``grad_clip=1.0`` on a
ZeRO-2 run):

* ``graphddp_sharded_clip``: ``graphddp_sharded`` with ``max_grad_norm=1.0``: each rank norms its
  parts as they arrive, one all-reduce of their squares, then every part updated and all-gathered;
* ``graphddp_sharded_fwd_clip``: the same with ``gather="forward"``: the all-gathers, which
  clipping leaves after the backward, complete in the next forward instead;
* ``fsdp2_clip``: ``fsdp2`` with ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` on
  its sharded gradients after the backward (timed as comm), then the optimizer.

And, for full sharding (``--modes full``), parameters held 1/N per rank too:

* ``graphddp_full``: ``graphddp.compile(model, optimizer=opt, sharding="full")`` (each parameter
  gathered where it is read, gathered again in the backward, its gradient reduce-scattered;
  AdamW on each part inside the backward, after its reduce-scatter);
* ``graphddp_full_keep``: the same with ``reshard_after_forward=False``;
* ``fsdp2_reshard``: ``fully_shard`` per block and root with ``reshard_after_forward=True``, as
  users run FSDP2 (its default).

And mixed precision as FSDP2 users set it (``--modes full_mp``), parameters gathered in bf16 and
gradients reduced in fp32 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``, the same policy object for both):

* ``graphddp_full_bf16``: ``graphddp_full`` with ``mp_policy=`` that policy;
* ``fsdp2_reshard_bf16``: ``fsdp2_reshard`` with ``mp_policy=`` that policy on every
  ``fully_shard``.

Each reports, beside the step time and the allocator peak of a step, the bytes of optimizer
state this rank keeps (:func:`state_bytes`) and of the parameters it keeps whole between steps:
what sharding is for.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from tools.bench.modes import TrainMode
from tools.bench.workload import MAX_GRAD_NORM, make_optimizer

SHARDED_MODES = ("graphddp_sharded", "graphddp_sharded_fwd", "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "ddp_zero", "fsdp2", "fsdp2_clip", "graphddp_full",
                 "graphddp_full_keep", "fsdp2_reshard", "graphddp_full_bf16", "fsdp2_reshard_bf16")
GATHER = {"graphddp_sharded": "backward", "graphddp_sharded_fwd": "forward", "graphddp_sharded_clip": "backward",
          "graphddp_sharded_fwd_clip": "forward"}
CLIPPED = ("graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "fsdp2_clip")  # with MAX_GRAD_NORM
# sharding="full": reshard_after_forward per mode (FSDP2's option, same meaning)
FULL = {"graphddp_full": True, "graphddp_full_keep": False, "graphddp_full_bf16": True}
# Mixed precision as FSDP2 users set it: gathers in bf16, reductions in fp32 (graphddp takes FSDP2's policy)
MIXED = ("graphddp_full_bf16", "fsdp2_reshard_bf16")
# the graphddp options a fully sharded run takes from the benchmark's (not its caps: full
# sharding plans its own, graphddp.plan.parts)
FULL_OPTIONS = ("backend", "mode", "options", "verify", "broadcast_buffers", "fullgraph", "dynamic")


def _policy(name: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a mode of :data:`MIXED`, else None."""
    if name not in MIXED:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(opt: Any) -> int:
    """Bytes of optimizer state this rank holds (a DTensor's local shard; ZeRO's local optimizer)."""
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps this rank's optimizer
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = _local(v)
                total += local.numel() * local.element_size()
    return total


def param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps (FSDP2: its shards after the step;
    graphddp with ``gather="forward"``: the updated values on their way too, the all-gathers
    the last backward left for the next forward)."""
    state = getattr(model, "_state", None)
    pending = getattr(getattr(state, "step", None), "gathers", None)
    held = pending.held_bytes() if pending else 0
    # A graphddp module's parameters() completes the pending all-gathers (sharding="full": gathers
    # whole values): count its wrapped module's, the parts with full sharding.
    inner = getattr(model, "module", model)
    return held + sum(_local(p).numel() * _local(p).element_size() for p in inner.parameters())


def build(name: str, base: nn.Module, batch: Any, loss: Callable, graphddp_options: dict[str, Any]) -> tuple[TrainMode, Any]:
    """The mode ``name`` of :data:`SHARDED_MODES`, and the optimizer whose state it keeps."""
    model = copy.deepcopy(base)
    if name in GATHER:
        import graphddp

        opt = make_optimizer(model.parameters())
        clip = {"max_grad_norm": MAX_GRAD_NORM} if name in CLIPPED else {}
        m = graphddp.compile(model, optimizer=opt, **{**graphddp_options, "sharding": "optimizer", "gather": GATHER[name], **clip})
        mode = TrainMode(name, m, None, batch, loss, opt=opt)
        if GATHER[name] == "forward":
            # Its step ends with the all-gathers on the wire; the next step's forward waits for
            # them. Timed alone between barriers they would cross the link in the barrier,
            # outside any step's time (as the 0.88x published before 2026-11-25 did): the timed
            # rounds run one step of it first, so the timed step waits for the all-gathers of the
            # step before, as in training, and then finish its own, untimed (carries_gathers).
            mode.carries_gathers = m.finish_gathers
        return mode, opt
    if name in FULL:
        import graphddp

        opt = make_optimizer(model.parameters())
        options = {k: v for k, v in graphddp_options.items() if k in FULL_OPTIONS}
        if name in MIXED:
            options["mp_policy"] = _policy(name)
        m = graphddp.compile(model, optimizer=opt, sharding="full", reshard_after_forward=FULL[name], **options)
        return TrainMode(name, m, None, batch, loss, opt=opt), opt
    if name == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
        return TrainMode(name, ddp, None, batch, loss, opt=opt), opt
    if name in ("fsdp2", "fsdp2_clip", "fsdp2_reshard", "fsdp2_reshard_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reshard = name not in ("fsdp2", "fsdp2_clip")
        policy = _policy(name) or MixedPrecisionPolicy()  # FSDP2's default: no casts
        for block in _blocks(model):
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
        opt = make_optimizer(model.parameters())
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()), MAX_GRAD_NORM) if name in CLIPPED else None
        return TrainMode(name, model, None, batch, loss, opt=opt, after_backward=clip), opt
    raise ValueError(f"not a sharded mode: {name!r}")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one (as torchtitan wraps transformer blocks)."""
    for attr in ("blocks", "layers"):
        seq = getattr(model, attr, None)
        if isinstance(seq, (nn.ModuleList, nn.Sequential)):
            return list(seq)
    if isinstance(model, nn.Sequential):
        return [m for m in model if any(True for _ in m.parameters())]
    return []
