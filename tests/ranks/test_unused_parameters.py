"""A parameter whose gradient no rank produced this step keeps ``grad`` None and is not updated,
in every mode, exactly as DDP + the same ``torch.optim`` leave it (:mod:`graphddp.runtime.usage`).

Adam makes the difference visible: stepped from a zero gradient, a parameter still moves (its
momentum) and its step count advances. Scenarios, each against ``DDP(find_unused_parameters=True)``
and the same Adam, parameters and each parameter's Adam step count after every step:

* ``out``: the model returns two outputs and from the second step on the loss uses only the
  first (FSDP2's ``test_unused_forward_output``);
* ``zero``: the loss multiplies the second output by zero: a zero gradient is still a
  gradient, and is stepped;
* ``rank``: only rank 0's loss uses the second output: every rank gets the average of rank 0's
  gradient and the others' zeros;
* ``flag``: a residual layer skipped on odd steps by a flag (the same on every rank: Dynamo
  recompiles the forward without it, then runs both graphs in turn);

and a head the forward never calls, in every scenario. Plus Hugging Face BERT's pre-training
model with the loss on its masked-LM logits only (its pooler and next-sentence head unused).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.testing import spawn

MODES = {
    "replicated": {},
    "inside": {"inside": True},
    "optimizer": {"inside": True, "sharding": "optimizer"},
    "full": {"inside": True, "sharding": "full"},
    "full_clip": {"inside": True, "sharding": "full", "max_grad_norm": 0.5},
    "inside_clip": {"inside": True, "max_grad_norm": 0.5},
    "full_inductor": {"inside": True, "sharding": "full", "backend": "inductor"},  # the "out" scenario only
    # hybrid sharding, 4 ranks as 2 x 2 (graphddp.values.placement): which parameters no rank used
    # is agreed over every rank, not only within a shard group
    "optimizer_hybrid": {"inside": True, "sharding": "optimizer", "mesh": (2, 2)},
    "full_hybrid": {"inside": True, "sharding": "full", "mesh": (2, 2)},
}
SCENARIOS = ("out", "zero", "rank", "flag")
STEPS = 4


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.skip, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head, self.never = nn.Linear(8, 4), nn.Linear(8, 3)
        self.use_skip = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        if self.use_skip:
            h = h + self.skip(h)
        return self.head(h), self.b(h)


def _loss(outputs: tuple[torch.Tensor, torch.Tensor], scenario: str, rank: int, step: int) -> torch.Tensor:
    first, second = outputs
    if scenario == "zero":
        return first.square().mean() + 0.0 * second.sum()
    if scenario == "out" and step >= 1 or scenario == "rank" and rank != 0:
        return first.square().mean()
    return first.square().mean() + second.square().mean()


def _compile(model: nn.Module, opt: torch.optim.Optimizer, mode: str) -> nn.Module:
    kwargs = {"backend": "aot_eager", **MODES[mode]}
    if kwargs.pop("inside", False):
        kwargs["optimizer"] = opt
    if "mesh" in kwargs:
        kwargs["device_mesh"] = init_device_mesh("cpu", kwargs.pop("mesh"), mesh_dim_names=("replicate", "shard"))
    return graphddp.compile(model, **kwargs)


def _same_as_ddp(rank: int, step: int, ref: DDP, ours: nn.Module, ref_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer,
                 what: str) -> None:
    whole = dict(ours.named_parameters())
    steps = {id(p): int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0 for g in opt.param_groups for p in g["params"]}
    mine = {n: steps.get(id(p), 0) for n, p in ours.module.named_parameters()} if hasattr(ours, "module") else {}
    for n, q in ref.module.named_parameters():
        torch.testing.assert_close(whole[n].detach(), q.detach(), **ADAM_NOISE, msg=lambda m: f"{what} step {step} {n}: {m}")
        expected = int(ref_opt.state[q]["step"]) if q in ref_opt.state else 0
        if n in mine and mine[n] != expected:
            raise AssertionError(f"{what} step {step} {n}: Adam step count {mine[n]}, DDP's {expected}")


def _train(rank: int, world: int, mode: str) -> None:
    # hybrid: an output left out, and one used on rank 0 only (what the mesh's groups could get wrong)
    scenarios = ("out",) if MODES[mode].get("backend") == "inductor" else ("out", "rank") if "mesh" in MODES[mode] else SCENARIOS
    for scenario in scenarios:
        torch.manual_seed(0)
        base = TwoHeads()
        ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
        mine = copy.deepcopy(base)
        ref_opt, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(mine.parameters(), lr=1e-2)
        ours = _compile(mine, opt, mode)
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            for model, module in ((ref, ref.module), (ours, mine)):
                module.use_skip = not (scenario == "flag" and step % 2 == 1)
                _loss(model(x), scenario, rank, step).backward()
            if "max_grad_norm" in MODES[mode]:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), MODES[mode]["max_grad_norm"])
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad(set_to_none=True)
            _same_as_ddp(rank, step, ref, ours, ref_opt, opt, f"{mode}/{scenario}")
        assert all(p.grad is None for p in ours.parameters())
        if mode in ("full", "full_inductor") and scenario == "out":  # the steps that left b unused step it after the backward
            assert ours.updates == {"inside": 1, "unused": STEPS - 1}, ours.updates


@pytest.mark.parametrize("mode", list(MODES))
def test_a_parameter_no_rank_used_is_not_updated(mode: str) -> None:
    spawn(_train, 4 if "mesh" in MODES[mode] else 2, mode)


def _bert(rank: int, world: int, mode: str) -> None:
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    base = BertForPreTraining(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    mine = copy.deepcopy(base)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    ours = _compile(mine, opt, mode)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))
        for model in (ref, ours):
            logits = model(input_ids=ids).prediction_logits  # the masked-LM head only
            F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        _same_as_ddp(rank, step, ref, ours, ref_opt, opt, f"bert {mode}")
    assert not ref_opt.state.get(ref.module.cls.seq_relationship.weight), "the next-sentence head is unused"


@pytest.mark.parametrize("mode", ["inside", "optimizer", "full"])
def test_hf_bert_pretraining_with_the_masked_lm_loss_only(mode: str) -> None:
    spawn(_bert, 2, mode)
