"""Parity with torch's DistributedDataParallel beyond plain fp32 training.

Spawned gloo CPU ranks (2 unless stated) train graphddp (``backend="aot_eager"``) next to
``torch.nn.parallel.DistributedDataParallel`` on the same model and the same data, every rank
on different data, and compare every ``p.grad`` each step and the parameters after several
optimizer steps. Covered: bf16 / fp16 / mixed-dtype parameters (buckets never mix dtypes),
CPU autocast, activation checkpointing, checkpoint save / resume, dynamic sequence lengths,
sub process groups and two models on two groups in one process, and world size 1.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import graphddp
from graphddp import models
from graphddp.testing import paired_grads, spawn
from graphddp.values.comm import BUCKET_KEY, is_all_reduce

# Small caps: several buckets per graph, so bucketing (and its dtype split) is exercised.
CAPS = {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.002}
DDP_CAPS = {"bucket_cap_mb": 0.01}  # DDP's first bucket size is not a constructor option
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}
# Half precision: bf16 keeps 8 significant bits, fp16 11; allow a couple of ulps of rounding
# difference (observed: none, graphddp's grads are bitwise DDP's). Averaging itself is checked
# without tolerance: averaged grads are bitwise equal on every rank of the group.
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
FP16_TOL = {"atol": 1e-3, "rtol": 2e-3}


# -- models and data ------------------------------------------------------------------------------


class MixedDtypeNet(nn.Module):
    """A bf16 front half and an fp32 back half, with explicit casts in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.low = models.MLP(width=64, depth=3, d_in=16, d_out=32).to(torch.bfloat16)
        self.high = models.MLP(width=64, depth=3, d_in=32, d_out=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.low(x.to(torch.bfloat16))
        return self.high(torch.relu(h).float())


class CheckpointedMLP(nn.Module):
    """Residual MLP blocks; the even-numbered ones run under non-reentrant checkpointing."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i % 2 == 0:
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return self.out(torch.tanh(h))


class CheckpointedGPT(models.TinyGPT):
    """TinyGPT with its first transformer block (attention included) checkpointed."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i == 0 else block(x)
        return self.head(self.ln(x))


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
        reduced = [n for n in record.graph.graph.nodes if is_all_reduce(n)]
        assert len(reduced) == len(schedule.buckets)
        for node in reduced:
            bucket = schedule.buckets[node.meta[BUCKET_KEY]]
            assert node.meta["val"].dtype == getattr(torch, bucket.dtype), (node.name, bucket.dtype)
    return seen


# -- 1. dtypes -------------------------------------------------------------------------------------


def _low_precision(rank: int, world: int) -> None:
    for dtype, tol in ((torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL)):
        ours, _, _ = _train_side_by_side(
            lambda: models.MLP().to(dtype),
            lambda r, s: _vector_batch(r, s, dtype),
            _mse,
            steps=3,
            tol=tol,
        )
        assert _assert_buckets_single_dtype(ours) == {str(dtype).replace("torch.", "")}
        assert len(ours.schedules[0].buckets) > 1
        torch._dynamo.reset()

    ours, _, _ = _train_side_by_side(MixedDtypeNet, _vector_batch, _mse, steps=3, tol=BF16_TOL)
    assert _assert_buckets_single_dtype(ours) == {"bfloat16", "float32"}
    for bucket in ours.schedules[0].buckets:
        prefix = "low." if bucket.dtype == "bfloat16" else "high."
        assert all(n.startswith(prefix) for n in bucket.param_names), bucket.param_names


def test_low_precision_and_mixed_dtype_params_match_ddp():
    """bf16 and fp16 models match DDP; a bf16+fp32 model gets single-dtype buckets."""
    spawn(_low_precision, 2)


# -- 2. autocast -------------------------------------------------------------------------------------


def _autocast(rank: int, world: int) -> None:
    for make_model, batch, loss in ((models.MLP, _vector_batch, _mse), (models.TinyGPT, _token_batch, _xent)):
        ours, _, _ = _train_side_by_side(make_model, batch, loss, steps=3, tol=BF16_TOL, autocast=torch.bfloat16)
        # Autocast changes compute dtypes, not gradient dtypes: fp32 params, fp32 buckets.
        assert _assert_buckets_single_dtype(ours) == {"float32"}
        torch._dynamo.reset()


def test_cpu_autocast_bf16_matches_ddp():
    spawn(_autocast, 2)


# -- 3. activation checkpointing ------------------------------------------------------------------------


def _activation_checkpointing(rank: int, world: int) -> None:
    for make_model, batch, loss in ((CheckpointedMLP, _vector_batch, _mse), (CheckpointedGPT, _token_batch, _xent)):
        ours, _, _ = _train_side_by_side(make_model, batch, loss, steps=3)
        assert len(ours.schedules) == 1  # checkpoint is traced, not a graph break
        assert len(ours.schedules[0].buckets) > 1
        torch._dynamo.reset()


def test_activation_checkpointing_matches_ddp():
    spawn(_activation_checkpointing, 2)


# -- 4. checkpoint save / resume ---------------------------------------------------------------------------


def _step(model, opt, batch) -> None:
    inputs, target = batch
    opt.zero_grad(set_to_none=True)
    _xent(model(*inputs), target).backward()
    opt.step()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(rank: int, world: int) -> None:
    make = models.CNN  # parameters plus BatchNorm buffers (running stats, num_batches_tracked)
    batches = [_image_batch(rank, s) for s in range(4)]

    # State-dict keys are the plain module's, in both directions.
    torch.manual_seed(1)
    probe = graphddp.compile(make(), backend="aot_eager", **CAPS)
    plain = make()
    assert list(probe.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(probe.state_dict())  # strict
    torch.manual_seed(2)
    other = make()
    probe.load_state_dict(other.state_dict())  # strict
    for k, v in other.state_dict().items():
        assert torch.equal(probe.state_dict()[k], v), k

    # The uninterrupted run: 4 steps, a checkpoint after step 2.
    torch.manual_seed(1234)
    model = graphddp.compile(make(), backend="aot_eager", **CAPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    after = []
    saved = None
    for s in range(4):
        _step(model, opt, batches[s])
        after.append(_snapshot(model))
        if s == 1:
            saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved is not None and saved["opt"]["state"], "momentum buffers must be in the checkpoint"

    # A fresh model (other initial weights) and a fresh optimizer resume from the checkpoint.
    torch.manual_seed(4321)
    resumed = graphddp.compile(make(), backend="aot_eager", **CAPS)
    assert not torch.equal(resumed.module.conv1.weight, after[1]["conv1.weight"])
    resumed.load_state_dict(saved["model"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    for s in (2, 3):
        _step(resumed, opt2, batches[s])
        got = _snapshot(resumed)
        for k, v in after[s].items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} differs after step {s + 1} of the resumed run"
    _assert_each_trainable_param_reduced_once(resumed)


def test_checkpoint_resume_equals_uninterrupted_run():
    spawn(_resume, 2)


# -- 5. dynamic shapes ---------------------------------------------------------------------------------


SEQ_LENS = (16, 12, 16)
RAGGED_SEQ_LENS = {0: SEQ_LENS, 1: (16, 8, 16)}


def _has_symbolic_shapes(record) -> bool:
    for node in record.graph.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return True
        if isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape):
            return True
    return False


def _dynamic_shapes(rank: int, world: int) -> None:
    # dynamic=True with the ranks seeing different lengths in the same step (as DDP allows):
    # rank 0 sees 16, 12, 16 and rank 1 16, 8, 16. A length seen before reuses its graph.
    # dynamic=None (a static graph, then automatic dynamic) with per-rank lengths runs on
    # every model of test_ddp_matrix.py (its dynamic_shapes feature).
    ours, _, _ = _train_side_by_side(
        lambda: models.TinyGPT(layers=1),
        lambda r, s: _token_batch(r, s, RAGGED_SEQ_LENS[r][s]),
        _xent,
        steps=len(SEQ_LENS),
        dynamic=True,
    )
    assert 1 <= len(ours.schedules) <= len(set(RAGGED_SEQ_LENS[rank])), len(ours.schedules)


def test_dynamic_sequence_lengths_match_ddp():
    """TinyGPT under dynamic=True, fed per-rank lengths: rank 0 16, 12, 16; rank 1 16, 8, 16."""
    spawn(_dynamic_shapes, 2)


BATCH_SIZES = (8, 6, 8, 4)


def _symbolic_graph_count(rank: int, world: int) -> None:
    # With the symbolic sizes left symbolic: dynamic=None compiles a static graph for 8, then
    # one symbolic graph (automatic dynamic) for 6 that 4 reuses; dynamic=True compiles one
    # symbolic graph for everything.
    for dynamic, expected in ((None, [False, True]), (True, [True])):
        ours, _, _ = _train_side_by_side(
            models.MLP,
            lambda r, s: _vector_batch(r, s, batch=BATCH_SIZES[s]),
            _mse,
            steps=len(BATCH_SIZES),
            dynamic=dynamic,
        )
        assert [_has_symbolic_shapes(r) for r in ours.records] == expected, (dynamic, len(ours.records))
        torch._dynamo.reset()


def test_dynamic_shapes_do_not_recompile_per_length():
    spawn(_symbolic_graph_count, 2)


def _recompile_limit_fallback(rank: int, world: int) -> None:
    # When Dynamo gives up on a frame (recompile_limit 1 and a new batch size under
    # dynamic=False) the step runs eagerly. The contract: either every p.grad is DDP's average,
    # or every rank raises a RuntimeError naming graphddp; never local, unaveraged grads.
    torch.manual_seed(1234)
    model = models.MLP()
    ref = DDP(copy.deepcopy(model), **DDP_CAPS)
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", dynamic=False, bucket_cap_mb=0.01)
    named_ref = dict(ref.module.named_parameters())
    with torch._dynamo.config.patch(recompile_limit=1):
        for step, batch in enumerate((8, 6)):
            inputs, target = _vector_batch(rank, step, batch=batch)
            for m in (ref, ours):
                m.zero_grad(set_to_none=True)
            _mse(ref(*inputs), target).backward()
            error = None
            try:
                _mse(ours(*inputs), target).backward()
            except RuntimeError as e:
                error = str(e)
            outcomes: list = [None] * world
            dist.all_gather_object(outcomes, error is None)
            assert len(set(outcomes)) == 1, f"step {step}: raised on some ranks only: {outcomes} ({error})"
            if error is not None:
                assert step == 1, f"step {step} compiles normally, yet raised: {error}"
                assert "graphddp" in error, error
                continue
            for name, p in ours.module.named_parameters():
                assert p.grad is not None, f"step {step} {name}: no grad"
                torch.testing.assert_close(p.grad, named_ref[name].grad, **FP32_TOL,
                                           msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
            _assert_same_on_every_rank([p.grad for p in ours.parameters()], None, f"step {step} grads")
    # The second batch size really hit the limit: no second graph was compiled for it.
    assert ours._backend.graphs_compiled == 1, ours._backend.graphs_compiled
    assert len(ours.schedules) == 1, [s.to_table() for s in ours.schedules]


def test_eager_fallback_after_recompile_limit_still_averages():
    spawn(_recompile_limit_fallback, 2)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _dynamic_no_failed_eager_backward(rank: int, world: int) -> None:
    handler = _Collect()
    logging.getLogger("torch._functorch._aot_autograd").addHandler(handler)
    _train_side_by_side(models.MLP, _vector_batch, _mse, steps=1, dynamic=True)
    failed = [m for m in handler.messages if "failed to eagerly compile backwards" in m]
    assert not failed, failed


def test_dynamic_backward_compiles_eagerly_without_error():
    spawn(_dynamic_no_failed_eager_backward, 2)


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
        assert not any(is_all_reduce(n) for n in record.graph.graph.nodes)


def test_world_size_one_equals_local_training():
    spawn(_single_rank, 1)
