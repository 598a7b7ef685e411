"""Sharded buckets in one process (a fake group of 4): the rewritten graph, the verifier's
rules with one mutation each, the option's refusals, and how parameters are cut."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import graphddp
from graphddp.graph.capture import ancestors
from graphddp.graph.verify import VerificationError
from graphddp.models import MLP
from graphddp.optim import insert_shard
from graphddp.optim.verify import verify_sharded
from graphddp.testing import release_process_group
from graphddp.values.collectives import kind
from graphddp.values import placement
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY
from graphddp.values.shards import chunk, part

aten = torch.ops.aten
RS, AG = kind("reduce_scatter").op, kind("all_gather").op


def test_parts_cover_each_parameter_once_and_pad_less_than_a_rank_each():
    for numel in (1, 2, 3, 7, 64, 1000, 1001):
        for world in (1, 2, 3, 4, 8):
            parts = [part(numel, world, r) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), parts
            assert world * chunk(numel, world) - numel < world  # padding per parameter


def _compiled(fake_world, world: int = 4, lowered_for: str | None = None, monkeypatch=None):
    """``lowered_for="gloo"``: the graph gloo's ranks get (the fake group is not gloo)."""
    fake_world(world)
    if lowered_for is not None:
        monkeypatch.setattr(placement, "backend_of", lambda group: lowered_for)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, sharding="optimizer", backend="aot_eager", bucket_cap_mb=0.005)
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return gd, opt, model, record


def test_each_bucket_is_reduce_scattered_updated_and_all_gathered(fake_world):
    gd, opt, model, record = _compiled(fake_world)
    buckets = record.schedule.buckets
    assert len(buckets) > 1 and all(b.collective == "reduce_scatter" for b in buckets)
    nodes = list(record.graph.graph.nodes)
    for b in buckets:
        mine = [n for n in nodes if n.meta.get(BUCKET_KEY) == b.index]
        assert [n.target for n in mine if n.target in (RS, AG)] == [RS, AG]
    outs = list(record.graph.graph.output_node().args[0])
    assert all(outs[s.output_index] is None for b in buckets for s in b.slots)
    # This rank (0 of 4) holds a quarter of each parameter's state, flat.
    for p in model.parameters():
        lo, hi = part(p.numel(), 4, 0)
        assert opt.state[p]["exp_avg"].shape == (hi - lo,)
        assert p.grad is None


def _bucket_nodes(gm: fx.GraphModule, index: int) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(BUCKET_KEY) == index]


def _mutate_second_scatter(gm: fx.GraphModule) -> str:
    rs = next(n for n in _bucket_nodes(gm, 0) if n.target is RS)
    with gm.graph.inserting_after(rs):
        extra = gm.graph.call_function(RS, rs.args)
    extra.meta.update(rs.meta)
    return "expected one reduce-scatter and one all-gather"


def _mutate_gather_read_before_its_wait(gm: fx.GraphModule) -> str:
    """A write reads the all-gather's buffer itself, still on the wire, besides its wait."""
    ag = next(n for n in _bucket_nodes(gm, 0) if n.target is AG)
    write = next(n for n in _bucket_nodes(gm, 0) if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "write")
    with gm.graph.inserting_before(write):
        early = gm.graph.call_function(aten.clone.default, (ag,))
    early.meta["val"] = ag.meta["val"]
    return r"must have exactly one user, its wait.*\(S1\)"


def _mutate_gather_local_parts(gm: fx.GraphModule) -> str:
    ag = next(n for n in _bucket_nodes(gm, 0) if n.target is AG)
    rs = next(n for n in _bucket_nodes(gm, 0) if n.target is RS)
    # Gather the flat local gradient's first part instead of the updated average.
    flat = rs.args[0]
    with gm.graph.inserting_before(ag):
        local = gm.graph.call_function(aten.slice.Tensor, (flat, 0, 0, ag.args[0].meta["val"].numel()))
    local.meta["val"] = ag.args[0].meta["val"]
    ag.args = (local, *ag.args[1:])
    return "does not depend on the reduce-scatter's wait"


def _mutate_write_before_gather(gm: fx.GraphModule) -> str:
    write = next(n for n in _bucket_nodes(gm, 0) if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "write")
    # Write the parameter from its own (old) value: not from what the all-gather delivered.
    write.args = (write.args[0], write.args[0])
    return "does not depend on the all-gather's wait"


def _mutate_read_after_write(gm: fx.GraphModule) -> str:
    write = next(n for n in _bucket_nodes(gm, 0) if n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "write")
    with gm.graph.inserting_after(write):
        late = gm.graph.call_function(aten.clone.default, (write.args[0],))
    late.meta["val"] = write.args[0].meta["val"]
    return r"after .* updated it \(S5\)"


