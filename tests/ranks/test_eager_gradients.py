"""Gradients made outside every compiled graph, on spawned gloo ranks: averaged as DDP averages them when the forward's output depends on them, a clear error when only the loss does."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphddp
from graphddp.models import MLP
from graphddp.testing import assert_matches_ddp, spawn


class _EagerScale(nn.Module):
    """Uses a parameter inside a Dynamo-disabled function: its gradient is made eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _scale(self.body(x), self.scale)


@torch._dynamo.disable
def _scale(h, w):
    return h * w


def _eager_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    return (torch.randn(4, 16, generator=g),), torch.randn(4, 4, generator=g)


def _eager_gradient(rank: int, world: int) -> None:
    ours = assert_matches_ddp(_EagerScale, _eager_batch, torch.nn.functional.mse_loss, steps=3, backend="aot_eager")
    assert ours._state.backend.union.steps == 3  # every step: the eager gradient joins the union average


def test_a_gradient_made_by_eager_code_is_averaged_as_ddp_averages_it():
    spawn(_eager_gradient, 2)


class _WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.extra = nn.Parameter(torch.ones(3))  # not used by forward

    def forward(self, x):
        return self.body(x)


def _used_outside_the_forward(rank: int, world: int) -> None:
    model = graphddp.compile(_WithExtra(), backend="aot_eager")
    loss = model(torch.randn(4, 16)).sum() + model.module.extra.square().sum()  # 'extra' used outside the forward
    with pytest.raises(RuntimeError, match="'extra' received a gradient outside"):
        loss.backward()
    dist.barrier()


def test_a_parameter_used_outside_the_forward_is_an_error_not_a_wrong_answer():
    spawn(_used_outside_the_forward, 2)
