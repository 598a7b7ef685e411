"""Communication hooks users write, and PowerSGD: planning, structure, refusals, verifier (fast).

All in one process on a fake process group; the numerics against DDP are in
``test_hooks_ranks.py``.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
import torch.nn.functional as F

import graphddp
from graphddp import models
from graphddp.graph.verify import VerificationError, verify
from graphddp.hooks import PowerSGD
from graphddp.hooks.powersgd import wire_numel
from graphddp.models import MLP
from graphddp.hooks.examples import fp16_hook, int8_hook
from graphddp.values.comm import BUCKET_KEY, is_collective, is_ours, is_wait

aten = torch.ops.aten
CAP = 0.01  # three buckets on the MLP


def _run(fake_world, comm_hook, steps: int = 1, world: int = 8, **options):
    fake_world(world)
    torch.manual_seed(0)
    model = graphddp.compile(MLP(), backend="aot_eager", comm_hook=comm_hook, bucket_cap_mb=CAP, **options)
    for _ in range(steps):
        F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    return model


def _expected(schedule):
    return {s.output_index: s.param_name for b in schedule.buckets for s in b.slots}


# -- the schedule records the hook and its bytes ----------------------------------------------


def test_a_user_hook_is_recorded_per_bucket_with_the_bytes_its_graph_sends(fake_world):
    model = _run(fake_world, (None, fp16_hook))
    (schedule,) = model.schedules
    assert schedule.num_buckets == 3
    for b in schedule.buckets:
        assert b.hook == "fp16_hook"
        assert b.wire_nbytes == b.numel * 2  # float16 on the wire, read from the graph
    table = schedule.to_table()
    assert "fp16_hook" in table and "wire MB" in table
    again = graphddp.Schedule.from_json(schedule.to_json())
    assert again == schedule and again.fingerprint() == schedule.fingerprint()
    # What every rank checks before a step: the hook and its bytes are part of it.
    assert all("fp16_hook" in b for b in map(str, schedule.wire_layout()[1]))


def test_explain_shows_the_hook_and_its_bytes_on_the_wire():
    schedules = graphddp.explain(
        MLP(), torch.randn(8, 16), world_size=64, comm_hook=PowerSGD(start_powerSGD_iter=0), bucket_cap_mb=CAP, backend="aot_eager"
    )
    (schedule,) = schedules
    hook = PowerSGD()
    assert sum(b.wire_nbytes for b in schedule.buckets) == 4 * wire_numel(hook, schedule.buckets)
    assert sum(b.wire_nbytes for b in schedule.buckets) < schedule.nbytes / 5
    assert "PowerSGD" in schedule.to_table()


def test_a_hook_with_two_stages_runs_its_first_stage_at_the_issue_point(fake_world):
    model = _run(fake_world, (None, int8_hook))
    gm = model.records[0].graph
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op == "call_function" and n.meta.get(BUCKET_KEY) is None]
    last_compute = nodes.index(compute[-1])
    for b in model.schedules[0].buckets:
        collectives = [n for n in nodes if is_collective(n) and is_ours(n, b.index)]
        assert [c.args[1] for c in collectives] == ["max", "sum"]
        scale_wait, sum_wait = (next(iter(c.users)) for c in collectives)
        if b.index < 2:  # buckets with backward compute after them
            assert nodes.index(scale_wait) < last_compute  # the small max completes early
            assert nodes.index(collectives[1]) < last_compute  # the sum is in flight meanwhile
        assert nodes.index(sum_wait) > last_compute  # and waited for at the end


def test_powersgd_waits_for_p_at_the_issue_point_and_keeps_q_and_the_rest_in_flight(fake_world):
    model = _run(fake_world, PowerSGD(start_powerSGD_iter=0))
    gm = model.records[0].graph
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op == "call_function" and n.meta.get(BUCKET_KEY) is None]
    last_compute = nodes.index(compute[-1])
    bucket = model.schedules[0].buckets[0]  # 2 matrices and 2 biases
    collectives = [n for n in nodes if is_collective(n) and is_ours(n, bucket.index)]
    assert len(collectives) == 3  # the biases as they are, P, Q
    early = [c for c in collectives if nodes.index(next(iter(c.users))) < last_compute]
    assert len(early) == 1  # P: Q is computed from its average
    assert all(nodes.index(c) < last_compute for c in collectives)


def test_powersgd_phases_are_variants_and_the_record_shows_the_compressed_one(fake_world):
    hook = PowerSGD(start_powerSGD_iter=2)
    model = _run(fake_world, hook, steps=3)
    assert hook.iter == 3 and hook.phase() == "powersgd"
    (record,) = model.records
    assert set(record.phases) == {"allreduce", "powersgd"}
    assert record is record.phases["powersgd"]
    assert all(b.hook is None for b in record.phases["allreduce"].schedule.buckets)
    assert all(b.hook == "PowerSGD" for b in record.schedule.buckets)
    with model.no_sync():  # a local step: no hook, no count (as DDP's hook is not called)
        F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    assert hook.iter == 3


def test_powersgd_layout_follows_ddp_rules():
    hook = PowerSGD(matrix_approximation_rank=2, min_compression_rate=2)
    schedule = graphddp.explain(
        MLP(width=64), torch.randn(8, 16), comm_hook=PowerSGD(start_powerSGD_iter=0), bucket_cap_mb=100, backend="aot_eager"
    )[0]
    (bucket,) = schedule.buckets
    layout = hook.layout(bucket)
    shapes = {bucket.slots[i].shape for g in layout.groups for i in g.slots}
    assert shapes == {(64, 64), (64, 16), (4, 64)} - {(4, 64)}  # (4 + 64) * 2 * 2 > 4 * 64: not worth it
    assert all(len(bucket.slots[i].shape) == 1 or bucket.slots[i].shape == (4, 64) for i in layout.uncompressed)
    batched = PowerSGD(matrix_approximation_rank=2, batch_tensors_with_same_shape=True).layout(bucket)
    assert [len(g.slots) for g in batched.groups] == [2, 1]  # the two 64x64 weights stacked


# -- refusals ---------------------------------------------------------------------------------


def _eager(state, bucket):
    flat = bucket.buffer()
    dist.all_reduce(flat)
    return flat / bucket.world_size


def _future(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def _random(state, bucket):
    flat = bucket.buffer() + 1e-3 * torch.randn_like(bucket.buffer())
    return funcol.all_reduce(flat, "sum", bucket.group) / bucket.world_size


def _item(state, bucket):
    if bucket.buffer().abs().max().item() > 1:
        return bucket.buffer()
    return funcol.all_reduce(bucket.buffer(), "sum", bucket.group) / bucket.world_size


def _no_collective(state, bucket):
    return bucket.buffer() / bucket.world_size


def _wrong_shape(state, bucket):
    return funcol.all_reduce(bucket.buffer()[:1], "sum", bucket.group)


def _other_group(state, bucket):
    return funcol.all_reduce(bucket.buffer(), "sum", state) / bucket.world_size


@pytest.mark.parametrize(
    "hook, message",
    [
        (_eager, r"comm hook '_eager' on bucket 0 (calls c10d|cannot be traced)"),
        (_future, r"comm hook '_future' .*(Future|cannot be traced)"),
        (_random, r"comm hook '_random' on bucket 0 draws random numbers"),
        (_item, r"comm hook '_item' on bucket 0 cannot be traced \(it reads a tensor's value in Python"),
        (_no_collective, r"bucket 0's hook '_no_collective' issues no collective: its gradients would not be averaged"),
        (_wrong_shape, r"bucket 0: hook '_wrong_shape' returns torch.float32 \[1\], the bucket's gradients need torch.float32 \[4420\]"),
    ],
    ids=["eager-collective", "future", "random", "item", "no-collective", "wrong-shape"],
)
def test_what_a_traced_hook_may_not_do_is_refused_naming_the_hook(fake_world, hook, message):
    with pytest.raises((RuntimeError, TypeError), match=message):
        _run(fake_world, (None, hook))


def test_a_hook_on_another_group_is_refused(fake_world):
    fake_world(8)
    other = dist.new_group([0, 1])
    model = graphddp.compile(MLP(), backend="aot_eager", comm_hook=(other, _other_group), bucket_cap_mb=CAP)
    with pytest.raises(RuntimeError, match=r"comm hook '_other_group' on bucket 0 runs .*all_reduce.* on group .*; use bucket.group"):
        F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()


def test_a_bare_function_is_told_to_come_as_state_and_hook(fake_world):
    fake_world(2)
    with pytest.raises(TypeError, match=r"comm_hook: pass a hook as \(state, hook\).*comm_hook=\(None, fp16_hook\)"):
        graphddp.compile(MLP(), comm_hook=fp16_hook)
    with pytest.raises(ValueError, match="comm_hook must be None, one of"):
        graphddp.compile(MLP(), comm_hook="powersgd")


@pytest.mark.parametrize("settings, message", [
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an int >= 1"),
    (dict(start_powerSGD_iter=-1), "start_powerSGD_iter must be an int >= 0"),
    (dict(min_compression_rate=-1), "min_compression_rate must be >= 0"),
])
def test_powersgd_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        PowerSGD(**settings)


def test_a_state_tensor_is_declared_once_per_bucket(fake_world):
    def twice(state, bucket):
        bucket.state_tensor("e", [1])
        bucket.state_tensor("e", [1])
        return funcol.all_reduce(bucket.buffer(), "sum", bucket.group)

    with pytest.raises(RuntimeError, match=r"comm hook 'twice' on bucket 0 cannot be traced.*state_tensor\('e'\) declared twice"):
        _run(fake_world, (None, twice))


# -- check 12 of the verifier, each invariant broken once ----------------------------------------


@pytest.fixture
def hooked(fake_world):
    model = _run(fake_world, (None, int8_hook))
    record = model.records[0]
    return record.graph, record.schedule


def _copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    gm = copy.deepcopy(gm)
    return gm, {n.name: n for n in gm.graph.nodes}


def _ours(gm, bucket, pred):
    return [n for n in gm.graph.nodes if is_ours(n, bucket) and pred(n)]


def test_verify_accepts_the_rewritten_hook_graph(hooked):
    gm, schedule = hooked
    verify(gm, schedule, _expected(schedule))


def test_verify_rejects_a_hook_collective_on_another_group(hooked):
    gm, schedule = hooked
    gm, _ = _copy(gm)
    c = _ours(gm, 1, is_collective)[1]
    c.args = (*c.args[:2], "other")
    with pytest.raises(VerificationError, match=r"bucket 1's hook: all_reduce_\d+ runs on group 'other'"):
        verify(gm, schedule, _expected(schedule))


def test_verify_rejects_a_hook_wait_on_another_buckets_collective(hooked):
    gm, schedule = hooked
    gm, _ = _copy(gm)
    other = _ours(gm, 0, is_collective)[0]
    wait = _ours(gm, 1, is_wait)[0]
    with gm.graph.inserting_after(other):
        stray = gm.graph.call_function(wait.target, (other,))  # a second wait tagged bucket 1, on bucket 0's collective
    stray.meta.update(wait.meta)
    with pytest.raises(VerificationError, match=rf"wait {stray.name} of bucket 1 waits on {other.name}, which is not bucket 1's collective"):
        verify(gm, schedule, _expected(schedule))


def test_verify_rejects_a_hook_wait_not_tagged_its_bucket(hooked):
    gm, schedule = hooked
    gm, _ = _copy(gm)
    wait = _ours(gm, 1, is_wait)[0]
    del wait.meta["graphddp_bucket"]  # the wait's tag is how the passes after the rewrite find it
    with pytest.raises(VerificationError, match=rf"bucket 1's hook: wait {wait.name} of \w+ is not tagged bucket 1 \(rule 12\)"):
        verify(gm, schedule, _expected(schedule))


def test_verify_rejects_recorded_bytes_that_the_graph_does_not_send(hooked):
    gm, schedule = hooked
    wrong = dataclasses.replace(schedule.buckets[0], hook_wire_nbytes=schedule.buckets[0].wire_nbytes * 2)
    broken = dataclasses.replace(schedule, buckets=(wrong, *schedule.buckets[1:]))
    with pytest.raises(VerificationError, match=r"bucket 0's collectives send \d+ bytes, the schedule records"):
        verify(gm, broken, _expected(broken))


def test_verify_rejects_a_gradient_sliced_from_before_the_wait(hooked):
    gm, schedule = hooked
    gm, _ = _copy(gm)
    flat = _ours(gm, 2, lambda n: n.meta.get("graphddp_role") == "flatten")[-1]
    piece = _ours(gm, 2, lambda n: n.target == aten.slice.Tensor)[0]
    piece.args = (flat, *piece.args[1:])
    with pytest.raises(VerificationError, match=r"which does not depend on a wait of bucket 2: it is not averaged"):
        verify(gm, schedule, _expected(schedule))


def test_verify_rejects_a_wait_after_its_wait_point(hooked):
    gm, schedule = hooked
    gm, _ = _copy(gm)
    wait = _ours(gm, 0, is_wait)[-1]
    first_user = min(wait.users, key=list(gm.graph.nodes).index)
    reader = gm.graph.call_function(aten.neg.default, (wait,))  # a stranger reading the average early
    first_user.prepend(reader)
    reader.meta["val"] = wait.meta["val"]
    out = gm.graph.output_node()
    out.args = ((*out.args[0], reader),)
    with pytest.raises(VerificationError, match=r"neg.* reads bucket 0's reduced values .* before output"):
        verify(gm, schedule, _expected(schedule))


def test_a_hook_on_a_parameter_tied_across_a_graph_break_is_refused(fake_world):
    """Its gradient comes from two graphs: each graph's hook would compress a part of it."""

    fake_world(2)
    model = graphddp.compile(models.BreakGPT(), backend="aot_eager", comm_hook=(None, fp16_hook))
    idx = torch.randint(0, 64, (2, 8))
    with pytest.raises(RuntimeError, match=r"comm_hook 'fp16_hook': parameters \['tok.weight'\] are read by more than one compiled graph"):
        model(idx).sum().backward()


def test_unknown_or_bare_callable_comm_hook_is_a_clear_error(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="comm_hook"):
        graphddp.compile(MLP(), comm_hook="powersgd")
    with pytest.raises(TypeError, match=r"comm_hook: pass a hook as \(state, hook\)"):
        graphddp.compile(MLP(), comm_hook=lambda bucket, group: bucket)


def test_verify_rejects_a_hook_collective_issued_before_its_issue_point(hooked):
    gm, schedule = hooked
    first = _ours(gm, 1, is_collective)[0]
    late = list(gm.graph.nodes)[-2]  # after every collective: the bucket would be issued before its issue point
    wrong = dataclasses.replace(schedule.buckets[1], issue_after=late.name)
    broken = dataclasses.replace(schedule, buckets=(schedule.buckets[0], wrong, *schedule.buckets[2:]))
    with pytest.raises(VerificationError, match=rf"bucket 1's {first.name} is issued before {late.name}, its issue_after"):
        verify(gm, broken, _expected(broken))
