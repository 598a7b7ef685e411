"""Trust: what real model code does to a DDP replacement, on spawned gloo ranks.

Each case either equals DDP or raises a clear error on every rank, never a silently wrong
gradient and never a hang: no_sync across graph breaks, per-rank data-dependent branches,
a recompile on one rank only, a production order that differs between ranks, a peer that
dies or stalls mid-backward, and a process-wide inductor setting another library turned on.
"""
from __future__ import annotations

import copy
import os
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import assert_matches_ddp, spawn

CAPS = dict(bucket_cap_mb=0.004)


def _assert_grads_equal(ours: nn.Module, ref: nn.Module, what: str) -> None:
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), f"{what} {name}: grad None mismatch"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what} {name}: {m}")


class ThreeLayerNamespace(nn.Module):
    """Three layers, a graph break, and a ``SimpleNamespace(loss=...)`` result, like HF models."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> types.SimpleNamespace:
        h = torch.relu(self.l1(x))
        torch._dynamo.graph_break()
        h = torch.relu(self.l2(h))
        return types.SimpleNamespace(loss=F.mse_loss(self.l3(h), y))


def _no_sync_across_graph_breaks(rank: int, world: int, make: str, backend: str) -> None:
    torch.manual_seed(0)
    model = ThreeLayerNamespace() if make == "namespace" else models.GraphBreakMLP()
    ref = DDP(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend=backend, **CAPS)

    def loss(m: nn.Module, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        return m(x, y).loss if make == "namespace" else F.mse_loss(m(x), y)

    for step in range(2):
        for m in (ref, ours):
            with m.no_sync():
                loss(m, 10 * step).backward()
        _assert_grads_equal(ours.module, ref.module, f"step {step}, local micro-batch")
        for m in (ref, ours):
            loss(m, 10 * step + 1).backward()
        _assert_grads_equal(ours.module, ref.module, f"step {step}, synchronising micro-batch")
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
    assert len(ours.schedules) == 2, "one plan per graph of the synchronising steps"
    assert ours._state.backend.graphs_compiled == 2  # two Dynamo graphs, no variant recompiles


@pytest.mark.parametrize("make,backend", [("namespace", "aot_eager"), ("graph_break_mlp", "aot_eager")])
def test_no_sync_with_graph_breaks_matches_ddp(make, backend):
    spawn(_no_sync_across_graph_breaks, 2, make, backend)


class Branchy(nn.Module):
    """A data-dependent branch (a graph break) whose two sides use the same parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if x[0, 0] > 0:
            h = torch.relu(self.b(h)) * 2
        else:
            h = torch.tanh(self.b(h))
        return self.c(h)


def _branch_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    x = torch.randn(8, 16, generator=g)
    x[0, 0] = 1.0 if (rank + step) % 2 == 0 else -1.0  # ranks take opposite sides, then swap
    return (x,), torch.randn(8, 4, generator=g)


def _per_rank_branches(rank: int, world: int) -> None:
    # Step 1 makes each rank compile the side the other compiled at step 0, while the other
    # runs its cached graph: compiling must not talk, and equal layouts must reduce like DDP.
    ours = assert_matches_ddp(Branchy, _branch_batch, F.mse_loss, steps=3, backend="aot_eager", **CAPS)
    assert len(ours.schedules) == 3  # the first graph (a), then one per side


def test_per_rank_data_dependent_branches_match_ddp():
    spawn(_per_rank_branches, 2)


def _token_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    length = 24 if (rank == 1 and step == 1) else 16  # one rank, one step, a longer sequence
    idx = torch.randint(0, 128, (4, length), generator=g)
    return (idx,), torch.randint(0, 128, (4, length), generator=g)


def _xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _one_rank_recompiles(rank: int, world: int) -> None:
    ours = assert_matches_ddp(
        lambda: models.TinyGPT(seq=32), _token_batch, _xent, steps=3, backend="aot_eager", **CAPS
    )
    assert len(ours.schedules) == (2 if rank == 1 else 1)  # only rank 1 compiled a second graph


def test_a_recompile_on_one_rank_matches_ddp():
    spawn(_one_rank_recompiles, 2)


