"""DDP features in the compiled path, each checked against DDP on spawned gloo ranks:
no_sync accumulation, frozen/toggled parameters, buffer sync options, compression hooks,
gradients as views of the bucket buffers."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn

CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.002)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _assert_grads_equal(ours: nn.Module, ref: nn.Module, **tol) -> None:
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}", **tol)


def _no_sync(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model))
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", **CAPS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        for m in (ref, ours):
            for micro in range(2):  # two local micro-batches, no communication
                with m.no_sync():
                    x, y = _batch(rank, 10 * step + micro)
                    F.mse_loss(m(x), y).backward()
            x, y = _batch(rank, 10 * step + 9)
            F.mse_loss(m(x), y).backward()  # synchronised: average of everything accumulated
        _assert_grads_equal(ours.module, ref.module, atol=1e-6, rtol=1e-5)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert ours._backend.graphs_compiled == 1  # one Dynamo graph; no recompile per variant
    assert [s.plain_compiles for s in ours._backend.states] == [1]  # its local backward, once
    assert len(ours.schedules) == 1


def test_no_sync_accumulation_matches_ddp():
    spawn(_no_sync, 2)


def _frozen_toggle(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = graphddp.compile(models.MLP(), backend="aot_eager", **CAPS)
    local = copy.deepcopy(model.module)  # reference: local grads, averaged by hand
    first = model.module[0]
    for step, frozen in enumerate([False, True, False]):
        for p in list(first.parameters()) + list(local[0].parameters()):
            p.requires_grad_(not frozen)
        for m in (model, local):
            m.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            F.mse_loss(m(x), y).backward()
        for p in local.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        _assert_grads_equal(model.module, local, atol=1e-6, rtol=1e-5)
        assert (first.weight.grad is None) == frozen
        if step < 2:  # each new requires_grad pattern compiles and plans a new graph
            assert len(model.schedules) == step + 1
            names = set(model.schedules[-1].param_names)
            assert ("0.weight" in names) == (not frozen)  # frozen params left out
    assert len(model.schedules) == 2  # frozen and unfrozen plans; the third step reuses the first


def test_toggling_requires_grad_replans_and_stays_correct():
    spawn(_frozen_toggle, 2)


def _image_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(4, 3, 16, 16, generator=g),), torch.randint(0, 10, (4,), generator=g)


def _xent(out, target):
    return F.cross_entropy(out, target)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _assert_buffers_equal(ours: nn.Module, ref: nn.Module, what: str) -> None:
    named = dict(ref.named_buffers())
    for name, b in ours.named_buffers():
        torch.testing.assert_close(b, named[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{what} buffer {name}: {m}")


def _buffers(rank: int, world: int, broadcast: bool) -> None:
    torch.manual_seed(0)
    model = models.CNN()
    ref = DDP(copy.deepcopy(model), broadcast_buffers=broadcast)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", broadcast_buffers=broadcast, bucket_cap_mb=0.01)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        (x,), y = _image_batch(rank, step)
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=True)
            _xent(m(x), y).backward()
        _assert_grads_equal(ours.module, ref.module, atol=1e-5, rtol=1e-4)
        # DDP's rule, both settings: with broadcast, each forward after a synced step starts
        # from rank 0's buffers, then updates them with the rank's own batch.
        _assert_buffers_equal(ours.module, ref.module, f"step {step}")
        for opt in opts:
            opt.step()

    def stats(m: nn.Module) -> torch.Tensor:
        return torch.cat([m.bn1.running_mean, m.bn1.running_var])

    # Each rank's last forward updated the running stats with its own batch: they differ
    # between the ranks in both settings (hence the eval forward below).
    assert not _same_on_every_rank(stats(ours.module))
    # An eval forward (stats not updated) after a synchronised step: DDP broadcasts rank 0's
    # buffers before it with broadcast_buffers, and leaves each rank's own without.
    (x,), _ = _image_batch(rank, 99)
    with torch.no_grad():
        for m in (ref, ours):
            m.eval()
            m(x)
    assert _same_on_every_rank(stats(ref.module)) == broadcast  # the reference does what we claim
    _assert_buffers_equal(ours.module, ref.module, "after the eval forward")
    same = _same_on_every_rank(stats(ours.module))
    assert same == broadcast, (
        f"broadcast_buffers={broadcast}: BatchNorm stats are {'equal' if same else 'different'} on the ranks "
        "after the eval forward"
    )


@pytest.mark.parametrize("broadcast", [True, False])
def test_batchnorm_buffers_match_ddp(broadcast):
    spawn(_buffers, 2, broadcast)


class _HandCompressed(nn.Module):
    """Reference where DDP's bf16 hook refuses to run (it needs NCCL): the same elementwise
    recipe by hand, per parameter (cast, divide, all-reduce, cast back)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p: torch.Tensor) -> None:
        wire = p.grad.to(self.dtype).div_(dist.get_world_size())
        dist.all_reduce(wire)
        p.grad.copy_(wire)

    def forward(self, x):
        return self.module(x)


def _compression(rank: int, world: int, hook: str) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    if hook == "fp16_compress":
        ref = DDP(copy.deepcopy(model))
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        ref = _HandCompressed(copy.deepcopy(model), torch.bfloat16)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", comm_hook=hook, **CAPS)
    for step in range(2):
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            F.mse_loss(m(x), y).backward()
        _assert_grads_equal(ours.module, ref.module, atol=1e-6, rtol=1e-5)
    (schedule,) = ours.schedules
    for b in schedule.buckets:
        assert b.comm_dtype == {"fp16_compress": "float16", "bf16_compress": "bfloat16"}[hook]
        assert b.wire_nbytes * 2 == b.nbytes  # half the bytes on the wire
    assert "float16" in schedule.to_json()


@pytest.mark.parametrize("hook", ["fp16_compress", "bf16_compress"])
def test_compression_hooks_match_ddp(hook):
    spawn(_compression, 2, hook)


def test_unknown_or_bare_callable_comm_hook_is_a_clear_error(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="comm_hook"):
        graphddp.compile(models.MLP(), comm_hook="powersgd")
    with pytest.raises(TypeError, match=r"comm_hook: pass a hook as \(state, hook\)"):
        graphddp.compile(models.MLP(), comm_hook=lambda bucket, group: bucket)


def _bucket_views(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ours = graphddp.compile(models.MLP(), backend="aot_eager", **CAPS)
    x, y = _batch(rank, 0)
    F.mse_loss(ours(x), y).backward()
    params = dict(ours.module.named_parameters())
    for bucket in ours.schedules[0].buckets:
        storages = {params[n].grad.untyped_storage().data_ptr() for n in bucket.param_names}
        assert len(storages) == 1, f"bucket {bucket.index}: gradients are not views of one flat buffer"


def test_gradients_are_views_into_the_bucket_buffer():
    spawn(_bucket_views, 2)
