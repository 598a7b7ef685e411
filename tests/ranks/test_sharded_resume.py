"""nanoGPT's resume with a sharded optimizer: a plain optimizer's ``state_dict()`` loaded into a
fresh optimizer *before* ``graphddp.compile`` (train.py loads the checkpoint, then compiles and
wraps), against DDP + the same AdamW resumed from the same checkpoint; and a state saved from one
rank of a sharded run (its own ``opt.state_dict()``: that rank's parts) refused by name, before
the wrap and through ``load_full_optimizer_state_dict``, where it had been cut again as if whole
(other ranks got zeros, or another rank's values) or failed on a shape deep in the step."""
from __future__ import annotations

import copy

import pytest
import torch
from test_optim_ranks import ADAM_NOISE, TIGHT, _hf_gpt2, _hf_loss
from test_sharded import _mlp_loss
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn

PART = "holds one rank's part"
# model, loss, tolerance, the parameter a refused state is named by (the first the optimizer holds)
MODELS = {
    "mlp": (models.MLP, _mlp_loss, TIGHT, "0.weight"),
    # Hugging Face GPT-2 from config: a tied embedding; AdamW on rounding-noise gradients (test_optim_ranks)
    "hf_gpt2": (_hf_gpt2, _hf_loss, ADAM_NOISE, "transformer.wte.weight"),
}


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _resume(rank: int, world: int, sharding: str, model: str) -> None:
    make, loss, tol, first = MODELS[model]
    torch.manual_seed(0)
    base = make()
    ref = DDP(copy.deepcopy(base))
    ref_opt = _adamw(ref)
    for step in range(2):  # a plain run to the checkpoint
        loss(ref, rank, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    saved_model, saved_opt = copy.deepcopy(ref.module.state_dict()), copy.deepcopy(ref_opt.state_dict())
    mine = copy.deepcopy(base)
    mine.load_state_dict(saved_model)
    opt = _adamw(mine)
    opt.load_state_dict(saved_opt)  # before the wrap, as train.py
    ours = graphddp.compile(mine, optimizer=opt, sharding=sharding, backend="aot_eager")
    for step in range(2, 4):
        for m, o in ((ours, opt), (ref, ref_opt)):
            loss(m, rank, step).backward()
            o.step()
            o.zero_grad()
        for (n, p), q in zip(ours.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **tol, msg=lambda m: f"{sharding}, resumed, step {step}, {n}: {m}")
    parts = copy.deepcopy(opt.state_dict())  # this rank's parts
    with pytest.raises(ValueError, match=PART):
        graphddp.load_full_optimizer_state_dict(ours, parts)
    fresh = copy.deepcopy(base)
    fresh_opt = _adamw(fresh)
    fresh_opt.load_state_dict(parts)
    with pytest.raises(ValueError, match=f"optimizer state 'exp_avg' of '{first}' has \\d+ elements, the parameter \\d+: .*{PART}"):
        graphddp.compile(fresh, optimizer=fresh_opt, sharding=sharding, backend="aot_eager")


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("sharding", ["optimizer", "full"])
def test_a_plain_state_loaded_before_the_wrap_resumes_like_ddp(sharding: str, model: str) -> None:
    spawn(_resume, 2, sharding, model)
