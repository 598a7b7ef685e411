"""Communication hooks: what a bucket does to its flat buffer on each side of the all-reduce.

Users' hooks, ``comm_hook=(state, hook)``, and PowerSGD (``graphddp.hooks.PowerSGD``) are
traced into the graph in place of the all-reduce: :mod:`graphddp.hooks.traced`,
:mod:`graphddp.hooks.powersgd`. This module's built-in hooks are the default and compression ones.

A hook is a pair of plain tensor functions, traced into the backward graph with the rest of
the bucket (``graph/bucket_function.py``, which ``graph/insert_comm.py`` traces):

* ``compress(flat, bucket) -> tensor``: runs right after the bucket's gradients are flattened;
  its result is divided by the world size and all-reduced (so it is what goes on the wire).
* ``decompress(reduced, bucket) -> tensor``: runs right after the wait; its result must have
  the bucket's dtype and ``bucket.numel`` elements, and the gradients are returned as views
  into it.

Both are traced on fake tensors, never run eagerly, so they must be traceable: torch ops on
their input, no data-dependent Python control flow, no tensor constants. ``bucket`` is the
Schedule's :class:`~graphddp.values.schedule.Bucket` (index, dtype, slots, ``comm_dtype``).

The built-in hooks are DDP's default ``allreduce_hook`` (no compression) and its
``fp16_compress_hook`` / ``bf16_compress_hook`` (cast to half precision before dividing, cast
back after the wait), named in :data:`COMM_HOOKS`. Casts use ``comm.CAST``, the prim
the already-decomposed backward graph (and the verifier) expects.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from graphddp.hooks.powersgd import PowerSGD
from graphddp.hooks.traced import HOOK_STATE_KEY, GradBucket, TracedHook
from graphddp.values.comm import CAST
from graphddp.values.schedule import Bucket

__all__ = ["ALLREDUCE", "BUILTIN", "HOOK_STATE_KEY", "CommHook", "GradBucket", "PowerSGD", "TracedHook", "cast_hook", "for_bucket"]

# The built-in hooks users name in ``comm_hook=``, and the dtype each sends buckets in.
COMM_HOOKS = {"fp16_compress": "float16", "bf16_compress": "bfloat16"}

HookFn = Callable[[torch.Tensor, Bucket], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CommHook:
    """A named pair of functions traced around every bucket's all-reduce (module docstring)."""

    name: str
    compress: HookFn
    decompress: HookFn


def _unchanged(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return flat


# DDP's default: send the gradients as they are.
ALLREDUCE = CommHook("allreduce", _unchanged, _unchanged)


def cast_hook(name: str, comm_dtype: str) -> CommHook:
    """Send buckets in ``comm_dtype`` (DDP's ``fp16_compress_hook`` when it is float16).

    DDP casts first and then divides, so the division rounds in ``comm_dtype``; this hook
    only casts, and the division that follows it does the same.
    """
    wire = getattr(torch, comm_dtype)

    def compress(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return CAST(flat, wire)

    def decompress(reduced: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return CAST(reduced, getattr(torch, bucket.dtype))

    return CommHook(name, compress, decompress)


BUILTIN: dict[str, CommHook] = {name: cast_hook(name, dtype) for name, dtype in COMM_HOOKS.items()}
# The Schedule records a bucket's dtype on the wire, not its hook's name; among the built-in
# hooks the one determines the other.
_BY_COMM_DTYPE: dict[str | None, CommHook] = {None: ALLREDUCE} | {COMM_HOOKS[n]: h for n, h in BUILTIN.items()}


def for_bucket(bucket: Bucket) -> CommHook:
    """The built-in hook a planned bucket asks for by its ``comm_dtype``."""
    if bucket.comm_dtype not in _BY_COMM_DTYPE:
        known = sorted(d for d in _BY_COMM_DTYPE if d)
        raise RuntimeError(f"graphddp: bucket {bucket.index} travels in {bucket.comm_dtype}, which no built-in hook sends (they send {known})")
    return _BY_COMM_DTYPE[bucket.comm_dtype]
