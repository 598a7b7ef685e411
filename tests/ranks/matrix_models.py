"""The rows of the DDP matrix (test_ddp_matrix.py): its models, their data and losses, one Spec
per model. Other rank tests train on the same models and data."""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphddp import models

CAP_MB = 0.02  # a few buckets per graph on these models


# -- models ------------------------------------------------------------------------------------------


class NamespaceNet(nn.Module):
    """Three linear layers, BatchNorm (buffers that change in forward), a graph break, and the
    loss computed inside forward and returned as ``SimpleNamespace(loss=..., logits=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.l2 = nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> types.SimpleNamespace:
        h = torch.relu(self.bn(self.l1(x)))
        torch._dynamo.graph_break()
        out = self.l3(torch.relu(self.l2(h)))
        return types.SimpleNamespace(loss=F.mse_loss(out, y), logits=out)


def _cnn() -> nn.Module:
    return models.CNN()


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    ))


def _hf_bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


# -- data: (rank, step, length) -> (args, kwargs, target); length None means the default ------------


def _gen(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + step)


def _tokens(rank: int, step: int, length: int | None):
    idx = torch.randint(0, 128, (4, (length or 16) + 1), generator=_gen(rank, step))
    return (idx[:, :-1],), {}, idx[:, 1:]


def _vectors(rank: int, step: int, length: int | None):
    g = _gen(rank, step)
    x, y = torch.randn(length or 8, 16, generator=g), torch.randn(length or 8, 4, generator=g)
    return (x, y), {}, None


def _vector_pairs(rank: int, step: int, length: int | None):
    g = _gen(rank, step)
    return (torch.randn(length or 8, 16, generator=g),), {}, torch.randn(length or 8, 4, generator=g)


def _images(rank: int, step: int, length: int | None):
    g = _gen(rank, step)
    return (torch.randn(length or 4, 3, 16, 16, generator=g),), {}, torch.randint(0, 10, (length or 4,), generator=g)


def _gpt2_batch(rank: int, step: int, length: int | None):
    idx = torch.randint(0, 128, (4, length or 16), generator=_gen(rank, step))
    return (), {"input_ids": idx, "labels": idx}, None


def _bert_batch(rank: int, step: int, length: int | None):
    g = _gen(rank, step)
    n = length or 16
    idx = torch.randint(4, 128, (4, n), generator=g)
    mask = torch.ones(4, n, dtype=torch.long)
    mask[0, n - 1 - rank:] = 0  # padding, rank-dependent
    labels = torch.where(torch.rand(4, n, generator=g) < 0.3, idx, torch.full_like(idx, -100))
    labels[:, 0] = idx[:, 0]  # at least one predicted token per row
    masked = torch.where(labels != -100, torch.full_like(idx, 3), idx)  # 3 = [MASK] here
    return (), {"input_ids": masked, "attention_mask": mask, "labels": labels}, None


def _loss_field(out: Any, _target: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


def _token_xent(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@dataclasses.dataclass
class Spec:
    make: Callable[[], nn.Module]
    batch: Callable[[int, int, int | None], tuple[tuple, dict, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    freeze: str  # parameter-name prefix frozen by toggle_requires_grad
    lengths: tuple[tuple[int, ...], tuple[int, ...]]  # per rank, per step, for dynamic_shapes
    min_graphs: int  # Dynamo graphs (so backward schedules) per step: > 1 where the forward graph-breaks
    mutable_buffers: bool = False  # buffers that forward changes (BatchNorm running stats)


SPECS: dict[str, Spec] = {
    "mlp": Spec(models.MLP, _vector_pairs, _mse, "2.", ((8, 6, 4), (8, 5, 4)), min_graphs=1),
    "frozen_mlp": Spec(models.FrozenMLP, _vector_pairs, _mse, "2.", ((8, 6, 4), (8, 5, 4)), min_graphs=1),
    "break_mlp": Spec(models.GraphBreakMLP, _vector_pairs, _mse, "", ((8, 6, 4), (8, 5, 4)), min_graphs=2),
    "cnn_bn": Spec(_cnn, _images, _token_xent, "conv1.", ((4, 3, 2), (4, 2, 2)), min_graphs=1, mutable_buffers=True),
    "break_gpt": Spec(lambda: models.BreakGPT(layers=2, seq=16), _tokens, _token_xent, "blocks.0.",
                      ((16, 12, 8), (16, 10, 8)), min_graphs=2),
    "namespace_bn": Spec(NamespaceNet, _vectors, _loss_field, "l2.", ((8, 6, 4), (8, 5, 4)), min_graphs=2,
                         mutable_buffers=True),
    "hf_gpt2": Spec(_hf_gpt2, _gpt2_batch, _loss_field, "transformer.h.0.", ((16, 12, 8), (16, 10, 8)), min_graphs=2),
    "hf_bert": Spec(_hf_bert, _bert_batch, _loss_field, "bert.encoder.layer.0.", ((16, 12, 8), (16, 10, 8)),
                    min_graphs=1),
}
