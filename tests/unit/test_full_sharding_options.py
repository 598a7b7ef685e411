"""``sharding="full"`` in one process (a fake group of 8 ranks): what it refuses by name, and how
it cuts a model (parts, tied weights, one class per kind of module). Training against DDP is
tests/ranks/test_full_sharding.py."""
import warnings

import pytest
import torch
import torch.nn as nn

import graphddp
from graphddp import models
from graphddp.values.shards import chunk


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize(
    "options, names",
    [
        ({"bucket_cap_mb_list": [1, 2]}, "bucket_cap_mb_list"),
        ({"first_bucket_cap_mb": 1}, "first_bucket_cap_mb"),
        ({"comm_hook": "bf16_compress"}, "comm_hook"),
        ({"backend": "eager"}, "backend='inductor' or 'aot_eager'"),
        ({"gather": "forward"}, "gather='forward'"),
    ],
)
def test_what_full_sharding_does_not_take_is_refused_by_name(fake_world, options, names):
    fake_world(8)
    model = models.MLP()
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace("[", r"\[")):
        graphddp.compile(model, optimizer=_adamw(model), sharding="full", **options)


def test_reshard_after_forward_belongs_to_full_sharding(fake_world):
    fake_world(8)
    model = models.MLP()
    with pytest.raises(ValueError, match="reshard_after_forward"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="optimizer", reshard_after_forward=False)
    with pytest.raises(ValueError, match="reshard_after_forward must be True or False"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="full", reshard_after_forward="yes")


def test_replicate_below_mb_belongs_to_full_sharding(fake_world):
    fake_world(4)
    model = models.MLP()
    with pytest.raises(ValueError, match="replicate_below_mb is an option of sharding='full'"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="optimizer", replicate_below_mb=1.0)
    for bad in (-1.0, "1", True, float("inf")):
        with pytest.raises(ValueError, match="replicate_below_mb must be a number of MB >= 0"):
            graphddp.compile(model, optimizer=_adamw(model), sharding="full", replicate_below_mb=bad)
    with pytest.raises(ValueError, match="sharding='auto' chooses .*replicate_below_mb"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="auto", example=torch.randn(2, 16), replicate_below_mb=1.0)


