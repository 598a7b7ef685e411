"""Small models used by the demo, the tests and the benchmark (each a normal nn.Module)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Sequential):
    def __init__(self, width: int = 64, depth: int = 4, d_in: int = 16, d_out: int = 4) -> None:
        layers: list[nn.Module] = [nn.Linear(d_in, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, d_out))
        super().__init__(*layers)


class CNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embedding, causal attention blocks, layernorm, and an output head tied to the embedding."""

    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim).normal_(std=0.02))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BreakGPT(TinyGPT):
    """TinyGPT with a graph break between its first and second half of blocks: the tied
    embedding is used in the first graph (lookup) and in the second (output head), so its
    gradient comes from two backward graphs."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        half = len(self.blocks) // 2
        for block in self.blocks[:half]:
            x = block(x)
        torch._dynamo.graph_break()
        for block in self.blocks[half:]:
            x = block(x)
        return self.head(self.ln(x))


class FrozenMLP(MLP):
    """An MLP whose first layer is frozen (no gradient, never reduced)."""

    def __init__(self) -> None:
        super().__init__()
        for p in self[0].parameters():
            p.requires_grad_(False)


class GraphBreakMLP(nn.Module):
    """Forward with a Dynamo graph break in the middle: two graphs, two backward schedules."""

    def __init__(self) -> None:
        super().__init__()
        self.a = MLP(d_out=32)
        self.b = MLP(d_in=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(h))


# -- a tiny Hugging Face GPT-2 from config (no download; transformers is the tests' dependency) ------


def tiny_hf_gpt2(seed: int = 0) -> nn.Module:
    """``GPT2LMHeadModel`` with 2 layers of width 32, vocabulary 128, dropout off, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    ))


def tiny_hf_gpt2_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank- and step-dependent tokens for :func:`tiny_hf_gpt2`, as ``input_ids`` and ``labels``."""
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 * rank + step))
    return {"input_ids": idx, "labels": idx}
