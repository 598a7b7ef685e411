"""sharding="full"'s buckets planned as a value (graphddp/plan/parts.py) from the facts of a
graph's collectives (graphddp/graph/part_facts.py), then lowered (graphddp/graph/part_collectives.py):
the planner's rule on plain values, and on real graphs the plan completed with where the rewrite
put each bucket by graphddp/graph/describe_parts.py, which finds a graph that is not the plan's."""
import dataclasses

import pytest
import torch
import torch.nn as nn

import graphddp
from graphddp.graph.describe_parts import describe_part_collectives
from graphddp.graph.part_collectives import lower_part_plan, place_part_collectives
from graphddp.graph.part_facts import part_facts
from graphddp.plan.parts import bucket_collectives, plan_part_buckets
from graphddp.values.part_schedule import ALL_REDUCE, GATHER, REDUCE_SCATTER, PartCap, PartCollective

KB = 1024


def _c(nbytes, name="p", dtype="float32", group="g", device="cpu", replicated=False, kind=GATHER):
    return PartCollective(kind=kind, sends=name, params=(name,), whole_bytes=nbytes, dtype=dtype, device=device, group=group,
                          replicated=replicated)


def _members(buckets):
    return [b.members for b in buckets]


def test_a_bucket_closes_once_its_bytes_reach_the_cap():
    sizes = [3 * KB, 3 * KB, 3 * KB, 1 * KB, 2 * KB, 1 * KB]
    buckets = bucket_collectives([_c(n, f"p{i}") for i, n in enumerate(sizes)], cap_bytes=4 * KB)
    # 3+3 reaches 4 KB (closed past the cap, DDP's rule); 3+1 reaches it exactly; 2+1 stays open
    assert _members(buckets) == [(0, 1), (2, 3), (4, 5)]
    assert [b.whole_bytes for b in buckets] == [6 * KB, 4 * KB, 3 * KB]
    assert [b.index for b in buckets] == [0, 1, 2] and buckets[1].params == ("p2", "p3")


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(group="other"), dict(device="cuda:0"), dict(replicated=True)])
def test_a_key_change_closes_a_bucket(change):
    facts = [_c(KB, "a"), _c(KB, "b"), _c(KB, "c", **change), _c(KB, "d", **change), _c(KB, "e")]
    buckets = bucket_collectives(facts, cap_bytes=1 << 20)
    assert _members(buckets) == [(0, 1), (2, 3), (4,)]
    if "dtype" in change:
        assert [b.dtype for b in buckets] == ["float32", "bfloat16", "float32"]


def test_reduce_scatters_and_whole_parameters_all_reduces_bucket_apart_in_the_order_they_end():
    """replicate_below_mb: a backward's sizes alternating around the threshold alternate the two
    kinds of reduce; each kind's buckets run over its own collectives, not cut at the other's."""
    kinds = [REDUCE_SCATTER, ALL_REDUCE, REDUCE_SCATTER, ALL_REDUCE, REDUCE_SCATTER, ALL_REDUCE]
    facts = [_c(KB, f"p{i}", kind=k) for i, k in enumerate(kinds)]
    buckets = bucket_collectives(facts, cap_bytes=2 * KB)
    assert [(b.kind, b.members) for b in buckets] == [(REDUCE_SCATTER, (0, 2)), (ALL_REDUCE, (1, 3)), (REDUCE_SCATTER, (4,)), (ALL_REDUCE, (5,))]
    assert [b.index for b in buckets] == [0, 1, 2, 3]


def test_no_collectives_no_buckets():
    plan = plan_part_buckets("forward", [], [], PartCap(KB, "bucket_cap_mb"))
    assert plan.buckets == () and plan.cap.nbytes == KB and plan.kind == "forward"


def test_a_collective_larger_than_the_cap_is_a_bucket_alone():
    assert _members(bucket_collectives([_c(100 * KB)], cap_bytes=KB)) == [(0,)]
    facts = [_c(KB // 2, "a"), _c(100 * KB, "huge"), _c(KB // 2, "b"), _c(100 * KB, "huge2")]
    # the huge one joins the open bucket (below the cap), which it then closes
    assert _members(bucket_collectives(facts, cap_bytes=KB)) == [(0, 1), (2, 3)]
    assert _members(bucket_collectives([_c(100 * KB, "huge"), _c(KB, "a")], cap_bytes=KB)) == [(0,), (1,)]


def test_a_tied_weights_gradients_name_it_once_per_bucket():
    facts = [_c(KB, "w", kind=REDUCE_SCATTER), _c(KB, "b", kind=REDUCE_SCATTER), _c(KB, "w", kind=REDUCE_SCATTER)]
    (bucket,) = bucket_collectives(facts, cap_bytes=1 << 20)
    assert bucket.params == ("w", "b") and bucket.whole_bytes == 3 * KB and bucket.kind == REDUCE_SCATTER


# -- on real graphs ---------------------------------------------------------------------------------


def _compiled(reshard, mesh=None):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))  # 256 KB per weight
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager", reshard_after_forward=reshard,
                            bucket_cap_mb=0.5, **({} if mesh is None else dict(device_mesh=mesh)))
    ours(torch.randn(4, 256)).sum().backward()
    return ours


