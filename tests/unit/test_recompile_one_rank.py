"""The optimizer inside the backward keeps updating in the graph after a shape change recompiles
the frame, on one rank (a fake group of 1: the process alone, as the issue reported it). The
multi-rank recompile matrix is ``tests/ranks/test_recompile.py``."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphddp
from graphddp import models
from graphddp.testing import update_runs

VOCAB = 64
SHORT = (3, 12)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    ))


def _tiny_gpt() -> nn.Module:
    """The GPT written here (tied embedding and head), attention's input bias frozen: its key
    third gets a gradient that is rounding noise, which AdamW turns into steps of +-lr."""
    model = models.TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=2, seq=16)
    for block in model.blocks:
        block.attn.in_proj_bias.requires_grad_(False)
    return model


def _tokens(step: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1000 * step))


def _adamw(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("form", ["compile", "backend"])
def test_one_rank_keeps_updating_in_the_graph_after_a_shape_change(fake_world, form: str) -> None:
    """The issue's second case as reported: HF GPT-2, optimizer=AdamW, one rank; after (4, 16)
    batches a (3, 12) batch recompiles, and every parameter keeps stepping, in the graph; also
    through ``torch.compile(model, backend=graphddp.backend(model, optimizer=))``, on the GPT
    written here (the form's path, at a quarter of HF GPT-2's compile time)."""
    fake_world(1)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _gpt2() if form == "compile" else _tiny_gpt()
    ref = copy.deepcopy(model)
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    if form == "compile":
        ours = view = graphddp.compile(model, optimizer=opt, backend="aot_eager")
    else:
        view = graphddp.backend(model, optimizer=opt, backend="aot_eager")
        ours = torch.compile(model, backend=view)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if form == "compile":
            return m(input_ids=x, labels=x).loss
        return F.cross_entropy(m(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    for step, shape in enumerate([(4, 16), (4, 16), SHORT, SHORT]):
        x = _tokens(step, shape)
        loss(ours, x).backward()
        loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is None, f"step {step}: {name}.grad kept"
            if p.requires_grad:  # the GPT written here freezes its attention's input bias
                assert opt.state[p]["step"].item() == step + 1, f"step {step}: {name} stepped {opt.state[p]['step'].item()} times"
            torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step} {name}: {m}")
    graphs = [inside for inside, _ in update_runs(view) if inside]
    assert len(graphs) == 2 and all(not r.fallbacks for r in view.records), [r.fallbacks for r in view.records]
