"""Parity with torch's DistributedDataParallel on process groups other than one default group.

Spawned gloo CPU ranks train graphddp (``backend="aot_eager"``) next to
``torch.nn.parallel.DistributedDataParallel`` (``parity_harness.py``): sub process groups of 3
ranks (each wrapper broadcasts from its group's first member, the non-member waits), two models
on two groups in one process with one backward through both, and world size 1, which equals
local training with no collective in the graph.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from parity_harness import CAPS, DDP_CAPS, FP32_TOL, _assert_same_on_every_rank, _image_batch, _mse, _token_batch, _train_side_by_side, _vector_batch, _xent
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn
from graphddp.values.comm import is_collective


# -- 6. process groups -------------------------------------------------------------------------------


def _mlp_seeded_by_rank() -> nn.Module:
    torch.manual_seed(dist.get_rank())
    return models.MLP()


def _subgroups(rank: int, world: int) -> None:
    assert world == 3
    # Every rank creates every group, in the same order, member or not.
    sub01 = dist.new_group([0, 1])
    sub12 = dist.new_group([1, 2])
    for members, group in (((0, 1), sub01), ((1, 2), sub12)):
        if rank in members:
            # Ranks start from different weights: both wrappers must broadcast from the
            # group's first member (global rank members[0]), not from global rank 0.
            ours, _, _ = _train_side_by_side(_mlp_seeded_by_rank, _vector_batch, _mse, process_group=group)
            for s in ours.schedules:
                assert s.group_name == group.group_name and s.world_size == 2
            _assert_same_on_every_rank(list(ours.parameters()), group, "params")
            torch._dynamo.reset()
        dist.barrier()  # the non-member waits here while the members train


def test_subgroup_three_ranks_matches_ddp():
    spawn(_subgroups, 3)


def _two_groups_one_process(rank: int, world: int) -> None:
    second = dist.new_group([0, 1])
    torch.manual_seed(7)
    base_a, base_b = models.MLP(), models.CNN()
    ref_a = DDP(copy.deepcopy(base_a), **DDP_CAPS)
    ref_b = DDP(copy.deepcopy(base_b), process_group=second, **DDP_CAPS)
    ours_a = graphddp.compile(copy.deepcopy(base_a), backend="aot_eager", **CAPS)
    ours_b = graphddp.compile(copy.deepcopy(base_b), process_group=second, backend="aot_eager", **CAPS)
    pairs = [
        (ref_a, ours_a, _vector_batch, _mse),
        (ref_b, ours_b, _image_batch, _xent),
    ]
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for pair in pairs for m in pair[:2]}
    for step in range(3):
        # Both models' forwards, then one backward through all four losses: the two graphddp
        # backward graphs (collectives on WORLD and on the second group) run in one autograd pass.
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        losses = []
        for ref, ours, batch, loss_fn in pairs:
            inputs, target = batch(rank, step)
            losses += [loss_fn(ref(*inputs), target), loss_fn(ours(*inputs), target)]
        torch.stack(losses).sum().backward()
        for (ref, ours, _, _), group in zip(pairs, (None, second)):
            named_ref = dict(ref.module.named_parameters())
            for name, p in ours.module.named_parameters():
                torch.testing.assert_close(p.grad, named_ref[name].grad, **FP32_TOL, msg=lambda m: f"step {step} {name}: {m}")
            _assert_same_on_every_rank([p.grad for p in ours.parameters()], group, f"step {step} grads")
        for opt in opts.values():
            opt.step()
    for ref, ours, _, _ in pairs:
        named_ref = dict(ref.module.named_parameters())
        for name, p in ours.module.named_parameters():
            torch.testing.assert_close(p, named_ref[name], **FP32_TOL)
    names_a = {s.group_name for s in ours_a.schedules}
    names_b = {s.group_name for s in ours_b.schedules}
    assert names_a == {dist.group.WORLD.group_name}
    assert names_b == {second.group_name}
    assert names_a.isdisjoint(names_b)


def test_two_models_on_two_groups_in_one_process():
    spawn(_two_groups_one_process, 2)


# -- world size 1 ----------------------------------------------------------------------------------------


def _single_rank(rank: int, world: int) -> None:
    assert world == 1
    torch.manual_seed(0)
    base = models.TinyGPT()
    local = copy.deepcopy(base)
    ours = graphddp.compile(copy.deepcopy(base), backend="aot_eager", **CAPS)
    opt_local = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        batch = _token_batch(0, step)
        for m, opt in ((local, opt_local), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            _xent(m(*batch[0]), batch[1]).backward()
        named = dict(local.named_parameters())
        for name, p in ours.module.named_parameters():
            torch.testing.assert_close(p.grad, named[name].grad, **FP32_TOL)
        opt_local.step()
        opt_ours.step()
    named = dict(local.named_parameters())
    for name, p in ours.module.named_parameters():
        torch.testing.assert_close(p, named[name], **FP32_TOL)
    assert [s.world_size for s in ours.schedules] == [1]
    for record in ours.records:  # one rank: nothing to average, no collective in the graph
        assert not any(is_collective(n) for n in record.graph.graph.nodes)


def test_world_size_one_equals_local_training():
    spawn(_single_rank, 1)
