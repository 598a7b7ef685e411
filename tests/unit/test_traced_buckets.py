"""Each bucket as traced functions, on test_passes' small fake-traced FX graph: the issue and wait
functions insert_collectives traces for a bucket, a node's role in them, and a comm hook's pair
of functions traced inside them (the built-in fp16 one and hooks written outside graphddp,
refused before any edit when they do not fit the schedule).

The graphs are only built and inspected, never run, so no process group is needed.
"""
from __future__ import annotations

import pytest
import torch
from test_passes import MIXED, PARAMS, all_reduces, planned, trace, waits

from graphddp.config import DDPConfig
from graphddp.graph.capture import extract_facts
from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.trace import role
from graphddp.graph.trace import trace as trace_fn
from graphddp.graph.verify import VerificationError, verify
from graphddp.hooks.builtin import CommHook
from graphddp.plan.planner import plan
from graphddp.values.comm import BUCKET_KEY, CAST, ROLE_KEY

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# a bucket is two traced functions; a hook is a pair of functions traced inside them


def fp16_schedule(gm, world_size=4):
    cfg = DDPConfig(first_bucket_cap_mb=MIXED[0], bucket_cap_mb=MIXED[1], comm_hook="fp16_compress")
    return plan(extract_facts(gm, PARAMS), cfg, world_size=world_size, group_name="g")


def bucket_nodes(gm, index):
    """(target, role) of every node made for bucket ``index``, in graph order."""
    return [(n.target, n.meta[ROLE_KEY]) for n in gm.graph.nodes if n.meta.get(BUCKET_KEY) == index]


@pytest.mark.parametrize("comm_hook", [None, "fp16_compress"])
def test_each_bucket_is_its_issue_function_then_its_wait_function_with_a_role_per_node(comm_hook):
    gm = trace()
    cfg = DDPConfig(first_bucket_cap_mb=MIXED[0], bucket_cap_mb=MIXED[1], comm_hook=comm_hook)
    schedule = plan(extract_facts(gm, PARAMS), cfg, world_size=2, group_name="0")
    insert_collectives(gm, schedule)
    (big,) = [b for b in schedule.buckets if b.param_names == ("w1", "bias", "wt")]
    compressed = comm_hook is not None
    assert bucket_nodes(gm, big.index) == [
        (aten.view.default, "flatten"),  # w1
        (aten.view.default, "flatten"),  # bias
        (aten.clone.default, "flatten"),  # wt is not contiguous
        (aten.view.default, "flatten"),
        (aten.cat.default, "flatten"),
        *[(CAST, "compress")] * compressed,
        (aten.div.Tensor, "scale"),
        (torch.ops._c10d_functional.all_reduce_.default, "all_reduce"),
        (torch.ops._c10d_functional.wait_tensor.default, "wait"),
        *[(CAST, "decompress")] * compressed,
        *[(aten.slice.Tensor, "unflatten"), (aten.view.default, "unflatten")] * 3,
    ]
    verify(gm, schedule, PARAMS)


def cast_to_fp16(flat, bucket):
    return CAST(flat, torch.float16)


def cast_back(reduced, bucket):
    return CAST(reduced, getattr(torch, bucket.dtype))


def test_a_hook_written_outside_graphddp_goes_through_the_same_path_as_the_built_in_one():
    built_in, ours = trace(), trace()
    schedule = fp16_schedule(built_in)
    insert_collectives(built_in, schedule)
    insert_collectives(ours, schedule, hook=CommHook("test_fp16", cast_to_fp16, cast_back))
    assert ours.code == built_in.code
    verify(ours, schedule, PARAMS)


def test_a_hook_is_traced_between_flatten_and_scale_and_between_wait_and_unflatten():
    def times_one(flat, bucket):
        return aten.mul.Tensor(flat, 1)

    def plus_zero(reduced, bucket):
        return aten.add.Tensor(reduced, 0)

    gm, schedule = planned(MIXED)
    insert_collectives(gm, schedule, hook=CommHook("identity", times_one, plus_zero))
    for bucket, ar, wait in zip(schedule.buckets, all_reduces(gm), waits(gm)):
        scaled = ar.args[0]
        assert scaled.target == aten.div.Tensor
        assert (scaled.args[0].target, scaled.args[0].meta[ROLE_KEY]) == (aten.mul.Tensor, "compress")
        (back,) = wait.users
        assert (back.target, back.meta[ROLE_KEY], back.args) == (aten.add.Tensor, "decompress", (wait, 0))
        assert {u.meta[ROLE_KEY] for u in back.users} == {"unflatten"}
    # The verifier knows only the built-in hooks' shape: a second scale op is refused.
    with pytest.raises(VerificationError, match=r"bucket 0 is scaled 2 times"):
        verify(gm, schedule, PARAMS)


@pytest.mark.parametrize(
    "hook, message",
    [
        (CommHook("no_cast", lambda flat, b: flat, cast_back), r"bucket 0: hook 'no_cast' sends torch.bfloat16, the schedule plans torch.float16"),
        (CommHook("no_cast_back", cast_to_fp16, lambda reduced, b: reduced),
         r"bucket 0: hook 'no_cast_back' decompresses to torch.float16 \[1\], the bucket's gradients need torch.bfloat16 \[1\]"),
    ],
    ids=["compress-dtype", "decompress-dtype"],
)
def test_a_hook_that_does_not_fit_the_schedule_is_refused_before_any_edit(hook, message):
    gm = trace()
    schedule = fp16_schedule(gm)
    code = gm.code
    with pytest.raises(RuntimeError, match=message):
        insert_collectives(gm, schedule, hook=hook)
    assert gm.code == code and not all_reduces(gm)


def test_every_traced_node_must_come_from_a_role_block():
    def untagged(flat):
        with role("flatten"):
            flat = aten.view.default(flat, [-1])
        return aten.mul.Tensor(flat, 2)

    gm = trace()
    vals = [gm.graph.output_node().args[0][2].meta["val"]]
    with pytest.raises(RuntimeError, match=r"graphddp: the test function made mul = aten.mul.Tensor outside a role\(\) block"):
        trace_fn(untagged, vals, "the test function")