@pytest.mark.parametrize("reshard", [True, False])
def test_a_compiled_graphs_planned_buckets_are_placed_in_graph_order(fake_world, reshard):
    fake_world(8)
    ours = _compiled(reshard)
    (forward, backward) = (record.schedule for record in ours._state.records)
    for graph in (forward, backward):
        assert [b.issue_at for b in graph.buckets] == sorted(b.issue_at for b in graph.buckets)
        assert all(0 <= b.issue_at < b.wait_at < graph.nodes and b.part_bytes * 8 == b.whole_bytes for b in graph.buckets)
        for kind in (GATHER, REDUCE_SCATTER):
            assert [b.index for b in graph.of(kind)] == list(range(len(graph.of(kind))))
    # in reading order w0 b0 w1 | b1 w2 b2 w3 | b3 w4 b4 w5 | b5; gradients b5 w5 b4 w4 | b3 w3 b2 w2 | b1 w1 b0 w0
    assert [b.params for b in forward.of(GATHER)] == [("0.weight", "0.bias", "1.weight"), ("1.bias", "2.weight", "2.bias", "3.weight"),
                                                      ("3.bias", "4.weight", "4.bias", "5.weight"), ("5.bias",)]
    assert len(forward.of(GATHER)) == 4 and forward.of(REDUCE_SCATTER) == ()
    assert len(backward.of(REDUCE_SCATTER)) == 3 and bool(backward.of(GATHER)) == reshard  # a resharding backward gathers again
    assert all(b.dtype == "float32" for b in forward.buckets + backward.buckets)


def test_the_hybrid_plan_keys_on_the_replicate_all_reduce(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    backward = _compiled(True, mesh).records[0].schedule
    assert len(backward.of(REDUCE_SCATTER)) == 3 and all(b.issue_at >= 0 for b in backward.buckets)


def _traced_gathers():
    """A graph of four parts gathered over the fake group, the third in another dtype."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD.group_name
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default

    def fn(a, b, c, d):
        return [wait(gather(p, 8, group)).sum() for p in (a, b, c, d)]

    parts = [torch.randn(32), torch.randn(32), torch.randn(32, dtype=torch.bfloat16), torch.randn(32)]
    return make_fx(fn, tracing_mode="fake")(*parts)


def test_facts_read_before_the_rewrite_plan_what_the_graph_then_does(fake_world):
    fake_world(8)
    gm = _traced_gathers()
    gathers, scatters = part_facts(gm.graph)
    assert [(f.params, f.whole_bytes, f.dtype) for f in gathers] == [
        (("a_1",), 1024, "float32"), (("b_1",), 1024, "float32"), (("c_1",), 512, "bfloat16"), (("d_1",), 1024, "float32"),
    ] and scatters == []
    plan = plan_part_buckets("forward", gathers, scatters, PartCap(4 * KB, "bucket_cap_mb"))
    assert _members(plan.of(GATHER)) == [(0, 1), (2,), (3,)]  # the dtype changes twice
    assert place_part_collectives(gm.graph, "forward", PartCap(4 * KB, "bucket_cap_mb")) == plan
    gm.recompile()
    described, wrong = describe_part_collectives(gm, plan, 8, {})
    assert wrong == [] and described.nodes == len(gm.graph.nodes)
    unplaced = dict(part_bytes=0, issue_at=-1, wait_at=-1, issued_after="", waited_before="")
    assert [dataclasses.replace(b, **unplaced) for b in described.buckets] == list(plan.buckets)


def test_a_graph_that_is_not_the_plan_is_found(fake_world):
    fake_world(8)
    gm = _traced_gathers()
    plan = place_part_collectives(gm.graph, "forward", PartCap(4 * KB, "bucket_cap_mb"))
    first, second, third = plan.buckets
    assert describe_part_collectives(gm, plan, 8, {"a_1": "w"})[1] == []  # the graph's inputs named as the plan's
    changed = (dataclasses.replace(first, params=("a_1",)), dataclasses.replace(second, whole_bytes=1), dataclasses.replace(third, index=3))
    wrong = describe_part_collectives(gm, dataclasses.replace(plan, buckets=changed), 8, {})[1]
    assert wrong == [
        "forward: gather 2 is in the graph, not in the plan",
        "forward: gather 0 planned as (['a_1'], 2048, 'float32'), the graph's is (['a_1', 'b_1'], 2048, 'float32')",
        "forward: gather 1 planned as (['c_1'], 1, 'bfloat16'), the graph's is (['c_1'], 512, 'bfloat16')",
        "forward: gather 3 planned, not in the graph",
    ], wrong


def test_a_plan_lowered_on_another_graph_is_refused(fake_world):
    fake_world(8)
    gm = _traced_gathers()
    plan = plan_part_buckets("forward", [_c(KB, "x")], [], PartCap(KB, "bucket_cap_mb"))
    with pytest.raises(RuntimeError, match="not the graph it was planned from"):
        lower_part_plan(gm.graph, plan)


def test_the_compiler_refuses_a_graph_that_is_not_its_plan(fake_world, monkeypatch):
    import graphddp.compiler.full as full

    fake_world(8)
    read = full.describe_part_collectives

    def misplanned(gm, plan, world_size, names):  # the graph read against a plan whose first bucket says one byte less
        first = dataclasses.replace(plan.buckets[0], whole_bytes=plan.buckets[0].whole_bytes - 1)
        return read(gm, dataclasses.replace(plan, buckets=(first, *plan.buckets[1:])), world_size, names)

    monkeypatch.setattr(full, "describe_part_collectives", misplanned)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="VerificationError: .* not the ones planned: forward: gather 0 planned"):
        _compiled(True)
