"""A user's script on 2 gloo ranks (run as ``python tests/ranks/exit_without_unwaited.py [MODE ...]``
by test_unwaited_collectives.py): a few steps of each mode, a ``no_sync`` micro-batch and a
recompile among them, the last step's collectives left as a training loop leaves them, then
``destroy_process_group`` and a normal exit. c10d prints "unwaited collective calls" at exit
for any functional collective graphddp issued and never passed to ``wait_tensor``.

Ranks are started by ``torch.multiprocessing`` with the spawn method, whose processes exit
through the interpreter's normal shutdown (where that count is printed), unlike the test
suite's rank pool.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import graphddp
from graphddp.models import MLP, BreakGPT

# name -> (model, graphddp.compile's options; "optimizer" True: AdamW inside). "gpt": a GPT
# with a graph break between its blocks and its embedding tied to the head on both sides of it
# (graphddp.models.BreakGPT): two forward and two backward graphs, several buckets, gathers
# pending across the break; what Hugging Face GPT-2 gave these modes at four times its compile.
MODES = {
    "replicated": ("mlp", {}),
    "optimizer_inside": ("mlp", {"optimizer": True}),
    "sharded": ("mlp", {"optimizer": True, "sharding": "optimizer"}),
    "sharded_gather_forward": ("gpt", {"optimizer": True, "sharding": "optimizer", "gather": "forward", "bucket_cap_mb": 0.01}),
    "full": ("gpt", {"optimizer": True, "sharding": "full"}),
    "full_kept": ("mlp", {"optimizer": True, "sharding": "full", "reshard_after_forward": False}),
}
VOCAB = 64


def _loss(model: nn.Module, kind: str, rank: int, step: int, rows: int = 8) -> torch.Tensor:
    if kind == "gpt":
        x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * rank + step))
        return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    g = torch.Generator().manual_seed(100 * rank + step)
    return (model(torch.randn(rows, 16, generator=g)) - torch.randn(rows, 4, generator=g)).square().mean()


def _train(rank: int, name: str) -> None:
    kind, options = MODES[name]
    options = dict(options)
    torch.manual_seed(0)
    model = BreakGPT(vocab=VOCAB, dim=32, heads=2, layers=2, seq=8) if kind == "gpt" else MLP(width=32, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if options.pop("optimizer", False):
        options["optimizer"] = opt
    ours = graphddp.compile(model, backend="aot_eager", **options)
    for step in range(3):
        if step == 1 and "sharding" not in options:
            with ours.no_sync():
                _loss(ours, kind, rank, 50).backward()
        rows = 8 if step < 2 or kind == "gpt" else 6  # the last step recompiles the MLP's graphs
        _loss(ours, kind, rank, step, rows).backward()
        if "optimizer" not in options:
            opt.step()
        opt.zero_grad()
    print(f"rank {rank}: {name} done", flush=True)


def _rank(rank: int, store: str, modes: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for name in modes:
        _train(rank, name)
    dist.destroy_process_group()


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(MODES)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), chosen), nprocs=2)
