"""The GPU lane's cases: graphddp against DDP(torch.compile) + the same torch.optim, on CUDA.

A case is (setup, model, mode):

* setup ``nccl1``: one process, NCCL at world size 1 (two NCCL ranks cannot share one GPU:
  "Duplicate GPU detected"). No average to check, but every mode compiles and runs through
  inductor's GPU-only paths (comprehensive padding, pad_mm, device-keyed passes) and the
  sharded modes issue their reduce-scatters and all-gathers through NCCL's lowering.
* setup ``gloo2``: two processes, gloo, both holding CUDA tensors on the one GPU: a real
  average across ranks with CUDA tensors, rank-dependent batches.

Every case trains 3 steps under autocast (bf16; fp16 with ``GradScaler`` for the scaler mode)
and inductor, and compares graphddp's parameters with DDP's after each step (and the
gradients, where the optimizer runs after the backward). Run as a script by ``test_gpu_lane.py``:
``python tests/gpu/lane.py CASE RANK WORLD STORE RESULT`` writes ``RESULT`` as JSON
(``{"ok": bool, "error": str, "max_param_diff": float, ...}``). ``--device cpu`` runs the same
code on CPU with aot_eager: a check of the lane itself without a GPU, not a GPU test.
"""
from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import graphddp  # noqa: E402
from graphddp.models import CNN  # noqa: E402
from graphddp.hooks.examples import ddp_bf16_compress_hook  # noqa: E402

LR = 1e-3
STEPS = 3
# Where the optimizer runs after the backward, the gradients are compared too (after the average,
# before the step): relative to each gradient's size, what bf16 rounding of two compiled programs allows.
GRAD_RTOL = 2e-2
# AdamW moves every parameter by about LR per step, whatever the gradient's size. Where both
# sides run torch's AdamW on the same averaged gradients, parameters agree to a small fraction of
# that. The optimizer inside runs torch's single-tensor AdamW math compiled into the backward,
# against torch's AdamW(foreach=False): rounding differs, and for an element whose gradient is
# near eps (a rare token's embedding row) m/sqrt(v) turns it into a difference of a fraction of LR.
# Under bf16 autocast the two runs' parameters differ by ~1e-8 after one step, the next forward
# rounds that into gradients that differ at bf16's 1e-2, and an element whose gradient is pure
# rounding noise (attention's key bias, which softmax ignores) gets a random +-LR from AdamW.
# So where the optimizer runs in the graph the check is global: the distance between the two
# runs' parameters, against how far training moved them (a missing, doubled or misdirected
# update is a distance of the order of the move), and the losses.
PARAM_ATOL = 0.05 * LR
IN_GRAPH_REL = 0.05
LOSS_RTOL = 1e-2

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "optimizer": {"optimizer": True},
    "sharded": {"optimizer": True, "sharding": "optimizer"},
    "sharded_fwd": {"optimizer": True, "sharding": "optimizer", "gather": "forward"},
    "bf16_compress": {"comm_hook": "bf16_compress"},
    "fp16_compress": {"comm_hook": "fp16_compress"},
    # fp32: a rank-2 approximation of bf16-noisy gradients is not stable from run to run
    "powersgd": {"comm_hook": "powersgd", "amp": None},
    "fp16_scaler": {"scaler": True},
    # nanoGPT's loop: micro-steps with require_backward_grad_sync, the last one synchronising
    # (graphddp carries the accumulated gradients into its buckets), and with the optimizer
    # inside, clipping by global norm in the graph (DDP's side: clip_grad_norm_ before step)
    "accumulate": {"micro": 2},
    "optimizer_clip": {"optimizer": True, "micro": 2, "clip": 1.0},
    # parameters held as parts, gathered in the forward and backward; the user's AdamW steps the
    # parts after the backward (compared globally, as the optimizer inside is: its AdamW runs
    # foreach on parts, DDP's side foreach=False on whole tensors)
    "full": {"optimizer": True, "sharding": "full"},
    "full_keep": {"optimizer": True, "sharding": "full", "reshard_after_forward": False},
    # the user's AdamW(fused=True), nanoGPT's on a GPU: its steps live on the GPU (torch's
    # _init_group), where the compiled update reads them; micro-steps, so a step after no_sync
    # runs too (in the graph, or torch's fused step where the graph leaves it)
    "optimizer_fused": {"optimizer": True, "fused": True, "micro": 2},
    "sharded_fused": {"optimizer": True, "sharding": "optimizer", "fused": True},
    # nanoGPT's train.py with ZeRO-2 on a GPU: micro-steps, fused AdamW, grad_clip=1.0 (each rank
    # norms its parts; one all-reduce of their squares gives the global norm)
    "sharded_clip": {"optimizer": True, "sharding": "optimizer", "fused": True, "micro": 2, "clip": 1.0},
}
# (setup, model, mode): what the lane runs. Each nccl1 case is one process, each gloo2 case two.
CASES: tuple[tuple[str, str, str], ...] = (
    ("nccl1", "gpt2", "default"), ("nccl1", "gpt2", "optimizer"), ("nccl1", "gpt2", "sharded"),
    ("nccl1", "gpt2", "sharded_fwd"), ("nccl1", "gpt2", "fp16_scaler"), ("nccl1", "cnn", "optimizer"),
    ("gloo2", "gpt2", "default"), ("gloo2", "gpt2", "optimizer"), ("gloo2", "gpt2", "sharded"),
    ("gloo2", "gpt2", "bf16_compress"), ("gloo2", "gpt2", "powersgd"), ("gloo2", "cnn", "fp16_compress"),
    ("gloo2", "cnn", "sharded_fwd"), ("gloo2", "cnn", "fp16_scaler"),
    ("nccl1", "gpt2", "optimizer_clip"), ("gloo2", "gpt2", "accumulate"), ("gloo2", "gpt2", "optimizer_clip"),
    ("nccl1", "gpt2", "full"), ("nccl1", "cnn", "full_keep"), ("gloo2", "gpt2", "full"),
    ("gloo2", "gpt2", "optimizer_fused"), ("nccl1", "gpt2", "sharded_fused"), ("gloo2", "gpt2", "sharded_clip"),
)
POWERSGD = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1)
POWERSGD_CAP = 0.05  # MB


