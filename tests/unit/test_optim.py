"""The optimizer inside the backward, single-process: its math, its graph, its refusals.

* The traced update functions against ``torch.optim`` itself, eagerly, over several steps of
  gradients of shrinking size, for every supported option.
* The rewritten graph of an MLP compiled on 4 fake ranks: what ``insert_update`` made, and
  mutations only ``verify_updates`` catches (each names the node it points at).
* Refusals and the training-loop contract: unsupported optimizers and options, flags changed
  after compiling, ``step(closure)``, an LR scheduler created before or after, a hand-edited
  ``lr`` that takes effect without a recompile.

Numerics across ranks against DDP are in ``test_optim_ranks.py``.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphddp
from graphddp.graph.capture import storage_of
from graphddp.graph.verify import VerificationError
from graphddp.models import MLP
from graphddp.optim import attached as optim
from graphddp.optim.insert_update import WRITES
from graphddp.optim.verify import verify_updates
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_wait

aten = torch.ops.aten

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum_dampening_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "sgd_nesterov_maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_wd_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.95)),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_maximize_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, amsgrad=True, eps=1e-6),
    "adam_low_beta1": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.3, 0.9)),  # lerp's other formula
}


# -- the math ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_math_matches_torch_optim(name: str) -> None:
    torch.manual_seed(0)
    ref_param = nn.Parameter(torch.randn(257))
    param = ref_param.detach().clone()
    ref = OPTIMIZERS[name]([ref_param])
    rule = optim._group_rule(ref, 0)
    state: list[torch.Tensor] = []
    for step in range(6):
        grad = torch.randn(257) * 10.0 ** -step
        ref_param.grad = grad.clone()
        ref.step()
        hyper = [torch.tensor(v, dtype=torch.float64) for v in optim.hyper_values(ref.param_groups[0], rule)]
        if rule.kind == "adam" and not state:
            state = [torch.tensor(0.0)] + [torch.zeros(257) for _ in rule.state[1:]]
        elif rule.kind == "sgd" and rule.flag("momentum"):
            state = [state[0] if state else torch.zeros(257), torch.tensor(step == 0)]
        optim.UPDATES[rule.kind](rule, param, grad, state, hyper)
        # torch's CPU kernels fuse some multiply-adds; the traced ops round each: a few ulps.
        torch.testing.assert_close(param, ref_param.detach(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name} step {step}: {m}")


# -- the rewritten graph --------------------------------------------------------------------------


def _compiled(fake_world: Callable[[int], None], make_opt: Callable[[Any], torch.optim.Optimizer] = OPTIMIZERS["adamw"]):
    fake_world(4)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = make_opt(model.parameters())
    gd = graphddp.compile(model, optimizer=opt, backend="aot_eager", bucket_cap_mb=0.005)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return gd, opt, record


def test_rewritten_graph_updates_every_bucket_after_its_wait(fake_world) -> None:
    gd, opt, record = _compiled(fake_world)
    schedule = record.schedule
    assert schedule.optimizer == "AdamW(decoupled_weight_decay)"
    assert schedule.num_buckets >= 2
    assert [b.updates for b in schedule.buckets] == [b.param_names for b in schedule.buckets]
    outs = list(record.graph.graph.output_node().args[0])
    assert all(outs[s.output_index] is None for b in schedule.buckets for s in b.slots), "a gradient is still returned"
    copies = [n for n in record.graph.graph.nodes if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "update"]
    assert len(copies) == 4 * len(schedule.param_names)  # parameter, step, exp_avg, exp_avg_sq
    nodes = list(record.graph.graph.nodes)
    waits = [n for n in nodes if is_wait(n)]
    for b, wait in zip(schedule.buckets, waits):  # each bucket's writes sit between its wait and the next
        mine = [nodes.index(c) for c in copies if c.meta[BUCKET_KEY] == b.index]
        assert min(mine) > nodes.index(wait)
        if b.index + 1 < len(waits):
            assert max(mine) < nodes.index(waits[b.index + 1])
    assert all(p.grad is None for p in gd.parameters())
    assert all(opt.state[p]["step"].item() == 1.0 for p in gd.parameters())
    assert "updated in the graph" in schedule.to_table()
    again = type(schedule).from_json(schedule.to_json())
    assert again == schedule and again.fingerprint() == schedule.fingerprint()


def test_lookalike_parameters_share_a_trace_but_not_a_fake_value(fake_world) -> None:
    """Parameters of equal shapes reuse one traced update (insert_update's cache), each with
    fake values of its own: every write's value is the memory it writes, and no value object
    serves two nodes other than a write and the memory it writes (the verifiers and inductor
    learn aliasing from these values)."""
    from graphddp.graph.capture import storage_of

    gd, opt, record = _compiled(fake_world)
    nodes = [n for n in record.graph.graph.nodes if n.meta.get(ROLE_KEY) == "update"]
    copies = [n for n in nodes if n.target is aten.copy_.default]
    shapes = [tuple(p.shape) for p in gd.parameters()]
    assert len(shapes) > len(set(shapes)), "the model has no lookalike parameters: nothing to reuse"
    for c in copies:
        assert storage_of(c.meta["val"]) == storage_of(c.args[0].meta["val"]), f"{c.name} writes one memory, its value is another's"
    owners: dict[int, fx.Node] = {}
    for n in nodes:
        first = owners.setdefault(id(n.meta["val"]), n)
        if first is not n:
            assert n.target is aten.copy_.default and n.args[0] is first or first.target is aten.copy_.default and first.args[0] is n, \
                f"{first.name} and {n.name} share one fake value"


def _updates(gm: fx.GraphModule, bucket: int) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "update" and n.meta.get(BUCKET_KEY) == bucket]


def _param_write(gm: fx.GraphModule, bucket: int) -> fx.Node:
    """The bucket's last write: its last parameter's ``copy_``."""
    return [n for n in _updates(gm, bucket) if n.target is aten.copy_.default][-1]


def _mutate_next_wait_early(gm: fx.GraphModule) -> str:
    wait1 = [n for n in gm.graph.nodes if is_wait(n)][1]
    _updates(gm, 0)[0].prepend(wait1)
    return "no longer overlaps"


def _mutate_read_after_write(gm: fx.GraphModule) -> str:
    write = _param_write(gm, 0)
    with gm.graph.inserting_after(write):
        late = gm.graph.call_function(aten.clone.default, (write.args[0],))
    late.meta["val"] = write.args[0].meta["val"]
    return "after"


def _mutate_alias_read(gm: fx.GraphModule) -> str:
    """A saved input the rewrite turned into a view of the parameter's own input, read again."""
    views = [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "alias"]
    alias, view = next(
        (ph, v) for ph in gm.graph.nodes if ph.op == "placeholder" and not ph.users and WRITES not in ph.meta
        for v in views if storage_of(v.meta["val"]) == storage_of(ph.meta["val"])
        and v.meta["val"].shape == ph.meta["val"].shape and v.meta["val"].stride() == ph.meta["val"].stride()
    )
    view.replace_all_uses_with(alias)
    return "another input backed by the parameter's memory"


def _mutate_local_gradient(gm: fx.GraphModule) -> str:
    view = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "unflatten" and n.target is aten.view.default)
    with gm.graph.inserting_after(view):
        other = gm.graph.call_function(aten.clone.default, (view,))
    other.meta["val"] = view.meta["val"]
    view.replace_all_uses_with(other, delete_user_cb=lambda user: user.meta.get(ROLE_KEY) == "update")
    return "does not read the bucket's reduced gradient"


