"""What CUDA graphs (``mode="reduce-overhead"``) do to a small model's step, with and without
data parallelism, and what happens to graphddp when its refusal is lifted (issue 36, item 2).

One process, one GPU, NCCL at world size 1; HF GPT-2 from config (2 layers, dim 256, batch
4 x 256: small enough that launching kernels is much of the step, where CUDA graphs matter),
bf16 autocast, AdamW. Per variant: the step time over timed steps after warm ones, the change in
inductor's ``cudagraph_skips`` counter (a graph inductor declined to capture, with the reason
in the log under ``TORCH_LOGS=perf_hints``), the error if it failed, and, for graphddp under
CUDA graphs, the largest difference of its parameters from graphddp's without after the same
steps. Prints one JSON object; ``--out`` also writes it there.

    python -m tools.bench.cudagraphs --out bench_out/cudagraphs.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

WARM, TIMED = 5, 30


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).cuda()


def _build(kind: str, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import graphddp

    model = _gpt2()
    if kind == "compile":
        wrapped = torch.compile(model, mode=mode)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if kind == "ddp_compiled":
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.compile(model, mode=mode), device_ids=[0])
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return graphddp.compile(model, mode=mode, bucket_cap_mb=4), opt


def _run(kind: str, mode: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    skips_before = counters["inductor"]["cudagraph_skips"]
    model, opt = _build(kind, mode)
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(0)).cuda()
    losses: list[float] = []

    def step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    row: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        for _ in range(WARM):
            losses.append(step().item())
        torch.cuda.synchronize()
        row["first_steps_s"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        for _ in range(TIMED):
            last = step()
        torch.cuda.synchronize()
        row["step_ms"] = round((time.perf_counter() - start) / TIMED * 1e3, 3)
        losses.append(last.item())
        row["params"] = [p.detach().float().cpu() for p in (getattr(model, "module", model)).parameters()]
    except Exception:  # noqa: BLE001 - reported
        row["error"] = traceback.format_exc()[-4000:]
    row["losses"] = losses
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
    torch._dynamo.reset()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kinds", default="compile,ddp_compiled,graphddp")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools.bench.cudagraphs: CUDA is not available; it measures CUDA graphs, nothing to run")
        return 2
    from graphddp.config import inductor_settings

    # Lift graphddp's refusal: what would happen is what this measures.
    inductor_settings.refuse_cuda_graphs = lambda where, mode, given: None
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}}
    for kind in args.kinds.split(","):
        for mode in ("default", "reduce-overhead"):
            row = _run(kind, mode)
            params = row.pop("params", None)
            if params is not None:
                result.setdefault("_params", {})[(kind, mode)] = params
            result["rows"][f"{kind}/{mode}"] = row
            print(kind, mode, {k: v for k, v in row.items() if k != "error"}, row.get("error", "")[-1500:], flush=True)
    saved = result.pop("_params", {})
    for kind in args.kinds.split(","):
        a, b = saved.get((kind, "default")), saved.get((kind, "reduce-overhead"))
        if a is not None and b is not None:
            result["rows"][f"{kind}/reduce-overhead"]["max_param_diff_from_default"] = max(
                (x - y).abs().max().item() for x, y in zip(a, b))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