def case_name(case: tuple[str, str, str]) -> str:
    return "-".join(case)


def world_of(setup: str) -> int:
    return 2 if setup == "gloo2" else 1


def make_model(name: str) -> tuple[nn.Module, Callable[[int, int, torch.device], tuple], Callable[[Any, tuple], torch.Tensor]]:
    """(model, batch(rank, step, device), loss(output, batch)) from seed 0."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=256,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)

        def batch(rank: int, step: int, device: torch.device) -> tuple:
            g = torch.Generator().manual_seed(100 * rank + step)
            ids = torch.randint(0, 4096, (4, 256), generator=g).to(device)
            return (ids,), {"labels": ids}

        return model, batch, lambda out, b: out.loss

    model = CNN()

    def cnn_batch(rank: int, step: int, device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(32, 3, 16, 16, generator=g).to(device)
        return (x,), {"target": torch.randint(0, 10, (32,), generator=g).to(device)}

    return model, cnn_batch, lambda out, b: F.cross_entropy(out.float(), b[1]["target"])


def _ddp_hook(mode: str) -> tuple[Any, Callable] | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd

    if mode == "bf16_compress":
        return None, default_hooks.bf16_compress_hook if dist.get_backend() == "nccl" else ddp_bf16_compress_hook
    if mode == "fp16_compress":
        return None, default_hooks.fp16_compress_hook
    if mode == "powersgd":
        def serial(state, bucket):  # type: ignore[no-untyped-def] # unannotated: DDP checks the annotations; waited inside: gloo deadlocks with two in flight
            fut = ddp_powersgd.powerSGD_hook(state, bucket)
            fut.wait()
            return fut

        return ddp_powersgd.PowerSGDState(None, **POWERSGD), serial
    return None


def autocast_dtype(mode: str) -> torch.dtype | None:
    """The dtype a case's steps run under autocast (None: fp32, no autocast)."""
    return torch.float16 if MODES[mode].get("scaler", False) else MODES[mode].get("amp", torch.bfloat16)


