"""``sharding="full"`` updating each part inside the backward, in the loop nanoGPT's train.py
writes: gradient accumulation by ``require_backward_grad_sync`` set before each forward (or a
forward under ``no_sync()`` whose backward runs outside it: DDP reads the flag at the forward),
AdamW with a decayed and an undecayed param group, the learning rate set by hand every
iteration, a tied embedding. Against DDP + the same AdamW, whole parameters after every
iteration; and where the update ran (graphddp.compiler.full_updates): each accumulating
micro-step leaves it, each synchronising one carries what they accumulated and updates inside.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE  # AdamW turns rounding noise in a near-zero gradient into +-lr steps
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn


VOCAB, MICRO, ITERS = 64, 2, 3


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay on matrices only, fused off on CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))


def _loss(model: nn.Module, rank: int, it: int, micro: int) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(100 * it + 10 * micro + rank))
    logits = model(x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)) / MICRO


def _micro_step(model: nn.Module, pattern: str, rank: int, it: int, micro: int) -> None:
    last = micro == MICRO - 1
    if pattern == "flag":  # nanoGPT's train.py
        model.require_backward_grad_sync = last
        _loss(model, rank, it, micro).backward()
    else:  # the forward under no_sync decides, the backward runs after the block
        with contextlib.nullcontext() if last else model.no_sync():
            loss = _loss(model, rank, it, micro)
        loss.backward()


def _train(rank: int, world: int, pattern: str, backend: str) -> None:
    torch.manual_seed(0)
    base = models.TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=2, seq=16)
    for block in base.blocks:  # its key third's gradient is rounding noise, which AdamW makes +-lr steps of
        block.attn.in_proj_bias.requires_grad_(False)
    ref, mine = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    ref_opt, opt = _adamw(ref.module), _adamw(mine)
    ours = graphddp.compile(mine, optimizer=opt, sharding="full", backend=backend)
    for it in range(ITERS):
        lr = 1e-2 * (it + 1) / ITERS  # a warmup, set by hand as nanoGPT does
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["lr"] = lr
        for micro in range(MICRO):
            for m in (ref, ours):
                _micro_step(m, pattern, rank, it, micro)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        whole = dict(ours.named_parameters())
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(whole[n], q.detach(), **ADAM_NOISE, msg=lambda m: f"{pattern} iter {it} {n}: {m}")
        assert all(p.grad is None for p in mine.parameters())
    assert ours.updates == {"no_sync": ITERS * (MICRO - 1), "inside, carried": ITERS}, ours.updates
    assert float(opt.state[next(iter(mine.parameters()))]["step"]) == ITERS


@pytest.mark.parametrize("pattern", ["flag", "forward_under_no_sync"])
def test_accumulating_loops_update_inside_the_synchronising_backward(pattern: str) -> None:
    spawn(_train, 2, pattern, "aot_eager")


# Under inductor the updating and carrying variants run in test_full_sharding.py's
# mlp_adamw_inductor case (its step 2 accumulates a no_sync micro-step, then carries it).