MUTATIONS = {
    "U6 next wait before the update": _mutate_next_wait_early,
    "U3 read after the write": _mutate_read_after_write,
    "U4 read through an aliasing input": _mutate_alias_read,
    "U5 update reads another gradient": _mutate_local_gradient,
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verify_updates_rejects(fake_world, name: str) -> None:
    _, _, record = _compiled(fake_world)
    verify_updates(record.graph, record.schedule)  # pristine
    gm = copy.deepcopy(record.graph)
    expected = MUTATIONS[name](gm)
    gm.graph.lint()
    with pytest.raises(VerificationError, match=expected):
        verify_updates(gm, record.schedule)


# -- refusals and the loop contract --------------------------------------------------------------


def test_unsupported_optimizer_names_the_supported_ones(fake_world) -> None:
    fake_world(4)
    model = MLP(width=8, depth=2)
    with pytest.raises(TypeError, match=r"torch\.optim\.SGD, torch\.optim\.Adam, torch\.optim\.AdamW.*RMSprop"):
        graphddp.compile(model, optimizer=torch.optim.RMSprop(model.parameters()))


@pytest.mark.parametrize("make, match", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, differentiable=True), "differentiable=True"),
    (lambda m: torch.optim.SGD(list(m.parameters()) + [nn.Parameter(torch.ones(3))], lr=0.1), "not a parameter of the module"),
])
def test_bad_optimizer_is_refused_before_anything_runs(fake_world, make, match) -> None:
    fake_world(4)
    model = MLP(width=8, depth=2)
    opt = make(model)
    with pytest.raises(ValueError, match=match):
        graphddp.compile(model, optimizer=opt)
    assert "step" not in vars(opt), "a refused optimizer must stay untouched"


