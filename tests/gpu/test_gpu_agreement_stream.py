"""The per-step agreement never makes the host wait for the GPU's queued work (issue 36).

The agreement (:func:`graphddp.runtime.agree.max_reduce`) is read on the host before each
synchronising backward. On the compute stream its NCCL collective would wait for every kernel
queued before it (the forward), and the host with it: the backward's first kernels would be
launched only once the GPU had run dry. Here a GPU kernel that sleeps ~1 s stands for the
forward; the agreement must come back long before it ends, while the same collective on the
compute stream (what the code did) waits for it, so the test tells the two apart.
NCCL at world size 1 (one GPU): the collective is real, every rank's answer is its own.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from graphddp.runtime import agree

SLEEP_CYCLES = 2_000_000_000  # about 1 s at the clock an H100/H200 runs under load




def _seconds_to_answer(fn) -> tuple[float, float]:
    """(host seconds until ``fn`` returned, seconds until the queued sleep was over)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward's queued kernels
    fn()
    answered = time.perf_counter() - start
    torch.cuda.synchronize()
    return answered, time.perf_counter() - start


def test_the_agreement_is_read_without_waiting_for_queued_kernels(nccl_world_of_one):
    group = nccl_world_of_one
    assert agree.max_reduce([3, -3, 0], group) == [3, -3, 0]  # warm: NCCL's first collective sets up
    answered, drained = _seconds_to_answer(lambda: agree.max_reduce([7, -7, 1], group))
    assert drained > 0.3, f"the sleep kernel took {drained:.3f} s: too short to tell anything"
    assert answered < 0.25 * drained, f"the agreement took {answered:.3f} s of a {drained:.3f} s queue"

    def on_compute_stream() -> None:  # the old code: the collective and the read on the current stream
        t = torch.tensor([7, -7, 1], dtype=torch.int64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t.tolist()

    answered_old, drained_old = _seconds_to_answer(on_compute_stream)
    assert answered_old > 0.75 * drained_old, "on the compute stream the read should wait for the queue"
