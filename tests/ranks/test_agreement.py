"""Ranks whose plans differ: buckets that differ are averaged over the union; different parameters fail at wrap time."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphddp
from graphddp.models import MLP
from graphddp.testing import spawn


class _Flippable(nn.Module):
    """Same parameters on every rank; rank 1 runs its layers in another order."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.flip = flip

    def forward(self, x):
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        return second(torch.relu(first(x)))


def _flipped(rank: int, world: int) -> None:
    # Same parameters, another production order on rank 1: different buckets, so the step is
    # averaged over the union at its end (graphddp.runtime.union), as DDP averages it.
    torch.manual_seed(0)
    model = _Flippable(flip=rank == 1)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    compiled = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    for m in (ref, compiled):
        m(x).sum().backward()
    refs = dict(ref.module.named_parameters())
    for name, p in compiled.module.named_parameters():
        torch.testing.assert_close(p.grad, refs[name].grad)
    assert compiled._state.backend.union.steps == 1


def test_ranks_whose_buckets_differ_are_averaged_over_the_union():
    spawn(_flipped, 2)


def _different_params(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="ranks hold different parameters"):
        graphddp.compile(MLP(width=32 if rank == 0 else 48), backend="aot_eager")


def test_ranks_with_different_parameters_fail_at_wrap_time():
    spawn(_different_params, 2)


def _maxima(rank: int, world: int) -> None:
    from graphddp.runtime.agree import layout_hash, max_reduce, probe

    # Per position the largest of every rank's values: 60-bit hashes and their negations, flags.
    h = layout_hash(("layout", rank))
    mine = [h, -h, int(rank == world - 1), -rank, 7]
    hashes = [layout_hash(("layout", r)) for r in range(world)]
    assert max_reduce(mine, None) == [max(hashes), -min(hashes), 1, 0, 7]
    # The probe reads equality from it: unequal layouts, then equal ones, on every rank alike.
    assert probe(("layout", rank), (False, rank == 0), None, "a test") == (False, (False, True))
    assert probe(("layout",), (False, False), None, "a test") == (True, (False, False))


@pytest.mark.parametrize("world", [2, 3])
def test_the_agreement_takes_each_positions_maximum_over_ranks(world):
    spawn(_maxima, world)