class Reordered(nn.Module):
    """Two square layers whose order depends on a per-rank flag: same parameters, produced in
    a different order, so the buckets differ between ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flip = dist.get_rank() == 1
        return self.q(torch.relu(self.p(x))) if not flip else self.p(torch.relu(self.q(x)))


def _production_order_differs(rank: int, world: int) -> None:
    # Different buckets on each rank: the step is divergent (graphddp.runtime.union), averaged at its
    # end over the union of the gradients, with no half-reduced bucket and no error: DDP's result.
    ours = assert_matches_ddp(Reordered, _mlp16_batch, F.mse_loss, steps=2, backend="aot_eager", bucket_cap_mb=0.0005)
    assert ours._state.backend.union.steps == 2


def _mlp16_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    return (torch.randn(4, 16, generator=g),), torch.randn(4, 16, generator=g)


def test_a_production_order_that_differs_between_ranks_is_averaged_like_ddp():
    spawn(_production_order_differs, 2, timeout=120)


def _peer_dies_mid_backward(rank: int, world: int) -> None:
    from graphddp.runtime import dispatch as variants

    ours = graphddp.compile(models.MLP(), backend="aot_eager", **CAPS)
    if rank == 1:  # pass the agreement, then die instead of running the bucket all-reduces
        def die(self, args):
            self.step.agree(self.group, self.variants[self.phase()].digest, "test", False)
            sys.stdout.flush()
            os._exit(0)

        variants.BackwardDispatch.__call__ = die
    x = torch.randn(8, 16)
    with pytest.raises(graphddp.CollectiveError) as info:
        ours(x).sum().backward()
    message = str(info.value)
    assert "graphddp" in message and "backward graph 0" in message, message
    assert "all-reduce of bucket 0" in message, message
    assert info.value.__cause__ is not None, "the original error is chained"
    sys.stdout.flush()
    os._exit(0)  # the peer is gone: no teardown barrier


def test_a_peer_dying_mid_backward_names_graph_and_bucket():
    spawn(_peer_dies_mid_backward, 2, timeout=120, pg_timeout=20)


def _peer_stalls(rank: int, world: int, timed_out: str) -> None:
    ours = graphddp.compile(models.MLP(), backend="aot_eager", **CAPS)
    x = torch.randn(8, 16)
    if rank == 1:
        # Stall, alive (a peer that exits is the dying case), until rank 0 has timed out (3 s
        # collective timeout) and said so, not a fixed sleep that must outlast rank 0's compile.
        deadline = time.monotonic() + 60
        while not os.path.exists(timed_out) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    with pytest.raises(graphddp.CollectiveError) as info:
        ours(x).sum().backward()
    open(timed_out, "w").close()
    message = str(info.value)
    assert "graphddp" in message and "agreement" in message and "backward graph 0" in message, message
    assert "Timed out" in message, f"the peer was alive: a timeout, not a closed connection: {message}"
    sys.stdout.flush()
    os._exit(0)


def test_a_stalled_peer_times_out_with_a_graphddp_error(tmp_path):
    spawn(_peer_stalls, 2, str(tmp_path / "timed_out"), timeout=120, pg_timeout=3)


def _python_reducer_elsewhere(rank: int, world: int) -> None:
    from torch._inductor import config as inductor_config

    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        DDP(models.MLP())  # turns inductor's _fuse_ddp_communication on for the whole process
    assert inductor_config._fuse_ddp_communication
    assert_matches_ddp(models.MLP, _mlp_batch, F.mse_loss, steps=2, backend="inductor", **CAPS)
    assert inductor_config._fuse_ddp_communication, "graphddp must not change the user's config"


def _mlp_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    return (torch.randn(8, 16, generator=g),), torch.randn(8, 4, generator=g)


@pytest.mark.slow
def test_process_wide_ddp_fusion_setting_does_not_reach_graphddp():
    spawn(_python_reducer_elsewhere, 2, fresh=True)  # it changes inductor's config process-wide


class SometimesExtra(nn.Module):
    """A layer used only when asked: under no_sync one rank uses it, the other does not."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.body(x)
        return self.extra(h) if use_extra else h


def _no_sync_uneven_use(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SometimesExtra()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", **CAPS)
    g = torch.Generator().manual_seed(rank)
    x1, x2 = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    for m in (ref, ours):
        with m.no_sync():
            m(x1, rank == 0).square().mean().backward()  # only rank 0 touches `extra`
        m(x2, False).square().mean().backward()  # nobody does
    _assert_grads_equal(ours.module, ref.module, "after the synchronising step")


def test_no_sync_with_a_parameter_only_one_rank_used_matches_ddp():
    spawn(_no_sync_uneven_use, 2)
