"""The built-in communication hooks: what a bucket does to its flat buffer around the all-reduce.

DDP's default ``allreduce_hook`` and its ``fp16_compress_hook`` / ``bf16_compress_hook`` (users'
hooks and PowerSGD are traced in place of the all-reduce instead). A built-in hook is a pair of
tensor functions traced with the rest of the bucket on fake tensors: ``compress`` right after the
gradients are flattened (its result is divided and all-reduced: what goes on the wire) and
``decompress`` right after the wait (the bucket's dtype and ``numel``: the gradients are views
into it). Casts use ``comm.CAST``, the prim the decomposed backward graph and the verifier expect.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from graphddp.values.comm import CAST
from graphddp.values.schedule import Bucket

# The built-in hooks users name in ``comm_hook=``, and the dtype each sends buckets in.
COMM_HOOKS = {"fp16_compress": "float16", "bf16_compress": "bfloat16"}

HookFn = Callable[[torch.Tensor, Bucket], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CommHook:
    """A named pair of functions traced around every bucket's all-reduce."""

    name: str
    compress: HookFn
    decompress: HookFn


def _unchanged(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return flat


# DDP's default: send the gradients as they are.
ALLREDUCE = CommHook("allreduce", _unchanged, _unchanged)


def cast_hook(name: str, comm_dtype: str) -> CommHook:
    """Send buckets in ``comm_dtype``. DDP casts, then divides, so the division rounds in
    ``comm_dtype``; this hook only casts, and the division that follows it does the same."""
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
