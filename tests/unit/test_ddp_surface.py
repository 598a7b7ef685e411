"""DDP's public surface on graphddp's module, in one process (the fake process group).

The switch ``require_backward_grad_sync`` and ``no_sync()`` are one state; ``register_comm_hook``
maps DDP's own hooks to graphddp's and refuses what DDP refuses (late, twice) and what graphddp
cannot map, by name; DDP's constructor keywords are accepted where graphddp does what they ask
and refused by name otherwise. Numerics against DDP: ``tests/ranks/test_ddp_surface_ranks.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd

import graphddp
from graphddp.hooks import PowerSGD
from graphddp.models import MLP
from graphddp.hooks.examples import fp16_hook

X = torch.randn(4, 16)


def _model(**options) -> graphddp.GraphDDP:
    return graphddp.compile(MLP(), backend="aot_eager", bucket_cap_mb=0.01, **options)


def _train_step(model) -> None:
    model(X).sum().backward()


# -- require_backward_grad_sync and no_sync() ----------------------------------------------------------


def test_the_switch_is_the_steps_and_no_sync_sets_and_restores_it(fake_world):
    fake_world(2)
    model = _model()
    step = model._state.step
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
    assert [s.plain_compiles for s in model._state.backend.states] == [1]
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
        assert backend.require_backward_grad_sync is False and backend._state.step.sync is False
    compiled = torch.compile(module, backend=backend)
    compiled.require_backward_grad_sync = False  # torch.compile's module sets it on the model
    assert module.__dict__["require_backward_grad_sync"] is False
    with pytest.raises(RuntimeError, match=r"require_backward_grad_sync was set on the model.*backend\.require_backward_grad_sync"):
        compiled(X)
    del module.require_backward_grad_sync
    compiled(X).sum().backward()


# -- register_comm_hook ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hook, comm_hook, wire", [
    (default_hooks.allreduce_hook, None, None),
    (default_hooks.fp16_compress_hook, "fp16_compress", "float16"),
    (default_hooks.bf16_compress_hook, "bf16_compress", "bfloat16"),
])
def test_ddps_default_hooks_become_graphddps_built_in_ones(fake_world, hook, comm_hook, wire):
    fake_world(2)
    model = _model()
    model.register_comm_hook(dist.group.WORLD if comm_hook else None, hook)  # state: the group, None is WORLD
    assert model.config.comm_hook == comm_hook
    _train_step(model)
    assert {b.comm_dtype for b in model.schedules[0].buckets} == {wire}


def test_powersgd_hook_becomes_graphddps_powersgd_with_the_states_settings_stream_and_count(fake_world):
    fake_world(2)
    settings = dict(matrix_approximation_rank=3, start_powerSGD_iter=5, min_compression_rate=1.5, use_error_feedback=False,
                    warm_start=False, orthogonalization_epsilon=1e-6, batch_tensors_with_same_shape=True)
    state = ddp_powersgd.PowerSGDState(None, random_seed=11, **settings)
    state.iter = 2  # plain all-reduce steps DDP already counted
    model = _model()
    model.register_comm_hook(state, ddp_powersgd.powerSGD_hook)
    hook = model.config.comm_hook
    assert isinstance(hook, PowerSGD) and model._state.backend.hook is hook
    assert {k: getattr(hook, k) for k in settings} == settings
    assert hook.iter == 2
    expected = PowerSGD(random_seed=11).rng.randint(1_000_000_000)
    assert hook.rng.randint(1_000_000_000) == expected, "the state's random stream, continued"
    _train_step(model)
    assert {b.hook for b in model.schedules[0].buckets} == {"PowerSGD"} and hook.iter == 3


def test_a_hooks_state_rides_in_the_state_dict_and_a_model_without_one_refuses_it(fake_world):
    """PowerSGD's state is saved under "graphddp_comm_hook" beside the model's own keys; loading
    it into a model that runs no traced hook is refused, not dropped."""
    fake_world(2)
    model = _model()
    model.register_comm_hook(ddp_powersgd.PowerSGDState(None, start_powerSGD_iter=2), ddp_powersgd.powerSGD_hook)
    _train_step(model)
    saved = model.state_dict()
    assert "graphddp_comm_hook" in saved and saved.keys() - {"graphddp_comm_hook"} == model.module.state_dict().keys()
    model.load_state_dict(saved)
    with pytest.raises(ValueError, match="'graphddp_comm_hook' .* runs no traced comm hook"):
        _model().load_state_dict(saved)


def test_a_users_hook_registered_is_traced_as_comm_hook_is(fake_world):
    fake_world(2)
    model = _model()
    model.register_comm_hook(None, fp16_hook)
    assert model.config.traced_hook.name == "fp16_hook"
    _train_step(model)
    assert {b.hook for b in model.schedules[0].buckets} == {"fp16_hook"}


def test_register_comm_hook_is_refused_after_the_first_forward_twice_and_with_comm_hook(fake_world):
    fake_world(2)
    late = _model()
    _train_step(late)
    with pytest.raises(RuntimeError, match=r"fp16_compress_hook must be registered before the first forward"):
        late.register_comm_hook(None, default_hooks.fp16_compress_hook)
    twice = _model()
    twice.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match=r"can only be registered once.*fp16_compress_hook is the second"):
        twice.register_comm_hook(None, default_hooks.fp16_compress_hook)
    given = _model(comm_hook="bf16_compress")
    with pytest.raises(ValueError, match=r"compiled with comm_hook='bf16_compress'; registering fp16_compress_hook"):
        given.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert given.config.comm_hook == "bf16_compress", "a refused hook changes nothing"


def test_register_comm_hook_refuses_what_it_cannot_map_by_name(fake_world):
    fake_world(4)
    model = _model()
    other = dist.new_group([0, 1])
    with pytest.raises(ValueError, match=r"fp16_compress_hook's state .* is process group '1', but this model averages over group '0'"):
        model.register_comm_hook(other, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match=r"PowerSGDState's process_group is process group '1'"):
        model.register_comm_hook(ddp_powersgd.PowerSGDState(other, start_powerSGD_iter=2), ddp_powersgd.powerSGD_hook)
    used = ddp_powersgd.PowerSGDState(None, start_powerSGD_iter=2)
    used.error_dict[0] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"PowerSGDState has compressed already: its \['error_dict'\]"):
        model.register_comm_hook(used, ddp_powersgd.powerSGD_hook)
    with pytest.raises(TypeError, match=r"powerSGD_hook's state must be a PowerSGDState, got NoneType"):
        model.register_comm_hook(None, ddp_powersgd.powerSGD_hook)
    for hook, name in ((ddp_powersgd.batched_powerSGD_hook, "batched_powerSGD_hook"), (debugging_hooks.noop_hook, "noop_hook"),
                       (default_hooks.fp16_compress_wrapper(ddp_powersgd.powerSGD_hook), "fp16_compress_wrapper_hook")):
        with pytest.raises(ValueError, match=rf"DDP's .*{name} has no in-graph equivalent"):
            model.register_comm_hook(None, hook)
    assert model.config.comm_hook is None
    _train_step(model)  # nothing was registered: the refusals left the model as it was


def test_register_comm_hook_with_optimizer_refuses_a_traced_hook_as_comm_hook_does(fake_world):
    fake_world(2)
    module = MLP()
    model = graphddp.compile(module, backend="aot_eager", optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"register_comm_hook: optimizer= with comm_hook=fp16_hook is not supported"):
        model.register_comm_hook(None, fp16_hook)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # a built-in one is fine, as comm_hook= is
    assert model.config.comm_hook == "fp16_compress"


def test_the_backend_form_registers_a_hook_too(fake_world):
    fake_world(2)
    module = MLP()
    backend = graphddp.backend(module, backend="aot_eager", bucket_cap_mb=0.01)
    backend.register_comm_hook(None, default_hooks.bf16_compress_hook)
    torch.compile(module, backend=backend)(X).sum().backward()
    assert {b.comm_dtype for b in backend.schedules[0].buckets} == {"bfloat16"}


# -- DDP's constructor keywords -------------------------------------------------------------------------


@pytest.mark.parametrize("keywords", [
    dict(device_ids=None, output_device=None),
    dict(device_ids=[]),
    dict(device_ids=["cpu"], output_device=torch.device("cpu")),
    dict(device_ids=[torch.device("cpu")], output_device="cpu"),
    dict(find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True),
    dict(find_unused_parameters=False, static_graph=False),
], ids=["none", "empty", "cpu-str", "cpu-device", "true", "false"])
def test_ddps_keywords_graphddp_can_honour_are_accepted(fake_world, keywords):
    fake_world(2)
    model = _model(**keywords)
    _train_step(model)
    for name, value in keywords.items():
        if name == "device_ids":
            assert model.config.device_ids == (tuple(value or ()) or None)
        else:
            assert getattr(model.config, name) == value


@pytest.mark.parametrize("keywords, error, match", [
    (dict(device_ids=[0]), ValueError, r"device_ids=\[0\] does not name the device of the module's parameters \(cpu\)"),
    (dict(device_ids=["cuda:0"]), ValueError, r"device_ids=\['cuda:0'\] does not name the device"),
    (dict(device_ids=["cpu", "cpu"]), ValueError, r"device_ids can only be None or contain a single element"),
    (dict(device_ids=0), ValueError, r"device_ids must be None or a list of one device"),
    (dict(device_ids=["gpu0"]), ValueError, r"device_ids\[0\]: 'gpu0' is not a device"),
    (dict(output_device=1), ValueError, r"output_device=1 does not name the device of the module's parameters"),
    (dict(output_device=True), ValueError, r"output_device must name a device"),
    (dict(find_unused_parameters="yes"), ValueError, r"find_unused_parameters must be True or False, got 'yes'"),
    (dict(static_graph=1), ValueError, r"static_graph must be True or False, got 1"),
    (dict(gradient_as_bucket_view=False), ValueError, r"gradient_as_bucket_view=False asks for gradients copied"),
    (dict(dim=1, check_reduction=False), TypeError, r"\['check_reduction', 'dim'\]: DistributedDataParallel's, which graphddp does not take"),
])
def test_ddps_keywords_graphddp_cannot_honour_are_refused_by_name(fake_world, keywords, error, match):
    fake_world(2)
    with pytest.raises(error, match=match):
        _model(**keywords)
    with pytest.raises(error, match=match):  # the backend form takes the same options
        graphddp.backend(MLP(), backend="aot_eager", **keywords)

