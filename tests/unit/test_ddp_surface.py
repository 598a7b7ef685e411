"""DDP's public surface on graphddp's module, in one process (the fake process group).

The switch ``require_backward_grad_sync`` and ``no_sync()`` are one state, in both forms.
Numerics against DDP: ``tests/ranks/test_ddp_surface_ranks.py``.
"""
from __future__ import annotations

import pytest
import torch

import graphddp
from graphddp.models import MLP

X = torch.randn(4, 16)


def _model(**options) -> graphddp.GraphDDP:
    return graphddp.compile(MLP(), backend="aot_eager", bucket_cap_mb=0.01, **options)


def _train_step(model) -> None:
    model(X).sum().backward()


# -- require_backward_grad_sync and no_sync() ----------------------------------------------------------


def test_the_switch_is_the_steps_and_no_sync_sets_and_restores_it(fake_world):
    fake_world(2)
    model = _model()
    step = model._replica.step
    assert model.require_backward_grad_sync is True and step.sync is True
    with model.no_sync():
        assert model.require_backward_grad_sync is False and step.sync is False
        model.require_backward_grad_sync = True  # DDP: the switch, not the context, is read
        assert step.sync is True
    assert model.require_backward_grad_sync is True, "no_sync() restores the value it found"
    model.require_backward_grad_sync = 0  # read by its truth, as DDP reads it
    assert model.require_backward_grad_sync is False and step.sync is False
    with model.no_sync():
        pass
    assert model.require_backward_grad_sync is False


def test_a_forward_run_while_the_switch_is_false_runs_the_local_backward(fake_world):
    """On the fake group an all-reduce returns what it was given, so a synchronising backward
    gives the local gradient divided by the world size, a local one the gradient itself."""
    fake_world(8)
    model = _model()
    model.require_backward_grad_sync = False
    _train_step(model)
    local = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    assert [s.plain_compiles for s in model._backend.states] == [1]
    model.zero_grad()
    model.require_backward_grad_sync = True
    _train_step(model)
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(p.grad, local[name] / 8, msg=name)


def test_the_backend_forms_switch_is_on_the_backend_and_refused_on_the_model(fake_world):
    fake_world(2)
    module = MLP()
    backend = graphddp.backend(module, backend="aot_eager")
    with backend.no_sync():
        assert backend.require_backward_grad_sync is False and backend._replica.step.sync is False
    compiled = torch.compile(module, backend=backend)
    compiled.require_backward_grad_sync = False  # torch.compile's module sets it on the model
    assert module.__dict__["require_backward_grad_sync"] is False
    with pytest.raises(RuntimeError, match=r"require_backward_grad_sync was set on the model.*backend\.require_backward_grad_sync"):
        compiled(X)
    del module.require_backward_grad_sync
    compiled(X).sum().backward()