def test_mp_policy_is_fsdp2s_and_belongs_to_full_sharding(fake_world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fake_world(8)
    model = models.MLP()
    with pytest.raises(ValueError, match="mp_policy is an option of sharding='full'"):
        graphddp.compile(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got dict"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="full", mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="mp_policy.reduce_dtype must be a floating-point torch.dtype"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="full",
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.int32))
    with pytest.raises(ValueError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got str"):
        graphddp.compile(model, optimizer=_adamw(model), sharding="auto", example=torch.randn(2, 16), mp_policy="bf16")
    with pytest.raises(ValueError, match="sharding='auto' with mp_policy weighs full sharding's placements only .*optimizer="):
        graphddp.compile(model, sharding="auto", example=torch.randn(2, 16), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def test_full_sharding_needs_the_optimizer(fake_world):
    fake_world(8)
    with pytest.raises(ValueError, match="optimizer="):
        graphddp.compile(models.MLP(), sharding="full")


def test_the_backend_builds_full_sharding_and_refuses_it_by_its_own_name(fake_world):
    """graphddp.backend(sharding="full") cuts the model's parameters now (training through it:
    tests/ranks/test_full_sharding.py); its refusals name graphddp.backend."""
    fake_world(8)
    model = models.MLP()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    made = graphddp.backend(model, optimizer=_adamw(model), sharding="full", backend="aot_eager")
    assert set(made.parts) == set(shapes) and made.world_size == 8
    assert all(p.dim() == 1 for p in model.parameters()), "the model holds its parts"
    assert {n: v.shape for n, v in model.state_dict().items() if n in shapes} == shapes, "state_dict() is whole"
    with pytest.raises(ValueError, match="graphddp.backend: sharding='full' keeps each parameter's optimizer state"):
        graphddp.backend(models.MLP(), sharding="full")
    with pytest.raises(ValueError, match="graphddp.compile: sharding='full' keeps each parameter's optimizer state"):
        graphddp.compile(models.MLP(), optimizer=[torch.zeros(1)], sharding="full", backend="aot_eager")


def test_both_forms_show_one_surface_and_refuse_what_full_sharding_lacks_by_name(fake_world):
    """The module and the backend object are one surface over the mode's state in every mode:
    the same class whatever the sharding, join() and register_comm_hook refused by name with
    sharding="full", the switch held by the state, the whole optimizer state read from either."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fake_world(8)
    model, other = models.MLP(), models.MLP()
    forms = [
        graphddp.compile(model, optimizer=_adamw(model), sharding="full", backend="aot_eager"),
        graphddp.backend(other, optimizer=_adamw(other), sharding="full", backend="aot_eager"),
    ]
    replicated = graphddp.compile(models.MLP(), backend="aot_eager")
    assert type(forms[0]) is type(replicated)
    assert replicated.parts == {} and set(forms[0].parts) == {n for n, _ in model.named_parameters()}  # a part of each, or none
    for made in forms:
        with pytest.raises(NotImplementedError, match=r"join\(\) is not supported with sharding='full'"):
            made.join()
        with pytest.raises(NotImplementedError, match="register_comm_hook is not supported with sharding='full'"):
            made.register_comm_hook(None, default_hooks.allreduce_hook)
        with made.no_sync():
            assert made.require_backward_grad_sync is False and made._state.sync is False
        assert made.require_backward_grad_sync is True
        state = graphddp.full_optimizer_state_dict(made)
        assert state["param_groups"] and made.full_optimizer_state_dict().keys() == state.keys()
    with pytest.raises(TypeError, match="graphddp.full_optimizer_state_dict: expects a model from graphddp.compile"):
        graphddp.full_optimizer_state_dict(graphddp.compile(models.MLP(), backend="aot_eager"))


def test_an_optimizer_over_other_tensors_is_refused(fake_world):
    fake_world(8)
    model = models.MLP()
    opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the module"):
        graphddp.compile(model, optimizer=opt, sharding="full")


def test_each_parameter_becomes_its_part_and_tied_weights_share_one(fake_world):
    fake_world(8)
    model = models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8)
    whole = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    opt = _adamw(model)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager")
    assert set(ours.parts) == set(whole), "every name, tied ones included, has its part"
    held = dict(model.named_parameters(remove_duplicate=False))  # the module's own: parts
    for name, shape in whole.items():
        part = ours.parts[name]
        assert part.shape == shape
        assert held[name] is part.part and tuple(held[name].shape) == (chunk(part.numel, 8),), f"{name} is held as its part"
    tied = [n for n in whole if ours.parts[n].names != [n] and len(ours.parts[n].names) > 1]
    assert tied, "BreakGPT ties its embedding to its head"
    assert len({id(ours.parts[n].part) for n in tied}) == 1, "tied names share one part"
    # The optimizer steps the parts, each once.
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in stepped} == {id(p.part) for p in ours.parts.values()}
    assert len(stepped) == len({id(p) for p in stepped})
    # Modules of one class with the same parameters share one gathering class (Dynamo guards on
    # a module's class: one per block would be a guard per block).
    kinds = {}
    for m in model.modules():
        if m._parameters:
            names = tuple(n for n, p in m._parameters.items() if p is not None)
            kinds.setdefault((type(m).__mro__[1], names), set()).add(type(m))
    assert kinds and all(len(classes) == 1 for classes in kinds.values())
    assert all(type(m).__name__.startswith("FullySharded") for m in model.modules() if m._parameters)


@pytest.mark.parametrize("sharding", [None, "optimizer", "full"])
def test_the_updates_inside_refuse_clipping_and_leave_a_scaled_step_to_the_grad_scaler(fake_world, sharding):
    """With AdamW each backward updates its parameters (or parts) itself: clipping their p.grad
    would clip nothing, refused by name; a loss an enabled GradScaler scaled makes the backward
    return the gradients to ``scaler.step`` instead (reason "scaler"), counted alike in every mode."""
    fake_world(8)
    model = models.MLP()
    opt = _adamw(model)
    ours = graphddp.compile(model, optimizer=opt, sharding=sharding, backend="aot_eager")
    loss = ours(torch.randn(2, 16)).sum()
    with pytest.raises(RuntimeError, match="max_grad_norm="):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.amp.GradScaler("cpu", enabled=False).scale(loss).backward()  # disabled: nothing to leave
    assert ours.updates == {"inside": 1} and all(p.grad is None for p in model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(ours(torch.randn(2, 16)).sum()).backward()
    assert ours.updates == {"inside": 1, "scaler": 1}
    assert all(p.grad is not None for p in ours.module.parameters()), "the parts' gradients wait for the scaler"
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    ours(torch.randn(2, 16)).sum().backward()
    assert ours.updates == {"inside": 2, "scaler": 1}


@pytest.mark.parametrize("sharding", [None, "optimizer", "full"])
def test_a_weight_tied_across_a_graph_break_is_left_to_the_step_with_a_warning_and_a_record_in_every_mode(fake_world, sharding):
    """The same reason leads to the same things in every mode: a warning naming the parameter, once,
    and the backward's record (``GraphRecord.fallbacks["shared"]``)."""
    fake_world(8)
    torch.manual_seed(0)
    model = models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8)
    ours = graphddp.compile(model, optimizer=_adamw(model), sharding=sharding, backend="aot_eager")
    x = torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning, match=r"tok\.weight.*to torch's step"):
        ours(x).float().mean().backward()
    assert [r.fallbacks["shared"] for r in ours.records if "shared" in r.fallbacks] == [("tok.weight",)] * 2  # both graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per graph and reason
        ours(x).float().mean().backward()


