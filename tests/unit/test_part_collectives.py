"""The rewrite of ``sharding="full"``'s collectives (graphddp/graph/part_collectives.py) on the
graphs of a real compile, in one process (a fake group of 8 ranks): buckets by the cap, each
gather bucket issued one bucket ahead of its wait, each reduce-scatter bucket travelling behind
the next bucket's gradient compute, and rules P1-P6 (graphddp/graph/verify/parts.py) with
mutations that break each."""
import copy

import pytest
import torch
import torch.nn as nn

import graphddp
from graphddp.graph.capture import ancestors
from graphddp.plan.parts import PREFETCH
from graphddp.graph.reshard import kept_gathered_bytes
from graphddp.graph.verify import check_part_collectives, check_part_updates
from graphddp.graph.verify_common import VerificationError
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_collective, is_wait

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def _compiled(reshard: bool = True, cap_mb: float = 0.5) -> dict:
    """The forward, the backward and its variant that updates the parts (``"backward_update"``)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))  # 256 KB per weight
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager", reshard_after_forward=reshard,
                            bucket_cap_mb=cap_mb)
    ours(torch.randn(4, 256)).sum().backward()
    return dict(ours.graphs)


def _graphs(reshard: bool = True, cap_mb: float = 0.5) -> tuple:
    graphs = _compiled(reshard, cap_mb)
    return graphs["forward"], graphs["backward"]


def _by_role(gm, role):
    return [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == role and n.target in (GATHER, REDUCE_SCATTER)]


def _waits(issues):
    return [next(u for u in n.users if is_wait(u)) for n in issues]


def test_gathers_are_bucketed_by_the_cap_and_issued_prefetch_buckets_ahead(fake_world):
    fake_world(8)
    forward, _ = _graphs()
    gathers = _by_role(forward, "gather")
    # in reading order w0 b0 w1 | b1 w2 b2 w3 | b3 w4 b4 w5 | b5 (weights 256 KB, biases 1 KB): a
    # bucket closes once it reaches 0.5 MB
    assert len(gathers) == 4 and PREFETCH < len(gathers)
    # issued in bucket order (a backend runs collectives in their issue order: bucket 0 first)
    assert [g.meta[BUCKET_KEY] for g in gathers] == list(range(len(gathers)))
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    waits = _waits(gathers)
    for i in range(PREFETCH, len(gathers)):
        assert order[gathers[i]] < order[waits[i - PREFETCH]], f"bucket {i} is issued after bucket {i - PREFETCH}'s wait"
    ahead = PREFETCH + 1
    assert all(order[gathers[i]] > order[waits[i - ahead]] for i in range(ahead, len(gathers))), f"more than {PREFETCH} ahead"
    assert all(order[g] < order[waits[0]] for g in gathers[:ahead]), "the first buckets are not all in flight at the first wait"


def test_reduce_scatters_are_bucketed_and_travel_behind_later_gradients(fake_world):
    fake_world(8)
    _, backward = _graphs()
    scatters = _by_role(backward, "reduce_scatter")
    # in gradient order b5 w5 b4 w4 | b3 w3 b2 w2 | b1 w1 b0 w0 (each bucket's gradients whole)
    assert len(scatters) == 3
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    waits = _waits(scatters)
    nodes = list(backward.graph.nodes)
    for i in range(len(scatters) - 1):
        assert order[scatters[i]] < order[waits[i]] < order[scatters[i + 1]], f"bucket {i} is not waited before the next"
        between = nodes[order[scatters[i]]:order[waits[i]]]
        assert any(n.target is torch.ops.aten.mm.default for n in between), f"bucket {i} travels behind no compute"


def test_a_bigger_cap_makes_fewer_buckets(fake_world):
    fake_world(8)
    forward, backward = _graphs(cap_mb=4)
    assert len(_by_role(forward, "gather")) == 1 and len(_by_role(backward, "reduce_scatter")) == 1


@pytest.mark.parametrize("mutation", ["no wait", "two waits"])
def test_rule_p1_fails_a_collective_not_waited_once(fake_world, mutation):
    fake_world(8)
    forward, _ = _graphs()
    check_part_collectives(forward, backward=False)  # the compiled graph passes
    broken = copy.deepcopy(forward)
    graph = broken.graph
    gather = next(n for n in graph.nodes if n.meta.get(ROLE_KEY) == "gather" and n.target is GATHER)
    wait = next(u for u in gather.users if is_wait(u))
    if mutation == "no wait":
        wait.replace_all_uses_with(gather)
        graph.erase_node(wait)
    else:
        with graph.inserting_after(wait):
            graph.call_function(wait.target, (gather,)).meta[BUCKET_KEY] = wait.meta[BUCKET_KEY]
    with pytest.raises(VerificationError, match="P1"):
        check_part_collectives(broken, backward=False)


@pytest.mark.parametrize("reshard", [True, False])
def test_rule_p2_fails_a_part_gradient_returned_unreduced(fake_world, reshard):
    fake_world(8)
    _, backward = _graphs(reshard)
    parts = [f"primals_{k}" for k in range(1, 13)]  # the six layers' weights and biases, in order
    check_part_collectives(backward, backward=True, parts=parts)  # the compiled graph passes
    broken = copy.deepcopy(backward)
    graph = broken.graph
    outs = list(graph.output_node().args[0])
    # the first bucket: the last layer's gradients, whose weight the forward keeps (or every
    # weight, without resharding): the backward gathers none of them, so only the given parts name it
    scatter = _by_role(broken, "reduce_scatter")[0]
    k = next(i for i, o in enumerate(outs) if o is not None and scatter in ancestors(o))
    with graph.inserting_before(graph.output_node()):  # this rank's share of the local gradient
        local = graph.call_function(torch.ops.aten.slice.Tensor, (scatter.args[0], 0, 0, outs[k].meta["val"].numel()))
    outs[k] = local
    graph.output_node().args = (tuple(outs),)
    with pytest.raises(VerificationError, match="P2: .* around a reduce"):
        check_part_collectives(broken, backward=True, parts=parts)


def test_rule_p3_fails_a_gradient_reduce_scattered_twice(fake_world):
    fake_world(8)
    _, backward = _graphs()
    broken = copy.deepcopy(backward)
    graph = broken.graph
    first, second = _by_role(broken, "reduce_scatter")[:2]
    received = next(u for u in first.users if is_wait(u))
    with graph.inserting_before(second):
        total = graph.call_function(torch.ops.aten.sum.default, (received,))
        again = graph.call_function(torch.ops.aten.add.Tensor, (second.args[0], total))
    second.args = (again, *second.args[1:])
    with pytest.raises(VerificationError, match="P3"):
        check_part_collectives(broken, backward=True)


def test_rule_p5_fails_a_gathered_parameter_kept_beyond_the_backwards_first_bucket(fake_world):
    fake_world(8)
    forward, backward = _graphs(reshard=True)
    # the backward reads the last layers' weights first (w5, w4: the 0.5 MB cap's worth): their
    # forward gathers are kept, the rest gathered again
    kept = kept_gathered_bytes(forward)
    assert kept == 2 * 256 * 256 * 4 and len(_by_role(backward, "gather")) > 0
    check_part_collectives(forward, backward=False, reshard=True, kept_bytes=kept)  # the compiled graph passes
    with pytest.raises(VerificationError, match="P5: .* kept for the backward instead of freed"):
        check_part_collectives(forward, backward=False, reshard=True, kept_bytes=kept - 1)
    broken = copy.deepcopy(forward)
    graph = broken.graph
    more = next(n for n in graph.nodes if n.meta.get(ROLE_KEY) == "gather_wait" and not is_wait(n))  # another parameter, gathered
    graph.output_node().args = ((*graph.output_node().args[0], more),)
    with pytest.raises(VerificationError, match="P5: .* kept for the backward instead of freed"):
        check_part_collectives(broken, backward=False, reshard=True, kept_bytes=kept)
    check_part_collectives(broken, backward=False, reshard=False)  # kept to the backward: what that option means
    # and the forward compiled to keep its gathered parameters is what P5 refuses where resharding
    kept_forward, _ = _graphs(reshard=False)
    with pytest.raises(VerificationError, match="P5"):
        check_part_collectives(kept_forward, backward=False, reshard=True, kept_bytes=kept)


def _updating(reshard: bool = True) -> tuple:
    """The updating variant, and its updated parts (output index -> a name) read off the plain backward."""
    graphs = _compiled(reshard)
    outs = graphs["backward"].graph.output_node().args[0]
    return graphs["backward_update"], {i: f"part {i}" for i in range(len(outs)) if outs[i] is not None}


@pytest.mark.parametrize("reshard", [True, False])
def test_rule_p4_passes_the_updates_the_compiler_made(fake_world, reshard):
    fake_world(8)
    variant, updated = _updating(reshard)
    assert len(updated) == 12  # 6 weights and biases; the input has no gradient
    check_part_updates(variant, updated)
    writes = [n for n in variant.graph.nodes if n.target is torch.ops.aten.copy_.default and n.meta.get(ROLE_KEY) == "update"]
    scatter_waits = [n for n in variant.graph.nodes if is_wait(n) and n.meta.get(ROLE_KEY) == "reduce_scatter_wait"]
    order = {n: i for i, n in enumerate(variant.graph.nodes)}
    # AdamW writes each part, its two moments and its step: the first part's write comes before the last bucket's wait
    assert len(scatter_waits) > 1 and min(order[w] for w in writes) < order[scatter_waits[-1]], "no update overlaps a later bucket"


def _update_writes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default and n.meta.get(ROLE_KEY) == "update"
            and n.args[0].op == "placeholder" and (n.args[0].name.startswith("primals_") or n.args[0].name.startswith("update_param_"))]


def _to_break(fake_world) -> tuple:
    """A copy of the updating variant to break, its graph, its first part's write, the updated parts."""
    fake_world(8)
    variant, updated = _updating()
    broken = copy.deepcopy(variant)
    return broken, broken.graph, _update_writes(broken)[0], updated


