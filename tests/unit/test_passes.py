"""insert_collectives on small fake-traced FX graphs: the shape of the rewrite (one all-reduce
and one wait per bucket, gradients as views of the reduced buffer, fake values everywhere) and
the schedule it honours (issue_after, wait_before, slots, compression), refusing one that does
not fit before any edit. The traced graph and its helpers here are shared: each bucket's traced
functions and hooks are checked in ``test_traced_buckets.py``, verify on these graphs in
``test_verify.py``.

The graphs are only built and inspected, never run, so no process group is needed.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx

from graphddp.config import DDPConfig
from graphddp.graph.capture import extract_facts, is_compute, output_nodes
from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.verify import verify
from graphddp.plan.planner import plan
from graphddp.values.comm import BUCKET_KEY, CAST, ROLE_KEY, is_collective, is_wait

aten = torch.ops.aten
KIB = 1 / 1024  # in MB

# output index -> parameter; output 0 (the input gradient) needs no synchronisation
PARAMS = {1: "scale", 2: "w2", 3: "w1", 4: "bias", 5: "wt"}

# (first_bucket_cap_mb, bucket_cap_mb)
ONE_PER_BUCKET = (1e-6, 1e-6)  # every gradient closes its bucket
MIXED = (0.25 * KIB, 1 * KIB)
ONE_PER_DTYPE = (100.0, 100.0)
CAPS = pytest.mark.parametrize("caps", [ONE_PER_BUCKET, MIXED, ONE_PER_DTYPE], ids=["one-each", "mixed", "per-dtype"])


def backward(x, w1, w2, tangent):
    """A stand-in backward: 'gradients' with compute between them, in a known production order."""
    g_scale = (x * tangent).sum().to(torch.bfloat16)  # 0-d, bf16: a bucket of its own dtype
    h = x @ w1
    g_w2 = h.t() @ tangent  # [16, 4]
    gh = tangent @ w2.t()
    g_w1 = x.t() @ gh  # [4, 16]
    g_x = gh @ w1.t()  # not a parameter's gradient
    g_bias = tangent.sum(0)  # [4]
    g_wt = (gh.t() @ x).t()  # [4, 16], non-contiguous: takes the clone path
    return g_x, g_scale, g_w2, g_w1, g_bias, g_wt


def trace() -> fx.GraphModule:
    example = (torch.randn(8, 4), torch.randn(4, 16), torch.randn(16, 4), torch.randn(8, 4))
    return make_fx(backward, tracing_mode="fake")(*example)


def schedule_for(facts, caps, world_size=2):
    first, rest = caps
    cfg = DDPConfig(first_bucket_cap_mb=first, bucket_cap_mb=rest)
    return plan(facts, cfg, world_size=world_size, group_name="0")


def rewritten(caps=MIXED, params=PARAMS):
    """(rewritten graph, its schedule, facts, the original graph's nodes)."""
    gm = trace()
    facts = extract_facts(gm, params)
    schedule = schedule_for(facts, caps)
    original = list(gm.graph.nodes)
    insert_collectives(gm, schedule)
    return gm, schedule, facts, original


def nodes_by_name(gm):
    return {n.name: n for n in gm.graph.nodes}


def positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def all_reduces(gm):
    return [n for n in gm.graph.nodes if is_collective(n)]


def waits(gm):
    return [n for n in gm.graph.nodes if is_wait(n)]


def issued_after(all_reduce: fx.Node) -> fx.Node:
    """The original node an all-reduce follows, skipping the flatten/cat/div chain before it."""
    node = all_reduce.prev
    while ROLE_KEY in node.meta:
        node = node.prev
    return node


def set_outputs(gm, outs):
    gm.graph.output_node().args = (tuple(outs),)


def with_buckets(schedule, **changes_by_index):
    """The schedule with some buckets' fields replaced: ``b1=dict(wait_before="mm_3")``."""
    buckets = tuple(
        dataclasses.replace(b, **changes_by_index.get(f"b{b.index}", {})) for b in schedule.buckets
    )
    return dataclasses.replace(schedule, buckets=buckets)


def planned(caps=MIXED):
    """(fresh traced graph, its schedule), not yet rewritten."""
    gm = trace()
    return gm, schedule_for(extract_facts(gm, PARAMS), caps)


# ---------------------------------------------------------------------------------------------
# the shape of the rewrite


def test_facts_of_the_traced_graph():
    facts = extract_facts(trace(), PARAMS)
    assert [s.param_name for s in facts.slots] == ["scale", "w2", "w1", "bias", "wt"]
    assert {s.dtype for s in facts.slots} == {"float32", "bfloat16"}


@pytest.mark.parametrize(
    "caps, layout",
    [
        (ONE_PER_BUCKET, [("scale",), ("w2",), ("w1",), ("bias",), ("wt",)]),
        (MIXED, [("scale",), ("w2",), ("w1", "bias", "wt")]),
        (ONE_PER_DTYPE, [("scale",), ("w2", "w1", "bias", "wt")]),
    ],
    ids=["one-each", "mixed", "per-dtype"],
)
def test_one_all_reduce_and_one_wait_per_bucket(caps, layout):
    gm, schedule, _, _ = rewritten(caps)
    assert [b.param_names for b in schedule.buckets] == layout
    reduces, done = all_reduces(gm), waits(gm)
    assert [ar.meta[BUCKET_KEY] for ar in reduces] == list(range(len(layout)))
    assert [w.meta[BUCKET_KEY] for w in done] == list(range(len(layout)))
    assert [w.args[0] for w in done] == reduces
    assert all(ar.target == torch.ops._c10d_functional.all_reduce_.default for ar in reduces)
    assert [ar.args[1:] for ar in reduces] == [("sum", "0")] * len(layout)


@CAPS
def test_each_all_reduce_directly_follows_its_last_gradient(caps):
    gm, schedule, _, _ = rewritten(caps)
    for bucket, ar in zip(schedule.buckets, all_reduces(gm)):
        assert issued_after(ar).name == bucket.issue_after
        chain = []
        node = ar.prev
        while ROLE_KEY in node.meta:
            chain.append(node)
            node = node.prev
        assert {n.meta[ROLE_KEY] for n in chain} <= {"flatten", "scale"}
        assert {n.meta[BUCKET_KEY] for n in chain} == {bucket.index}
        scaled = ar.args[0]
        assert scaled.target == aten.div.Tensor and scaled.args[1] == 2  # pre-divide by world size
        assert (scaled.args[0].target == aten.cat.default) == (len(bucket.slots) > 1)


@CAPS
def test_all_reduces_are_issued_in_schedule_order_and_waited_after_all_compute(caps):
    gm, schedule, _, original = rewritten(caps)
    pos = positions(gm)
    last_compute = max(pos[n] for n in original if is_compute(n))
    assert [pos[ar] for ar in all_reduces(gm)] == sorted(pos[ar] for ar in all_reduces(gm))
    assert all(pos[w] > last_compute for w in waits(gm))
    # the overlap window: the planned compute nodes lie between issue and wait
    by_name = nodes_by_name(gm)
    for bucket, ar, wait in zip(schedule.buckets, all_reduces(gm), waits(gm)):
        assert all(pos[ar] < pos[by_name[name]] < pos[wait] for name in bucket.overlap)


@CAPS
def test_gradients_are_views_into_their_bucket_wait(caps):
    gm, schedule, facts, original = rewritten(caps)
    outs = output_nodes(gm)
    done = waits(gm)
    for bucket in schedule.buckets:
        for slot, offset in zip(bucket.slots, bucket.offsets()):
            view = outs[slot.output_index]
            assert view.target == aten.view.default and view.args[1] == list(slot.shape)
            piece = view.args[0]
            assert piece.target == aten.slice.Tensor
            assert piece.args == (done[bucket.index], 0, offset, offset + slot.numel)
            assert tuple(view.meta["val"].shape) == slot.shape
    assert outs[0] in original  # the input gradient is returned untouched


def test_contiguous_gradients_are_viewed_and_non_contiguous_ones_cloned_first():
    gm, schedule, facts, _ = rewritten(ONE_PER_BUCKET)
    by_name = nodes_by_name(gm)
    for slot in facts.slots:
        producer = by_name[slot.producer]
        (flat,) = [u for u in producer.users if u.meta.get(ROLE_KEY) == "flatten"]
        source = producer
        if slot.param_name == "wt":
            assert not producer.meta["val"].is_contiguous()
            assert flat.target == aten.clone.default
            assert flat.kwargs == {"memory_format": torch.contiguous_format}
            source, (flat,) = flat, flat.users
        assert flat.target == aten.view.default and flat.args == (source, [slot.numel])


@CAPS
def test_every_new_node_has_a_fake_value_and_a_bucket(caps):
    gm, schedule, _, original = rewritten(caps)
    new = [n for n in gm.graph.nodes if n not in original]
    assert new and all(isinstance(n.meta.get("val"), FakeTensor) for n in new)
    assert all(0 <= n.meta[BUCKET_KEY] < schedule.num_buckets for n in new)
    for bucket, ar in zip(schedule.buckets, all_reduces(gm)):
        val = ar.meta["val"]
        assert tuple(val.shape) == (bucket.numel,)
        assert str(val.dtype) == f"torch.{bucket.dtype}"


@CAPS
def test_rewritten_graph_verifies(caps):
    gm, schedule, _, _ = rewritten(caps)
    code = gm.code
    verify(gm, schedule, PARAMS)
    assert gm.code == code  # verify only reads


def test_empty_schedule_leaves_the_graph_unchanged():
    gm = trace()
    schedule = schedule_for(extract_facts(gm, {}), MIXED)
    assert schedule.num_buckets == 0
    before = [n.format_node() for n in gm.graph.nodes]
    code = gm.code
    insert_collectives(gm, schedule)
    assert [n.format_node() for n in gm.graph.nodes] == before
    assert gm.code == code
    verify(gm, schedule, {})


def test_gradient_that_is_a_graph_input_is_issued_after_the_placeholders():
    def bias_backward(x, tangent):
        return x.t() @ tangent, tangent  # the bias gradient *is* the incoming tangent

    gm = make_fx(bias_backward, tracing_mode="fake")(torch.randn(8, 4), torch.randn(8, 4))
    params = {0: "w", 1: "bias"}
    schedule = schedule_for(extract_facts(gm, params), ONE_PER_BUCKET)
    assert [b.issue_after for b in schedule.buckets] == ["tangent_1", "mm"]
    insert_collectives(gm, schedule)
    first = all_reduces(gm)[0]
    assert issued_after(first).name == "tangent_1"
    assert all(n.op == "placeholder" for n in gm.graph.nodes if n.name in ("x_1", "tangent_1"))
    assert [n.op for n in gm.graph.nodes][:2] == ["placeholder", "placeholder"]
    verify(gm, schedule, params)


def test_buckets_issued_at_one_node_follow_it_in_bucket_order():
    gm, schedule = planned(ONE_PER_BUCKET)
    last = schedule.buckets[-1].issue_after
    schedule = with_buckets(schedule, **{f"b{b.index}": dict(issue_after=last) for b in schedule.buckets})
    insert_collectives(gm, schedule)
    issued = all_reduces(gm)
    assert [n.meta[BUCKET_KEY] for n in issued] == list(range(len(schedule.buckets)))
    node, seen = nodes_by_name(gm)[last].next, []  # each bucket's early part whole, right after the last one's
    while ROLE_KEY in node.meta:
        seen.append(node.meta[BUCKET_KEY])
        node = node.next
    assert seen == sorted(seen) and set(seen) == set(range(len(schedule.buckets)))
    verify(gm, schedule, PARAMS)


# ---------------------------------------------------------------------------------------------
# the rewrite honours the schedule: wait_before, issue_after, slots


def test_waits_go_right_before_wait_before():
    gm, schedule = planned(MIXED)  # buckets: (scale,), (w2,), (w1, bias, wt)
    schedule = with_buckets(schedule, b0=dict(wait_before="mm_3"), b1=dict(wait_before="mm_3"))
    insert_collectives(gm, schedule)
    by_name = nodes_by_name(gm)
    before = []
    node = by_name["mm_3"].prev
    while ROLE_KEY in node.meta and node.meta[ROLE_KEY] in ("wait", "unflatten"):
        before.insert(0, node)
        node = node.prev
    assert [(n.meta[BUCKET_KEY], n.meta[ROLE_KEY]) for n in before] == [
        (0, "wait"), (0, "unflatten"), (0, "unflatten"), (1, "wait"), (1, "unflatten"), (1, "unflatten"),
    ]
    assert waits(gm)[2].next.meta[ROLE_KEY] == "unflatten"  # bucket 2 still waits before the output
    assert positions(gm)[waits(gm)[2]] > positions(gm)[by_name["t_5"]]
    verify(gm, schedule, PARAMS)


def test_wait_before_output_is_todays_rewrite():
    gm, schedule = planned(MIXED)
    explicit, _ = planned(MIXED)
    assert {b.wait_before for b in schedule.buckets} == {"output"}
    insert_collectives(gm, schedule)
    insert_collectives(explicit, with_buckets(schedule, b0=dict(wait_before="output")))
    assert gm.code == explicit.code
    assert all(w.next.meta.get(ROLE_KEY) in ("unflatten", None) for w in waits(gm))
    assert gm.graph.output_node().prev.meta[ROLE_KEY] == "unflatten"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(b1=dict(wait_before="nope")), r"bucket 1: wait_before names node 'nope', which is not in the graph"),
        (dict(b1=dict(issue_after="nope")), r"bucket 1: issue_after names node 'nope', which is not in the graph"),
        (dict(b1=dict(wait_before="mm")), r"bucket 1: wait_before mm is not after the issue point mm_1"),
        (dict(b1=dict(wait_before="mm_1")), r"bucket 1: wait_before mm_1 is not after the issue point mm_1"),
        (dict(b0=dict(wait_before="x_1")), r"bucket 0: wait_before x_1 is not after the issue point _to_copy"),
        (dict(b2=dict(issue_after="mm_3")), r"bucket 2, gradient of 'bias' \(output 4\): issued after mm_3, before its producer sum_2"),
        (dict(b1=dict(index=7)), r"bucket 7 is at position 1 of the schedule"),
    ],
    ids=["unknown-wait-before", "unknown-issue-after", "wait-before-issue", "wait-before-is-issue", "wait-before-placeholder",
         "issue-before-producer", "index-not-position"],
)
def test_a_schedule_that_does_not_fit_is_refused_before_any_edit(changes, message):
    gm, schedule = planned(MIXED)
    code = gm.code
    with pytest.raises(RuntimeError, match=message):
        insert_collectives(gm, with_buckets(schedule, **changes))
    assert gm.code == code and not all_reduces(gm)


