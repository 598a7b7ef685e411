"""Measure each rank's tensor bytes between steps and at a step's peak, per placement, on gloo CPU ranks.

Between steps: every CPU tensor storage alive after ``opt.step(); opt.zero_grad()`` (found through
``gc``, each storage once). Peak: that, plus the most bytes the profiler (``profile_memory=True``)
sees allocated above a step's start during the step (:func:`step_peak`). Usage: ``python -m tools.memory_check [--world 2] [--model mlp]``.
"""
from __future__ import annotations

import argparse
import warnings
import gc
import json
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

# graphddp.plan.memory's placements as compile options
PLACEMENTS: dict[str, dict[str, Any]] = {
    "replicated": {},
    "optimizer_inside": {"optimizer": True},
    "optimizer": {"optimizer": True, "sharding": "optimizer"},
    "full": {"optimizer": True, "sharding": "full", "reshard_after_forward": True},
    "full_no_reshard": {"optimizer": True, "sharding": "full", "reshard_after_forward": False},
    # the parameters under 100 KB whole on every rank: the MLP's first and last weights and its biases
    "full_small_whole": {"optimizer": True, "sharding": "full", "reshard_after_forward": True, "replicate_below_mb": 0.1},
    # FSDP2's usual mixed precision: computed and gathered in bfloat16, gradients reduced in float32
    "full_bf16": {"optimizer": True, "sharding": "full", "reshard_after_forward": True, "mp_policy": "bf16"},
}


def _bf16() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


BF16 = _bf16()

# bytes a step may end above its start and still be trusted: a few small tensors (a step counter, a scalar)
UNSEEN_SLACK = 4096