def test_rule_p4_fails_a_part_read_after_its_update(fake_world):
    broken, graph, write, updated = _to_break(fake_world)
    with graph.inserting_after(write):
        graph.call_function(torch.ops.aten.mul.Tensor, (write.args[0], 2.0))
    with pytest.raises(VerificationError, match=r"P4: .* reads its memory after .* \(P4\)"):
        check_part_updates(broken, updated)


def test_rule_p4_fails_an_update_of_the_local_gradient(fake_world):
    broken, graph, write, updated = _to_break(fake_world)
    with graph.inserting_before(write):  # the new value computed from nothing averaged: this rank's own
        local = graph.call_function(torch.ops.aten.mul.Tensor, (write.args[0], 0.5))
    write.args = (write.args[0], local)
    graph.eliminate_dead_code()
    with pytest.raises(VerificationError, match="P4: .* does not depend on a reduce's wait"):
        check_part_updates(broken, updated)


def test_one_reduce_scatter_waited_twice_becomes_one_slot_per_wait(fake_world):
    """Two parameters whose gradients are one tensor (a ResNet block's BatchNorm biases on the
    residual branch and the downsample) reach the pass, after the min-cut partitioner's
    common-subexpression elimination under inductor, as one reduce-scatter with two waits: each wait becomes a slot of the bucket."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphddp.graph.part_collectives import place_part_collectives
    from graphddp.values.part_schedule import PartCap

    fake_world(8)
    group = dist.group.WORLD.group_name

    def two_waits(g):
        sent = REDUCE_SCATTER(g * 2, "sum", 8, group)
        return torch.ops._c10d_functional.wait_tensor.default(sent), torch.ops._c10d_functional.wait_tensor.default(sent)

    gm = make_fx(two_waits, tracing_mode="fake")(torch.randn(64))
    place_part_collectives(gm.graph, "backward", PartCap(1 << 20, "bucket_cap_mb"))
    gm.graph.lint()
    scatters = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
    assert len(scatters) == 1 and len(_waits(scatters)) == 1, gm.graph
    cat = scatters[0].args[0].args[0]
    assert cat.target is torch.ops.aten.cat.default and len(cat.args[0]) == 2, f"one bucket of two gradients expected: {gm.graph}"
    outs = gm.graph.output_node().args[0]
    assert all(o.args[0] is _waits(scatters)[0] for o in outs), "each output is its slot of the bucket's wait"


def test_a_reduce_scatter_the_next_buckets_gradient_reads_is_waited_right_after_its_issue(fake_world):
    """A reduce-scatter bucket is waited before the next bucket's issue, unless that bucket's
    gradient reads its result: then its wait stays right after its own issue, and the compute
    between (here ``other``) stays after it."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphddp.graph.part_collectives import place_part_collectives
    from graphddp.values.part_schedule import PartCap

    fake_world(8)
    group = dist.group.WORLD.group_name
    wait = torch.ops._c10d_functional.wait_tensor.default

    def chained(g, x):
        first = wait(REDUCE_SCATTER(g, "sum", 8, group))
        other = x * 5
        second = wait(REDUCE_SCATTER(first.repeat(8) * 3, "sum", 8, group))
        return first, second, other

    gm = make_fx(chained, tracing_mode="fake")(torch.randn(64), torch.randn(4))
    place_part_collectives(gm.graph, "backward", PartCap(1, "bucket_cap_mb"))  # a bucket each
    gm.graph.lint()
    first = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "reduce_scatter_wait" and n.meta[BUCKET_KEY] == 0)
    assert is_wait(first) and first.prev.target is REDUCE_SCATTER, f"bucket 0 waited right after its issue: {gm.graph}"


