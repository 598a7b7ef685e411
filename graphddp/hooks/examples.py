"""Comm hooks as users write them for ``comm_hook=(state, hook)``, in DDP's vocabulary, and a
reference DDP runs where it refuses its own: examples the tests run against DDP's hooks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def fp16_hook(state, bucket):
    """DDP's fp16_compress_hook in DDP's vocabulary, returning the tensor instead of a Future."""
    wire = bucket.buffer().to(torch.float16).div_(bucket.world_size)
    return funcol.all_reduce(wire, "sum", bucket.group).to(bucket.buffer().dtype)


def int8_hook(state, bucket):
    """Two stages: the scale's max first, then the quantised sum (docs/comm-hooks.md's example)."""
    flat = bucket.buffer()
    scale = funcol.all_reduce(flat.abs().amax(), "max", bucket.group) / 127
    q = (flat / scale).round().to(torch.int8)
    total = funcol.all_reduce(q.to(torch.int32), "sum", bucket.group)
    return total.to(flat.dtype) * scale / bucket.world_size


def ddp_bf16_compress_hook(state, bucket):  # unannotated: DDP checks a hook's annotations
    """DDP's ``bf16_compress_hook`` without its check for NCCL, for DDP's ``register_comm_hook``:
    the reference graphddp's ``comm_hook="bf16_compress"`` is tested against on gloo ranks."""
    wire = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())

    def back(fut: torch.futures.Future) -> torch.Tensor:
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(wire, async_op=True).get_future().then(back)