def storages_alive() -> int:
    """Bytes of every distinct CPU tensor storage a Python object holds now."""
    gc.collect()
    warnings.filterwarnings("ignore", category=FutureWarning)  # isinstance() on torch.distributed's deprecated names
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch._subclasses.FakeTensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def step_peak(step: Callable[[], None], measured: int = 8) -> int:
    """The most bytes allocated above the start of a step while it runs, over ``measured`` steps
    profiled after a first one: the least peak among the steps that end where they began.

    The profiler records the frees of the threads it profiles; a gloo thread that drops a
    collective's last reference frees a tensor it does not see. A step where that happened ends
    with those bytes still counted although the storages alive between steps are the same, so its
    peak is not trusted (docs/memory.md). No trusted step is an error, not a figure.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()  # its allocations are seen, so the measured steps' frees of them are too
            for i in range(measured):
                with record_function(f"measured {i}"):
                    step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    events = list(prof.profiler.kineto_results.events())
    starts = sorted(e.start_ns() for e in events if e.name().startswith("measured "))
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    peaks, unbalanced = [], []
    for begin, end in zip(starts, starts[1:] + [max(e.start_ns() for e in mem) + 1]):
        live = sum(e.nbytes() for e in mem if e.start_ns() < begin)
        start = peak = live
        for e in (e for e in mem if begin <= e.start_ns() < end):
            live += e.nbytes()
            peak = max(peak, live)
        (unbalanced if live - start > UNSEEN_SLACK else peaks).append(peak - start)
    if not peaks:
        raise RuntimeError(f"every one of {measured} profiled steps ended with bytes the profiler never saw freed "
                           f"(peaks {unbalanced}); measure again with more steps")
    return min(peaks)


# -- the models: big enough that parameters, state and activations dominate, still cheap ------------


def mlp() -> tuple[nn.Module, Callable[[int, int], tuple]]:
    from graphddp.models import MLP

    def batch(rank: int, step: int) -> tuple:
        g = torch.Generator().manual_seed(100 * rank + step)
        return (torch.randn(64, 64, generator=g),)
    return MLP(width=256, depth=4, d_in=64, d_out=16), batch


def gpt2() -> tuple[nn.Module, Callable[[int, int], tuple]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                       attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False))

    def batch(rank: int, step: int) -> tuple:
        idx = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(100 * rank + step))
        return ({"input_ids": idx, "labels": idx},)
    return model, batch


def bert() -> tuple[nn.Module, Callable[[int, int], tuple]]:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0))

    def batch(rank: int, step: int) -> tuple:
        idx = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(100 * rank + step))
        return ({"input_ids": idx, "labels": idx},)
    return model, batch


MODELS = {"mlp": mlp, "gpt2": gpt2, "bert": bert}


def loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.square().mean()
    return out.loss


def call(model: nn.Module, args: tuple) -> Any:
    return model(**args[0]) if isinstance(args[0], dict) else model(*args)


def measure(rank: int, model_name: str, placement: str, mesh: tuple[int, int] | None = None, backend: str = "aot_eager") -> dict[str, int]:
    """One placement's bytes on this rank: between steps and at the peak (``mesh``: hybrid sharding's shape)."""
    import graphddp
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    base = storages_alive()  # what earlier placements in this process left
    torch.manual_seed(0)
    model, batch = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = dict(PLACEMENTS[placement])
    if options.get("mp_policy") == "bf16":
        options["mp_policy"] = BF16
    if options.pop("optimizer", False):
        options["optimizer"] = opt
    if mesh is not None:
        options["device_mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    ours = graphddp.compile(model, backend=backend, **options)
    steps = iter(range(100))

    def step() -> None:
        args = batch(rank, next(steps))
        loss_of(call(ours, args)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    dist.barrier()
    between = storages_alive() - base
    peak = between + step_peak(step)
    dist.barrier()
    del ours, model, opt
    gc.collect()
    return {"between_steps": between, "peak": peak}


def predicted(model_name: str, world: int, placements: list[str], shard: int | None = None) -> dict[str, Any]:
    """graphddp's prediction of each placement, from one trace of the model."""
    from graphddp.compiler.model_trace import trace_model
    from graphddp.plan.memory import predict

    torch.manual_seed(0)
    model, batch = MODELS[model_name]()
    args = batch(0, 0)
    example = args[0] if isinstance(args[0], dict) else tuple(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    facts = trace_model(model, example, opt, min_cut=False).memory
    policy = {p for p in placements if PLACEMENTS[p].get("mp_policy")}
    under_policy = trace_model(model, example, opt, min_cut=False, mp_policy=BF16).memory if policy else None

    def one(name: str) -> Any:
        options = PLACEMENTS[name]
        placement = "full" if name in ("full_small_whole", "full_bf16") else name
        whole_below = int(options.get("replicate_below_mb", 0) * 2**20)
        return predict(under_policy if name in policy else facts, placement, world,
                       shard if placement not in ("replicated", "optimizer_inside") else None, whole_below)

    return {p: one(p) for p in placements}


def compare(rank: int, world: int, cases: list[tuple[str, str]], mesh: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Measured and predicted bytes of rank 0 for each ``(model, placement)``: rows on rank 0, [] on the others."""
    rows = []
    facts_of: dict[str, dict[str, Any]] = {}
    for model_name, placement in cases:
        got = measure(rank, model_name, placement, mesh)
        if rank:
            continue
        if model_name not in facts_of:
            facts_of[model_name] = predicted(model_name, world, [p for m, p in cases if m == model_name], mesh[1] if mesh else None)
        want = facts_of[model_name][placement]
        rows.append({"model": model_name, "placement": placement, "ranks": f"{mesh[0]}x{mesh[1]}" if mesh else str(world),
                     "measured_between": got["between_steps"], "predicted_between": want.between_steps,
                     "measured_peak": got["peak"], "predicted_peak": want.peak, "phase": want.phase})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table, errors in percent of the measurement."""
    head = "| model | placement | ranks | between MB measured | predicted | error | peak MB measured | predicted | error | peak in |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        err = lambda a, b: f"{100 * (r[b] / r[a] - 1):+.1f}%"  # noqa: E731
        mb = lambda k: f"{r[k] / 2**20:.2f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['placement']} | {r['ranks']} | {mb('measured_between')} | {mb('predicted_between')} | "
                     f"{err('measured_between', 'predicted_between')} | {mb('measured_peak')} | {mb('predicted_peak')} | "
                     f"{err('measured_peak', 'predicted_peak')} | {r['phase']} |")
    return "\n".join(lines)


def _rank(rank: int, world: int, cases: list[tuple[str, str]], mesh: tuple[int, int] | None, out: str) -> None:
    rows = compare(rank, world, cases, mesh)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from graphddp.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mesh", default=None, help="hybrid sharding's (replicate)x(shard), e.g. 2x2: the sharded placements")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    args = parser.parse_args(argv)
    mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
    placements = [p for p in args.placements.split(",") if mesh is None or PLACEMENTS[p].get("sharding")]
    cases = [(m, p) for m in args.models.split(",") for p in placements]
    world = mesh[0] * mesh[1] if mesh else args.world
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spawn(_rank, world, cases, mesh, out, timeout=1800)
        with open(out) as f:
            print(render(json.load(f)))


if __name__ == "__main__":
    main(sys.argv[1:])