def test_other_optimizers_and_max_grad_norm_step_after_the_backward(fake_world):
    fake_world(8)
    model = models.MLP()
    rms = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    ours = graphddp.compile(model, optimizer=rms, sharding="full", backend="aot_eager")
    ours(torch.randn(2, 16)).sum().backward()
    assert ours.updates == {} and all(p.grad is not None for p in model.parameters())
    clipped = models.MLP()
    ours = graphddp.compile(clipped, optimizer=_adamw(clipped), sharding="full", backend="aot_eager", max_grad_norm=1.0)
    ours(torch.randn(2, 16)).sum().backward()
    assert ours.updates == {} and all(p.grad is not None for p in clipped.parameters())


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_clipping_the_gathered_copies_is_refused_by_name(fake_world, clip):
    """nanoGPT clips model.parameters(): with sharding='full' those are whole copies for reading,
    with no gradient, so torch would clip nothing and return 0; refused whatever the optimizer
    (here RMSprop, whose parts keep their gradients to opt.step()). By norm, the parts' own
    gradients are refused too (each rank's norm would be its share); by value they clip."""
    fake_world(8)
    model = models.MLP()
    ours = graphddp.compile(model, optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3), sharding="full", backend="aot_eager")
    ours(torch.randn(2, 16)).sum().backward()
    instead = "max_grad_norm=" if clip == "clip_grad_norm_" else "Clip the parts' gradients instead"
    with pytest.raises(RuntimeError, match=f"{clip} was called on the whole parameters .* {instead}"):
        getattr(torch.nn.utils, clip)(ours.parameters(), 1.0)
    if clip == "clip_grad_value_":  # elementwise: the parts' own gradients clip as the whole would
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
    else:  # the parts' norm is this rank's share of the norm
        with pytest.raises(RuntimeError, match="clip_grad_norm_ was called on the parts .* max_grad_norm="):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_loading_by_assignment_is_refused_by_name(fake_world):
    """The optimizer, the compiled graphs and the update inside the backward hold the parts:
    a state dict is copied into them; assign=True would put new tensors in their place."""
    fake_world(8)
    model = models.MLP()
    ours = graphddp.compile(model, optimizer=_adamw(model), sharding="full", backend="aot_eager")
    whole = models.MLP().state_dict()
    with pytest.raises(ValueError, match=r"load_state_dict\(assign=True\) with sharding='full'"):
        ours.load_state_dict(whole, assign=True)
    parts = [p for p in model.parameters()]
    ours.load_state_dict(whole)
    assert all(a is b for a, b in zip(model.parameters(), parts, strict=True))  # the same tensors, loaded in place


def test_clipping_what_max_grad_norm_clips_already_says_so(fake_world):
    """With ``max_grad_norm=`` the parts are clipped before ``opt.step()`` by the whole
    gradient's norm; a clip call kept in the loop, on the gathered copies or on the parts, is
    told so, by which norm, and to drop it."""
    fake_world(8)
    model = models.MLP()
    ours = graphddp.compile(model, optimizer=_adamw(model), sharding="full", backend="aot_eager", max_grad_norm=1.0, grad_norm_type=1)
    ours(torch.randn(2, 16)).sum().backward()
    for params in (ours.parameters(), model.parameters()):
        with pytest.raises(RuntimeError, match=r"They are clipped already: with max_grad_norm=1\.0 given, graphddp clips the averaged "
                                               r"gradients by their global L1 norm before the update\. Drop this call$"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=1)