def test_slots_must_match_the_graph():
    gm, schedule = planned(MIXED)
    (bucket,) = [b for b in schedule.buckets if "w2" in b.param_names]
    wrong_producer = dataclasses.replace(bucket.slots[0], producer="mm_3")
    wrong_shape = dataclasses.replace(bucket.slots[0], shape=(4, 16))
    for slot, message in [
        (wrong_producer, r"gradient of 'w2' \(output 2\): the schedule says it is produced by mm_3, the graph returns mm_1"),
        (wrong_shape, r"gradient of 'w2' \(output 2\): mm_1 is \(\(16, 4\), 'float32', 'cpu'\), the schedule says \(\(4, 16\)"),
    ]:
        broken = with_buckets(schedule, **{f"b{bucket.index}": dict(slots=(slot,))})
        with pytest.raises(RuntimeError, match=message):
            insert_collectives(gm, broken)
    twice = with_buckets(schedule, b0=dict(slots=schedule.buckets[0].slots + bucket.slots))
    with pytest.raises(RuntimeError, match=r"output 2 \('w2'\) is in bucket 0 and bucket 1"):
        insert_collectives(gm, twice)


def test_compressed_bucket_is_cast_down_before_the_divide_and_back_after_the_wait():
    gm = trace()
    cfg = DDPConfig(first_bucket_cap_mb=MIXED[0], bucket_cap_mb=MIXED[1], comm_hook="fp16_compress")
    schedule = plan(extract_facts(gm, PARAMS), cfg, world_size=4, group_name="g")
    assert {b.comm_dtype for b in schedule.buckets} == {"float16"}
    insert_collectives(gm, schedule)
    for bucket, ar, wait in zip(schedule.buckets, all_reduces(gm), waits(gm)):
        scaled = ar.args[0]
        assert scaled.target == aten.div.Tensor and scaled.args[1] == 4
        assert scaled.args[0].target == CAST and scaled.args[0].args[1] == torch.float16
        assert ar.args[1:] == ("sum", "g")
        (back,) = wait.users
        assert back.target == CAST and back.args[1] == getattr(torch, bucket.dtype)
    verify(gm, schedule, PARAMS)
