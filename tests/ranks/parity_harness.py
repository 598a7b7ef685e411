"""The side-by-side harness of the DDP parity tests (``test_ddp_parity.py``,
``test_ddp_parity_dynamic.py``, ``test_ddp_parity_groups.py``): small bucket caps, tolerances,
per-rank data and losses, and ``_train_side_by_side``, which trains graphddp next to
``torch.nn.parallel.DistributedDataParallel`` on one spawned rank and asserts every ``p.grad``
each step and the parameters and buffers after the steps, with the checks it shares (averaged
grads bitwise equal on every rank, each trainable parameter reduced once per graph, buckets of
one dtype)."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.testing import paired_grads
from graphddp.values.comm import BUCKET_KEY, is_collective

# Small caps: several buckets per graph, so bucketing (and its dtype split) is exercised.
CAPS = {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.002}
DDP_CAPS = {"bucket_cap_mb": 0.01}  # DDP's first bucket size is not a constructor option
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
# Half precision: bf16 keeps 8 significant bits, fp16 11; allow a couple of ulps of rounding
# difference (observed: none, graphddp's grads are bitwise DDP's). Averaging itself is checked
# without tolerance: averaged grads are bitwise equal on every rank of the group.
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
FP16_TOL = {"atol": 1e-3, "rtol": 2e-3}


# -- data and losses ------------------------------------------------------------------------------


def _vector_batch(rank: int, step: int, dtype: torch.dtype = torch.float32, batch: int = 8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(batch, 16, generator=g).to(dtype),), torch.randn(batch, 4, generator=g).to(dtype)


def _image_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(4, 3, 16, 16, generator=g),), torch.randint(0, 10, (4,), generator=g)


def _token_batch(rank: int, step: int, seq: int = 16):
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, 128, (4, seq + 1), generator=g)
    return (idx[:, :-1],), idx[:, 1:]


def _mse(out, target):
    return F.mse_loss(out.float(), target.float())


def _xent(out, target):
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


# -- the side-by-side harness ------------------------------------------------------------------------


def _train_side_by_side(
    make_model,
    make_batch,
    loss_fn,
    *,
    steps: int = 3,
    tol: dict = FP32_TOL,
    autocast: torch.dtype | None = None,
    process_group=None,
    lr: float = 0.05,
    **graphddp_kwargs,
):
    """Train DDP and graphddp on this rank's data; assert equal grads each step, params at the end.

    ``make_batch(rank, step)`` is called with the global rank, so every rank sees other data.
    Returns ``(graphddp_module, ddp_module, worst)``, ``worst`` the largest grad difference.
    """
    torch.manual_seed(1234)
    model = make_model()
    ref = DDP(copy.deepcopy(model), process_group=process_group, **DDP_CAPS)
    ours = graphddp.compile(
        copy.deepcopy(model), process_group=process_group, backend="aot_eager", **CAPS, **graphddp_kwargs
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
    rank = dist.get_rank()
    worst = 0.0
    for step in range(steps):
        inputs, target = make_batch(rank, step)
        outs = []
        for m, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with ctx:
                out = m(*inputs)
                loss = loss_fn(out, target)
            loss.backward()
            outs.append(out)
        assert outs[0].dtype == outs[1].dtype, (outs[0].dtype, outs[1].dtype)
        _assert_same_on_every_rank([p.grad for p in ours.parameters() if p.grad is not None], process_group, f"step {step} grads")
        for name, p, q in paired_grads(ours.module, ref.module, step):
            assert p.grad.dtype == q.grad.dtype == p.dtype, (name, p.grad.dtype, q.grad.dtype, p.dtype)
            worst = max(worst, (p.grad.float() - q.grad.float()).abs().max().item())
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
        opt_ref.step()
        opt_ours.step()
    named_ref = dict(ref.module.named_parameters())
    for name, p in ours.module.named_parameters():
        torch.testing.assert_close(p, named_ref[name], **tol, msg=lambda m: f"param {name} after {steps} steps: {m}")
    named_ref_buf = dict(ref.module.named_buffers())
    for name, b in ours.module.named_buffers():
        torch.testing.assert_close(b, named_ref_buf[name], **tol, msg=lambda m: f"buffer {name}: {m}")
    _assert_each_trainable_param_reduced_once(ours)
    return ours, ref, worst


def _assert_same_on_every_rank(tensors, group, what: str) -> None:
    """Bitwise equal on every rank of ``group``: true of averaged grads, not of local ones."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    for r, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"{what} differ between group ranks 0 and {r}"


def _assert_each_trainable_param_reduced_once(ours) -> None:
    """Each backward graph (a recompile makes another one) reduces every trainable param once."""
    trainable = sorted(n for n, p in ours.module.named_parameters() if p.requires_grad)
    assert ours.schedules
    for s in ours.schedules:
        assert sorted(s.param_names) == trainable, (s.graph_index, s.param_names, trainable)


def _assert_buckets_single_dtype(ours) -> set[str]:
    """Every bucket holds one dtype, the dtype of its parameters, in the plan and in the graph."""
    params = dict(ours.module.named_parameters())
    seen = set()
    for record in ours.records:
        schedule = record.schedule
        for bucket in schedule.buckets:
            assert {slot.dtype for slot in bucket.slots} == {bucket.dtype}, bucket
            for slot in bucket.slots:
                assert params[slot.param_name].dtype == getattr(torch, bucket.dtype), (slot.param_name, bucket.dtype)
            seen.add(bucket.dtype)
        # The flat buffer the graph actually all-reduces has the bucket's dtype (a cat of mixed
        # dtypes would silently promote).
        reduced = [n for n in record.graph.graph.nodes if is_collective(n)]
        assert len(reduced) == len(schedule.buckets)
        for node in reduced:
            bucket = schedule.buckets[node.meta[BUCKET_KEY]]
            assert node.meta["val"].dtype == getattr(torch, bucket.dtype), (node.name, bucket.dtype)
    return seen
