"""A steady step's GPU does not sit idle waiting for the per-step agreement (issue 36, item 3).

The agreement is read on the host before each synchronising backward
(:func:`graphddp.runtime.agree.max_reduce_async`). Read on the compute stream it would wait for the
forward's queued kernels, and the host would launch the backward only once the GPU had run dry;
on a stream of its own it waits for its small collective alone. This test measures it in a
profiler trace: the benchmark's HF GPT-2 from config, bf16 autocast, inductor, AdamW, NCCL at world size 1 with the agreement forced on (a group of one
rank has nothing to agree, ``agree.nothing_to_agree``), three ways on one compiled model,
interleaved: the side stream (the code), the compute stream (what the code did), and plain
``torch.compile`` with fused AdamW (no agreement at all, the floor). Per step: the GPU's idle
time (the span from the first kernel to the last, less the union of kernel intervals), traced with
CUDA activity only, and the step's time untraced.

The traces and the figures go to ``GRAPHDDP_GPU_OUT`` (default ``bench_out/``).
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import torch

import graphddp
from graphddp.runtime import agree
from tools.bench import gpu_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10


# The benchmark's GPT-2 (6 layers, dim 768, vocab 50304, batch 8 x 1024): the GPU's work per step
# is longer than the host's, so the host runs ahead, as in real training, unless something makes it
# wait. (A small model is launch-bound: the GPU idles most of every step whatever the agreement does.)
LAYERS, DIM, VOCAB, BATCH, SEQ = 6, 768, 50304, 8, 1024


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=LAYERS, n_embd=DIM, n_head=12, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).cuda()


def _profile(step, out: str, name: str) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # CUDA activity only: recording every CPU op would slow the host enough to starve the GPU by itself
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    path = os.path.join(out, f"host_gaps_{name}.json")
    prof.export_chrome_trace(path)
    figures = gpu_profile.busy_idle_ms(path, STEPS)
    start = time.perf_counter()  # and the step's time without the profiler
    for _ in range(2 * STEPS):
        step()
    torch.cuda.synchronize()
    figures["step_ms"] = (time.perf_counter() - start) / (2 * STEPS) * 1e3
    return figures


def _stepper(model: torch.nn.Module, opt: torch.optim.Optimizer):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).cuda()

    def step() -> None:  # no .item(): nothing in the loop makes the host wait for the GPU
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# Measured on an H200 (torch 2.11+cu130), 2026-11-26, best of three rounds: GPU idle per step
# 0.60 ms plain, 1.30 ms with the agreement on its side stream, 2.56 ms on the compute stream;
# steps 13.18 / 13.30 / 13.59 ms. The side stream halves the wait, but does not end it: the
# trace shows the backward's first kernel ~0.23 ms after the agreement's device-to-host copy,
# with the GPU idle in between. NCCL's kernel for the agreement gets SMs only as the forward's
# last kernels free them, so the host still learns the answer about when the forward ends.
# What would end it: agreeing over a CPU (gloo) group beside NCCL's, off the GPU entirely.
@pytest.mark.xfail(reason="the agreement over NCCL still leaves the GPU ~0.2 ms idle per step (H200)", raises=AssertionError, strict=False)
def test_the_gpu_does_not_wait_for_the_agreement(nccl_world_of_one, monkeypatch):
    out = os.environ.get("GRAPHDDP_GPU_OUT", os.path.join(ROOT, "bench_out"))
    os.makedirs(out, exist_ok=True)
    plain = torch.compile(_gpt2())
    plain_step = _stepper(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True))

    monkeypatch.setattr(agree, "nothing_to_agree", lambda group: False)  # agree at world size 1
    calls = []
    real = agree.max_reduce_async  # what every agreement issues, blocking or gated
    monkeypatch.setattr(agree, "max_reduce_async", lambda values, group, *rest: calls.append(len(values)) or real(values, group, *rest))
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as plain's: only the agreement differs
    ours = graphddp.compile(model, bucket_cap_mb=25)
    ours_step = _stepper(ours, opt)

    side = agree._side_stream
    figures: dict[str, list[dict[str, float]]] = {"compile": [], "side_stream": [], "compute_stream": []}
    for round_ in range(3):  # interleaved, so drift in clocks or load falls on every variant
        figures["compile"].append(_profile(plain_step, out, f"compile_{round_}"))
        monkeypatch.setattr(agree, "_side_stream", side)
        figures["side_stream"].append(_profile(ours_step, out, f"side_stream_{round_}"))
        monkeypatch.setattr(agree, "_side_stream", lambda device: contextlib.nullcontext())
        figures["compute_stream"].append(_profile(ours_step, out, f"compute_stream_{round_}"))
    assert calls, "the agreement never ran: the figures would say nothing about it"
    idle = {k: min(r["idle_ms"] for r in v) for k, v in figures.items()}
    with open(os.path.join(out, "host_gaps.json"), "w") as f:
        json.dump({"figures": figures, "idle_ms_per_step": idle, "device": torch.cuda.get_device_name(0),
                   "torch": torch.__version__}, f, indent=1)
    print("GPU idle ms per step:", idle, figures)
    assert idle["side_stream"] < idle["compute_stream"], idle
    assert idle["side_stream"] <= 1.25 * idle["compile"] + 0.1, idle