def test_changing_a_compiled_flag_is_an_error_naming_it(fake_world) -> None:
    gd, opt, _ = _compiled(fake_world)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(RuntimeError, match=r"changed \['amsgrad'\]"):
        gd(torch.randn(8, 16)).sum().backward()


def test_step_with_a_closure_is_refused(fake_world) -> None:
    _, opt, _ = _compiled(fake_world)
    assert opt.step() is None and opt.zero_grad() is None  # no-ops
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_changes_take_effect_without_recompiling(fake_world, scheduler_first: bool) -> None:
    fake_world(4)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0) if scheduler_first else None
    gd = graphddp.compile(model, optimizer=opt, backend="aot_eager")
    sched = sched or torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler sees opt.step() called: no warning
        before = [p.detach().clone() for p in gd.parameters()]
        gd(x).sum().backward()
        opt.step()
        sched.step()  # lr -> 0 from now on
        moved = [p.detach().clone() for p in gd.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, moved)), "the first step must move the parameters"
        gd(x).sum().backward()
        opt.step()
        sched.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(moved, gd.parameters())), "lr=0 must not move the parameters"
    assert len(gd.records) == 1 and gd._state.backend.graphs_compiled == 1, "an lr change must not recompile"


def test_inductor_code_updates_each_bucket_between_the_waits(fake_world) -> None:
    """In inductor's generated code (not the FX graph): bucket i's update kernel runs after
    bucket i's wait and before bucket i+1's, so it overlaps the later buckets' transfer."""
    fake_world(4)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, backend="inductor", bucket_cap_mb=0.005)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    code = record.generated_code
    lines = code[code.index("def call("):].splitlines()
    waits = [i for i, line in enumerate(lines) if "wait_tensor" in line]
    assert len(waits) == record.schedule.num_buckets >= 2
    for start, end in zip(waits, waits[1:] + [len(lines)]):
        between = lines[start + 1:end]
        assert any("update_exp_avg_" in line for line in between), (
            f"no update kernel between line {start} (a wait) and line {end}:\n" + "\n".join(lines[start:end])
        )
    assert all(p.grad is None for p in gd.parameters())


