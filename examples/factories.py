"""Factories for ``python -m graphddp explain examples/factories.py:NAME``.

Each returns ``(model, example_inputs)``.
"""
from __future__ import annotations

import torch

from graphddp.models import CNN, MLP, TinyGPT


def mlp():
    return MLP(width=256, depth=6), (torch.randn(32, 16),)


def cnn():
    return CNN(), (torch.randn(8, 3, 16, 16),)


def gpt():
    return TinyGPT(vocab=512, dim=128, heads=4, layers=4, seq=64), (torch.randint(0, 512, (4, 64)),)


def demo_gpt():
    """The model the demo trains."""
    return TinyGPT(vocab=256, dim=64, heads=4, layers=2, seq=32), (torch.randint(0, 256, (8, 32)),)