# -- hybrid sharding (a 2-D mesh): P6 -------------------------------------------------------------


def _hybrid_backward():
    """The backward of a model compiled on a 2 x 4 mesh (2 replicate, 4 shard) of the fake group, and its placement."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager", bucket_cap_mb=0.5, device_mesh=mesh)
    ours(torch.randn(4, 256)).sum().backward()
    return dict(ours.graphs)["backward"], ours._state.record.placement


def test_hybrid_buckets_all_reduce_each_reduce_scatter_once_over_the_replicate_group(fake_world):
    from graphddp.values.comm import group_of
    from graphddp.values.placement import REPLICATE

    fake_world(8)
    backward, placement = _hybrid_backward()
    scatters = _by_role(backward, "reduce_scatter")
    replicas = [n for n in backward.graph.nodes if n.meta.get(ROLE_KEY) == REPLICATE]
    assert len(scatters) == 3 and len(replicas) == 3, (len(scatters), len(replicas))  # one per bucket, not per parameter
    assert {group_of(n) for n in scatters} == {placement.shard.name} and {group_of(n) for n in replicas} == {placement.replicate.name}
    for scatter, replica in zip(scatters, replicas):
        assert scatter.meta[BUCKET_KEY] == replica.meta[BUCKET_KEY] and _waits([scatter])[0] in ancestors(replica)


@pytest.mark.parametrize("mutation", ["gradient around the all-reduce", "all-reduce left out"])
def test_rule_p6_fails_a_part_not_averaged_over_the_replicate_group(fake_world, mutation):
    from graphddp.values.placement import REPLICATE

    fake_world(8)
    backward, placement = _hybrid_backward()
    parts = [f"primals_{k}" for k in range(1, 13)]
    check_part_collectives(backward, backward=True, parts=parts, placement=placement)  # the compiled graph passes
    broken = copy.deepcopy(backward)
    graph = broken.graph
    replica = next(n for n in graph.nodes if n.meta.get(ROLE_KEY) == REPLICATE)
    done = replica.args[0]  # the reduce-scatter's finished part
    wait = next(u for u in replica.users if is_wait(u))
    wait.replace_all_uses_with(done)  # the part as this shard group alone reduced it
    if mutation == "all-reduce left out":
        graph.erase_node(wait)
        graph.erase_node(replica)
        match = "P6: .* not once by its bucket's all-reduce"
    else:
        match = "P6: .* around the replicate all-reduce"
    broken.recompile()
    with pytest.raises(VerificationError, match=match):
        check_part_collectives(broken, backward=True, parts=parts, placement=placement)


@pytest.mark.parametrize("mutation", ["another group", "no parameter held whole", "gradient around the all-reduce"])
def test_rule_p7_fails_a_whole_parameters_all_reduce_off_every_ranks_group(fake_world, mutation):
    """replicate_below_mb: the biases (1 KB) whole, all-reduced over every rank in a bucket of their own."""
    fake_world(8)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(3)))
    ours = graphddp.compile(model, optimizer=torch.optim.AdamW(model.parameters()), sharding="full", backend="aot_eager",
                            bucket_cap_mb=0.5, replicate_below_mb=0.01)
    ours(torch.randn(4, 256)).sum().backward()
    backward = dict(ours.graphs)["backward"]
    replicated, parts = ours._state.record.replicated, [f"primals_{k}" for k in range(1, 7)]
    check_part_collectives(backward, backward=True, parts=parts, replicated=replicated)  # the compiled graph passes
    broken = copy.deepcopy(backward)
    reduce = next(n for n in broken.graph.nodes if n.meta.get(ROLE_KEY) == "all_reduce" and is_collective(n))
    if mutation == "another group":
        reduce.update_arg(len(reduce.args) - 1, "another group")
        match, replicated_as = "P7: .* not every rank's group", replicated
    elif mutation == "no parameter held whole":
        match, replicated_as = "P7: .* all-reduces a gradient, and no parameter is held whole", None
    else:
        wait = next(u for u in reduce.users if is_wait(u))
        wait.replace_all_uses_with(reduce.args[0])  # the gradient as this rank computed it
        match, replicated_as = "P2: .* (around|without) a reduce", replicated
    broken.recompile()
    with pytest.raises(VerificationError, match=match):
        check_part_collectives(broken, backward=True, parts=parts, replicated=replicated_as)