def test_two_forwards_then_one_backward_is_one_step(fake_world) -> None:
    """Two forwards of the same graph before one backward: one torch step on the summed
    gradient, after the backward (an in-graph update per forward would step twice)."""
    fake_world(4)  # the fake group's all-reduce sums one rank: every gradient is divided by 4
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, backend="aot_eager")
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    (gd(a).sum() + gd(b).sum()).backward()
    ((ref(a).sum() + ref(b).sum()) / 4).backward()
    ref_opt.step()
    assert gd.updates == {"ran twice": 2}, "each of the graph's two backwards leaves it to torch's step"
    assert all(opt.state[p]["step"].item() == 1.0 for p in gd.parameters())
    for p, q in zip(gd.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
    gd(a).sum().backward()  # and the next step is in the graph again
    assert gd.updates == {"ran twice": 2, "inside": 1}


def test_two_graphs_of_one_frame_in_one_step_fall_back_to_one_torch_step(fake_world) -> None:
    """Two batch sizes before one backward, static shapes: two graphs of one frame (a recompile)
    both run in the step and share every parameter. Which graphs share a step is known only at
    run time: each leaves its update to one torch step after the backward, with a warning, and
    the records say why. The next step, with one graph, updates inside it again."""
    fake_world(4)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, backend="aot_eager", dynamic=False)
    a, b = torch.randn(8, 16), torch.randn(6, 16)
    gd(a).sum().backward()  # graph 0 compiled, its backward too
    ((ref(a).sum()) / 4).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    with pytest.warns(UserWarning, match="another compiled graph of this step reads them"):
        (gd(a).sum() + gd(b).sum()).backward()
    ((ref(a).sum() + ref(b).sum()) / 4).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert len(gd.records) == 2 and all(r.fallbacks.get("shared") for r in gd.records), [r.fallbacks for r in gd.records]
    assert [gd._state.step.updates(i) for i in (0, 1)] == [{"inside": 1, "shared": 1}, {"shared": 1}]
    assert all(opt.state[p]["step"].item() == 2.0 for p in gd.parameters())
    for p, q in zip(gd.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
    gd(b).sum().backward()  # one graph in this step: inside it again
    assert gd._state.step.updates(1) == {"shared": 1, "inside": 1}


def test_a_backward_that_raises_does_not_stop_later_steps(fake_world) -> None:
    """The end-of-backward step is queued once per backward; one that raised drops its queue,
    and the next backward must queue it again (or fallback steps would never be taken)."""
    gd, opt, _ = _compiled(fake_world, OPTIMIZERS["sgd"])
    x = torch.randn(8, 16)
    loss = gd(x).sum()

    def boom(_grad: torch.Tensor) -> None:
        raise ValueError("boom")

    handle = gd.module[0].weight.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    handle.remove()
    before = [p.detach().clone() for p in gd.parameters()]
    in_graph = gd.updates.get("inside", 0)
    gd(x).sum().backward()
    assert gd.updates.get("inside", 0) == in_graph + 1, "the failed backward's step is over: this one is whole"
    (gd(x).sum() + gd(x).sum()).backward()  # the graph's forward ran twice: torch's step at the end of the backward
    assert gd.updates.get("ran twice", 0) >= 1, "a step whose graph ran twice updates after the backward"
    assert all(p.grad is None for p in gd.parameters()), "torch's step ran and cleared the gradients"
    assert any(not torch.equal(a, b) for a, b in zip(before, gd.parameters()))


def _beside_torch(fake_world, make: Callable[[Any], torch.optim.Optimizer], check: Callable[..., None] | None = None):
    """Three steps of an MLP at world size 1, the optimizer inside against ``make``'s own step
    on a copy, parameters compared after each; ``check(step, ours, theirs)`` with the two
    optimizers after each step. Returns the compiled model."""
    fake_world(1)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    gd = graphddp.compile(model, optimizer=opt, backend="aot_eager", bucket_cap_mb=0.005)
    for step in range(3):
        x = torch.randn(8, 16)
        gd(x).sum().backward()
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(gd.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        if check is not None:
            check(step, opt, ref_opt)
    return gd


def test_world_size_one_updates_in_the_graph_like_torch(fake_world) -> None:
    """No all-reduce to follow: each bucket's update still goes in the graph, before the output."""
    gd = _beside_torch(fake_world, OPTIMIZERS["adam_wd_amsgrad"])
    assert gd.updates == {"inside": 3} and gd.records[0].schedule.num_buckets >= 2


def test_adams_step_lives_where_torchs_own_would(fake_world) -> None:
    """``state["step"]`` as torch's ``Adam._init_group`` makes it: fused keeps it in fp32 on the
    parameter's device (here under a float64 default, where a plain group's is float64), a
    capturable group on the device too, a plain group on the host; a loaded step of another
    kind is moved where the compiled graph reads it. Training matches torch's fused AdamW."""

    def check(step: int, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer) -> None:
        for (p, ours), theirs in zip(opt.state.items(), ref_opt.state.values()):
            ours, theirs = ours["step"], theirs["step"]
            assert (ours.dtype, ours.device, float(ours)) == (theirs.dtype, theirs.device, float(theirs)) == (torch.float32, p.device, step + 1)
            if step == 1:  # a checkpoint that kept its steps in float64
                opt.state[p]["step"] = ours.to(torch.float64)

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        gd = _beside_torch(fake_world, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), check)
        assert gd.updates == {"inside": 3}
    finally:
        torch.set_default_dtype(default)
    rule = optim._group_rule(torch.optim.Adam([nn.Parameter(torch.zeros(3))], capturable=True), 0)
    on_meta = optim.adam_step(rule, torch.empty(3, device="meta"))
    assert (on_meta.device.type, on_meta.dtype) == ("meta", torch.float32)
    plain = optim._group_rule(torch.optim.Adam([nn.Parameter(torch.zeros(3))]), 0)
    assert optim.adam_step(plain, torch.empty(3, device="meta")).device.type == "cpu"