def _graphddp_kwargs(mode: str, opt: torch.optim.Optimizer, backend: str) -> dict[str, Any]:
    spec = dict(MODES[mode])
    kwargs: dict[str, Any] = {"backend": backend}
    if spec.pop("optimizer", False):
        kwargs["optimizer"] = opt
    spec.pop("scaler", None)
    spec.pop("amp", None)
    spec.pop("micro", None)
    spec.pop("fused", None)
    clip = spec.pop("clip", None)
    if clip is not None:
        kwargs["max_grad_norm"] = clip
    hook = spec.pop("comm_hook", None)
    if hook == "powersgd":
        from graphddp.hooks import PowerSGD

        kwargs["comm_hook"] = PowerSGD(**POWERSGD)
        kwargs["bucket_cap_mb"] = POWERSGD_CAP
    elif hook is not None:
        kwargs["comm_hook"] = hook
    kwargs.update(spec)
    return kwargs


def _inner(module: nn.Module) -> nn.Module:
    return getattr(module, "_orig_mod", module)


def run_case(case: tuple[str, str, str], rank: int, world: int, device: torch.device, backend: str) -> dict[str, Any]:
    setup, model_name, mode = case
    model, batch, loss_fn = make_model(model_name)
    model = model.to(device)
    ddp_kwargs: dict[str, Any] = {"device_ids": [device.index or 0]} if device.type == "cuda" else {}
    reference = torch.compile(copy.deepcopy(model), backend=backend)
    if mode == "powersgd":
        # PowerSGD's random matrices are drawn per bucket: the buckets must be DDP's, which for a
        # given cap the eager DDP reducer has and graphddp plans (tests/ranks/test_hooks_ranks.py).
        ddp_kwargs["bucket_cap_mb"] = POWERSGD_CAP
        reference = reference._orig_mod
    ref = nn.parallel.DistributedDataParallel(reference, **ddp_kwargs)
    hook = _ddp_hook(mode)
    if hook is not None:
        ref.register_comm_hook(*hook)
    theirs = copy.deepcopy(model)
    in_graph = "optimizer" in MODES[mode]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, foreach=False if in_graph else None)
    start = [p.detach().clone() for p in ref.parameters()]
    opt_ours = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=0.01, fused=MODES[mode].get("fused"))
    if os.environ.get("GRAPHDDP_GPU_LANE_SELF_CHECK") == "1" and not in_graph:
        # DDP over the eager model in graphddp's place: how far rounding alone takes two correct
        # programs apart in this case (a figure for the tolerances, not a test of graphddp)
        ours = nn.parallel.DistributedDataParallel(theirs, **ddp_kwargs)
        if hook is not None:
            ours.register_comm_hook(*hook)
    else:
        ours = graphddp.compile(theirs, **_graphddp_kwargs(mode, opt_ours, backend))
    scaler = MODES[mode].get("scaler", False)
    dtype = autocast_dtype(mode)
    scalers = [torch.amp.GradScaler(device.type) for _ in range(2)] if scaler else [None, None]
    worst_param, worst_grad = 0.0, 0.0
    micro = MODES[mode].get("micro", 1)
    clip = MODES[mode].get("clip")
    for step in range(STEPS):
        for k in range(micro):
            b = batch(rank, step * micro + k, device)
            losses = []
            for m, opt, sc in ((ref, opt_ref, scalers[0]), (ours, opt_ours, scalers[1])):
                m.require_backward_grad_sync = k == micro - 1  # nanoGPT's switch, on both
                with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    args, kw = b
                    out = m(*args, **{key: v for key, v in kw.items() if key != "target"})
                    loss = loss_fn(out, b) / micro
                losses.append(loss.item())
                (sc.scale(loss) if sc is not None else loss).backward()
            if abs(losses[1] - losses[0]) > LOSS_RTOL * abs(losses[0]):
                raise AssertionError(f"step {step} micro-step {k}: loss {losses[1]:.6g}, DDP's {losses[0]:.6g}")
        if not in_graph:
            errors = {}
            for (name, p), q in zip(ours.module.named_parameters(), _inner(ref.module).parameters()):
                if p.grad is None or q.grad is None:
                    if (p.grad is None) != (q.grad is None):
                        raise AssertionError(f"step {step} grad {name}: graphddp {p.grad is None and 'None'}, DDP {q.grad is None and 'None'}")
                    continue
                err = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12)).item()
                worst_grad = max(worst_grad, err)
                errors[name] = (err, q.grad.float().norm().item())
            bad = {n: e for n, e in errors.items() if e[0] > GRAD_RTOL}
            if bad:
                listed = ", ".join(f"{n}: {e:.3g} of norm {g:.3g}" for n, (e, g) in errors.items())
                raise AssertionError(f"step {step}: grads of {sorted(bad)} differ from DDP's by more than {GRAD_RTOL} "
                                     f"(relative); every parameter: {listed}")
        if clip is not None:  # DDP's side clips the averaged gradients; graphddp's did, in the graph
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for opt, sc in ((opt_ref, scalers[0]), (opt_ours, scalers[1])):
            if sc is not None:
                sc.step(opt)
                sc.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        # ours.parameters(), not ours.module's: with gather="forward" it completes the pending all-gathers
        apart, moved = 0.0, 0.0
        for (name, _), p, q, q0 in zip(ours.module.named_parameters(), ours.parameters(), _inner(ref.module).parameters(), start):
            d = p.detach().float() - q.detach().float()
            diff = d.abs().max().item()
            worst_param = max(worst_param, diff)
            if not in_graph and diff > PARAM_ATOL:
                raise AssertionError(f"step {step} param {name}: max difference {diff:.3g} > {PARAM_ATOL}")
            apart += d.square().sum().item()
            moved += (q.detach().float() - q0.float()).square().sum().item()
        if in_graph and apart ** 0.5 > IN_GRAPH_REL * moved ** 0.5:
            raise AssertionError(f"step {step}: parameters {apart ** 0.5:.3g} apart from DDP's, "
                                 f"against {moved ** 0.5:.3g} moved by training (limit {IN_GRAPH_REL})")
    return {"max_param_diff": worst_param, "max_grad_rel_diff": worst_grad, "steps": STEPS, "losses": losses}


