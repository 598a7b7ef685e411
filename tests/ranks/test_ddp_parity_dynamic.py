"""Parity with torch's DistributedDataParallel under dynamic shapes.

Spawned gloo CPU ranks (2) train graphddp (``backend="aot_eager"``) next to
``torch.nn.parallel.DistributedDataParallel`` (``parity_harness.py``): sequence lengths that
differ between the ranks at one step under ``dynamic=True``; batch sizes under ``dynamic=None``
(a static graph, then one symbolic graph) and ``dynamic=True``, never a graph per size; the
eager fallback after Dynamo's recompile limit, whose grads are still DDP's average (or every
rank raises); and a dynamic backward that compiles eagerly without a logged failure.
"""
from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from parity_harness import DDP_CAPS, FP32_TOL, _assert_same_on_every_rank, _mse, _token_batch, _train_side_by_side, _vector_batch, _xent
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn


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
    assert ours._state.backend.graphs_compiled == 1, ours._state.backend.graphs_compiled
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
