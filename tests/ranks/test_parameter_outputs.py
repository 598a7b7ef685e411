"""A forward that returns a parameter, or a view of one, whose loss term differs per rank: the
gradient through that output is averaged with the rest, as DDP averages it
(:mod:`graphddp.graph.alias_outputs`). Without the copy, AOTAutograd rebuilds such an output
outside the compiled function and its gradient reaches ``p.grad`` unaveraged (and, with the
optimizer inside, after the in-graph update: a second step). Every mode, against DDP + AdamW,
parameters after each step.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn


class Probes(nn.Module):
    """An MLP that also returns one element of its first weight (a view) and its last bias
    (the parameter itself)."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.mlp = models.MLP(width=32, depth=3)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        element = self.mlp[0].weight.view(-1)[0]
        return (self.mlp(x), element, self.mlp[-1].bias) if self.bias else (self.mlp(x), element)


MODES = {
    "replicated": {},
    "inside": {"inside": True},
    "optimizer": {"inside": True, "sharding": "optimizer"},
    "full": {"inside": True, "sharding": "full"},
}


def _train(rank: int, world: int, mode: str) -> None:
    torch.manual_seed(0)
    base = Probes()
    ref, mine = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    kwargs = {"backend": "aot_eager", **MODES[mode]}
    if kwargs.pop("inside", False):
        kwargs["optimizer"] = opt
    ours = graphddp.compile(mine, **kwargs)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for model in (ref, ours):
            out, element, bias = model(x)
            (F.mse_loss(out, y) + (rank + 1) * element + (rank - 0.5) * bias.sum()).backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        whole = dict(ours.named_parameters())
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(whole[n].detach(), q.detach(), **ADAM_NOISE, msg=lambda m: f"{mode} step {step} {n}: {m}")


def _view_only(rank: int, world: int, mode: str) -> None:
    """A view made in the graph is copied there: its gradient rides in the buckets, the step
    stays static (no divergent step, the update inside the graph). (A parameter returned as it
    is makes every step divergent, used in the loss or not: the forward cannot know.)"""
    torch.manual_seed(0)
    base = Probes(bias=False)
    ref, mine = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    ours = graphddp.compile(mine, optimizer=opt, backend="inductor" if mode == "inductor" else "aot_eager")
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for model in (ref, ours):
            out, element = model(x)
            (F.mse_loss(out, y) + (rank + 1) * element).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        whole = dict(ours.named_parameters())
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(whole[n].detach(), q.detach(), **ADAM_NOISE, msg=lambda m: f"view {mode} step {step} {n}: {m}")
    assert ours._state.backend.union.steps == 0, "a view made in the graph needs no divergent step"
    assert all(not r.fallbacks for r in ours.records), [r.fallbacks for r in ours.records]


@pytest.mark.parametrize("mode", ["aot_eager", "inductor"])
def test_a_view_of_a_parameter_made_in_the_graph_is_copied_there(mode: str) -> None:
    spawn(_view_only, 2, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_output_that_is_a_parameter_or_its_view_is_averaged(mode: str) -> None:
    spawn(_train, 2, mode)