def main(argv: list[str]) -> int:
    name, rank, world, store, result = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    on_cpu = "--device" in argv and argv[argv.index("--device") + 1] == "cpu"
    faulthandler.enable(all_threads=True)  # a rank that dies in C++ says where
    case = tuple(name.split("-"))
    # cuDNN's weight gradients may use atomics: fp16 + BatchNorm (whose backward cancels) made two
    # runs of the same step differ by 10% on a conv's weight gradient once, under load.
    torch.backends.cudnn.deterministic = True
    report: dict[str, Any] = {"case": name, "rank": rank, "ok": False}
    try:
        if on_cpu:
            device, backend = torch.device("cpu"), "aot_eager"
            dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        else:
            device, backend = torch.device("cuda", 0), "inductor"
            torch.cuda.set_device(device)
            kind = "nccl" if case[0] == "nccl1" else "gloo"
            dist.init_process_group(kind, store=dist.FileStore(store, world), rank=rank, world_size=world,
                                    **({"device_id": device} if kind == "nccl" else {}))
        report.update(run_case(case, rank, world, device, backend))  # type: ignore[arg-type]
        report["ok"] = True
        report["torch"] = torch.__version__
        report["device"] = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the test
        report["error"] = traceback.format_exc()[-6000:]
    with open(result, "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0 if report["ok"] else 1)  # skip teardown: NCCL/gloo objects at interpreter exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