def _mutate_scatter_before_its_gradients(gm: fx.GraphModule) -> str:
    rs = next(n for n in _bucket_nodes(gm, 0) if n.target is RS)
    # A zero gradient in place of the flattened bucket: the reduce-scatter no longer reads the gradients.
    val = rs.args[0].meta["val"]
    with gm.graph.inserting_before(rs):
        zeros = gm.graph.call_function(aten.zeros.default, (list(val.shape),), {"dtype": val.dtype, "device": val.device})
    zeros.meta["val"] = val
    rs.args = (zeros, *rs.args[1:])
    return "does not follow the gradient"


MUTATIONS = {
    "S1 a second reduce-scatter": _mutate_second_scatter,
    "S1 an all-gather read before its wait": _mutate_gather_read_before_its_wait,
    "S2 reduce-scatter without its gradients": _mutate_scatter_before_its_gradients,
    "S3 all-gather of local values": _mutate_gather_local_parts,
    "S5 write not from the all-gather": _mutate_write_before_gather,
    "S5 read after the write": _mutate_read_after_write,
}


def test_on_gloo_each_bucket_is_an_all_to_all_summed_over_its_rows_and_a_row_alone_is_rejected(fake_world, monkeypatch):
    _, _, _, record = _compiled(fake_world, lowered_for="gloo", monkeypatch=monkeypatch)
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    nodes = list(record.graph.graph.nodes)
    assert RS not in {n.target for n in nodes}
    for b in record.schedule.buckets:
        # both all-to-alls: the all-gather too (two functional all-gathers in flight corrupt gloo's heap)
        issued = [n for n in _bucket_nodes(record.graph, b.index) if n.target in (a2a, AG)]
        assert [(n.target, n.meta[ROLE_KEY]) for n in issued] == [(a2a, "reduce_scatter"), (a2a, "all_gather")]
    assert AG not in {n.target for n in nodes}
    verify_sharded(record.graph, record.schedule)
    # Mutation: the update reads rank 0's row of what the all-to-all received, not the sum of the rows.
    gm = copy.deepcopy(record.graph)
    total = next(n for n in _bucket_nodes(gm, 0) if n.target is aten.sum.dim_IntList)
    with gm.graph.inserting_after(total):
        row = gm.graph.call_function(aten.select.int, (total.args[0], 0, 0))
    row.meta.update(total.meta)
    total.replace_all_uses_with(row, delete_user_cb=lambda user: user is not row)
    gm.graph.erase_node(total)
    with pytest.raises(VerificationError, match="other than as their sum"):
        verify_sharded(gm, record.schedule)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verify_sharded_rejects(fake_world, name: str) -> None:
    _, _, _, record = _compiled(fake_world)
    verify_sharded(record.graph, record.schedule)  # pristine
    gm = copy.deepcopy(record.graph)
    expected = MUTATIONS[name](gm)
    with pytest.raises(VerificationError, match=expected):
        verify_sharded(gm, record.schedule)


def test_a_step_after_no_sync_carries_the_accumulated_gradients_into_each_reduce_scatter(fake_world):
    """The carrying variant (nanoGPT's micro-steps): each sharded bucket's accumulated gradients
    are added to its new ones before the reduce-scatter, and the part updated in the graph."""
    _, _, _, record = _compiled(fake_world)
    carrying = record.carrying
    assert carrying is not None, "a sharded graph has a carrying variant"
    gm, buckets = carrying.graph, carrying.schedule.buckets
    assert all(b.collective == "reduce_scatter" for b in buckets)
    carried = insert_shard.carried_inputs(gm.graph)
    assert [len(carried[b.index]) for b in buckets] == [len(b.slots) for b in buckets]
    for b in buckets:
        scatter = next(n for n in _bucket_nodes(gm, b.index) if n.target is RS)
        before = ancestors(scatter)
        for node in carried[b.index]:
            (add,) = node.users
            assert add.meta[ROLE_KEY] == "carry" and add in before, f"bucket {b.index}: {node.name} not in its reduce-scatter"
    verify_sharded(gm, carrying.schedule)
    # Mutation: one accumulated gradient left out (its add replaced by the new gradient alone).
    gm = copy.deepcopy(gm)
    node = insert_shard.carried_inputs(gm.graph)[buckets[0].index][0]
    (add,) = node.users
    add.replace_all_uses_with(add.args[0])
    gm.graph.erase_node(add)
    with pytest.raises(VerificationError, match="the carried gradient .* not once by an add its reduce-scatter reads"):
        verify_sharded(gm, carrying.schedule)


def test_sharding_needs_an_optimizer_and_names_the_option(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="sharding='optimizer' shards the optimizer's state, so it needs optimizer="):
        graphddp.compile(MLP(), sharding="optimizer")
    model = MLP()
    with pytest.raises(ValueError, match="sharding must be one of"):
        graphddp.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sharding="zero3")


def test_the_schedule_shows_the_collective_of_each_bucket(fake_world):
    _, _, _, record = _compiled(fake_world)
    assert all(b["collective"] == "reduce_scatter" for b in record.schedule.to_dict()["buckets"])
    assert "reduce_scatter" in record.schedule.to_table()


def test_explain_plans_sharded_buckets_for_64_ranks():
    (schedule,) = graphddp.explain(MLP(width=32, depth=4), torch.randn(8, 16), world_size=64, backend="aot_eager",
                                   bucket_cap_mb=0.005, sharding="optimizer")
    assert schedule.world_size == 64 and len(schedule.buckets) > 1
    assert all(b.collective == "reduce_scatter" for b in schedule.buckets)


def _with_values(fn, *args: torch.Tensor) -> fx.GraphModule:
    """``fn`` traced, each node's value (``meta["val"]``) from a run on ``args``."""
    gm = fx.symbolic_trace(fn)

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node):
            n.meta["val"] = super().run_node(n)
            return n.meta["val"]

    Record(gm).run(*args)
    return gm


def test_a_bucket_is_written_early_only_where_nothing_after_reads_its_old_values():
    """The write of bucket 0 goes at bucket 1's update point, unless a later node still reads
    the parameter's memory (through a view too): then at the output, after every read."""

    def late_read(p, q):
        a, b = p + 1, q * 2
        return a, b, p.t().sum()

    def no_late_read(p, q):
        a, b = p + 1, q * 2
        return a, b, q.sum()

    for fn, early in ((late_read, False), (no_late_read, True)):
        gm = _with_values(fn, torch.randn(3, 4), torch.randn(3, 4))
        nodes = {n.name: n for n in gm.graph.nodes}
        output = gm.graph.output_node()
        point = insert_shard._write_point([nodes["add"], nodes["mul"]], 0, [nodes["p"]], output)
        assert point is (nodes["mul"] if early else output), fn.__name__
    assert insert_shard._write_point([nodes["add"]], 0, [nodes["p"]], output) is output, "the last bucket: at the output"


def test_the_update_writes_a_private_copy_where_old_values_are_read_after_it(fake_world):
    """gather="forward": the parameters keep their values until the next forward, so each part
    is updated in memory of its own (an empty tensor and a copy, which inductor cannot fold into
    the parameter as it folds a clone). gather="backward" on this MLP: nothing reads a parameter
    after its update, so a clone, which inductor may fold (no copy made)."""
    empty = torch.ops.aten.empty.memory_format
    for gather, private in (("forward", True), ("backward", False)):
        fake_world(4)
        model = MLP(width=32, depth=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gd = graphddp.compile(model, optimizer=opt, sharding="optimizer", gather=gather, backend="aot_eager", bucket_cap_mb=0.005)
        gd(torch.randn(8, 16)).sum().backward()
        (record,) = gd.records
        for b in record.schedule.buckets:
            mine = [n for n in record.graph.graph.nodes if n.meta.get(BUCKET_KEY) == b.index and n.meta.get(ROLE_KEY) == "update"]
            assert sum(n.target is empty for n in mine) == (len(b.slots) if private else 0), (gather, b.index)
        release_process_group()


def test_each_gradient_is_scaled_before_its_bucket_is_concatenated(fake_world):
    """The reduce-scatter sends the concatenation of already divided columns: no elementwise
    op on the whole bucket after the cat, which inductor would give a second bucket-sized buffer."""
    _, _, _, record = _compiled(fake_world)
    rs_ops = kind("reduce_scatter").ops
    scatters = [n for n in record.graph.graph.nodes if n.target in rs_ops]
    assert scatters
    for scatter in scatters:
        sent = scatter.args[0]
        while sent.target is torch.ops.aten.view.default:
            sent = sent.args[0]
        columns = sent.args[0] if sent.target is torch.ops.aten.cat.default else [sent]
        assert all(c.target is torch.ops.aten.div.Tensor and c.meta.get(ROLE_KEY) == "scale" for c in columns), scatter.name
        for column in columns:  # each division reads one gradient's column, not a concatenation
            source = column.args[0]
            while source.target in (torch.ops.aten.view.default, torch.ops.prims.convert_element_type.default):
                source = source.args[0]
            assert source.target is not torch.ops.aten.cat.default, f"{scatter.name}: the whole bucket divided after its cat"
    assert any(n.target is torch.ops.aten.cat.default for n in record.graph.graph.nodes), "a bucket of several parameters"
