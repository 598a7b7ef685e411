"""``gather="forward"`` in one process (a fake group of 4): the backward returns its all-gathers
un-waited, the next forward waits for each right before its bucket's parameters are first read,
the verifier rules of both (S5's forward form, F1, F2) each with a mutation, and the option's
refusals."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import graphddp
from graphddp.graph.verify import VerificationError
from graphddp.models import MLP
from graphddp.optim.insert_gather import GATHER_INPUT, verify_forward_gathers
from graphddp.optim.verify import verify_sharded
from graphddp.values.collectives import kind
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, WAIT

aten = torch.ops.aten
AG = kind("all_gather").op


def _two_steps(fake_world, world: int = 4):
    fake_world(world)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gd = graphddp.compile(model, optimizer=opt, sharding="optimizer", gather="forward", backend="aot_eager", bucket_cap_mb=0.002)
    for _ in range(2):
        gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return gd, record


def test_backward_returns_the_gathers_and_the_next_forward_waits_before_each_buckets_first_read(fake_world):
    gd, record = _two_steps(fake_world)
    buckets = record.schedule.buckets
    assert len(buckets) > 1 and all(b.collective == "reduce_scatter" and b.gather == "forward" for b in buckets)
    graph = record.graph.graph
    outs = list(graph.output_node().args[0])
    extra = outs[len(outs) - len(buckets):]
    assert [n.target for n in extra] == [AG] * len(buckets), "one un-waited all-gather per bucket, after the gradients"
    assert [n.meta[BUCKET_KEY] for n in extra] == [b.index for b in buckets]
    assert not any(n.target is aten.copy_.default and n.meta.get(ROLE_KEY) == "write" for n in graph.nodes), "no write in the backward"
    nodes = list(graph.nodes)
    gathers = [n for n in nodes if n.target is AG]
    scatters = [n for n in nodes if n.target in kind("reduce_scatter").ops]
    assert [n.meta[BUCKET_KEY] for n in gathers] == [b.index for b in reversed(buckets)], "issued in the order the forward reads"
    assert nodes.index(scatters[-1]) < nodes.index(gathers[-1]), "issued at the output: the backward's link carries reduce-scatters only"
    first_wait = next(u for u in scatters[0].users if u.target is WAIT)
    assert nodes.index(first_wait) < nodes.index(scatters[-1]), "each bucket updated one bucket after its reduce-scatter, as gather='backward'"
    held = sum(s.world * sum(s.chunks) for s in gd._state.backend.dispatches[0].variants["sync"].update.shards) * 4
    assert gd._state.step.gathers.held_bytes() == held, "the gathered buckets are held between steps"
    assert "waited for and written in the next forward" in record.schedule.to_table()

    forward = gd._state.backend.forwards[0]
    assert gd._state.step.gathers.taken == 1 and forward.slot_graph is not None
    nodes = list(forward.slot_graph.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder" and n.meta.get(ROLE_KEY) == GATHER_INPUT]
    assert [n.meta[BUCKET_KEY] for n in inputs] == [b.index for b in buckets]
    waits = {n.meta[BUCKET_KEY]: n for n in nodes if n.target is WAIT}
    first_mm = min(order[n] for n in nodes if n.target in (aten.mm.default, aten.addmm.default))
    # The MLP's first layer is the last bucket: waited for before any compute; the first bucket
    # (the last layers) only after the first matmul ran.
    assert order[waits[buckets[-1].index]] < first_mm < order[waits[buckets[0].index]]


def test_both_graphs_are_compiled_in_graphddps_order(fake_world):
    """Inductor's comm and locality passes would undo the placement: on the benchmark's MLP they
    pulled every wait of the forward up to its first node (a forward that waited for the whole
    all-gather before computing: 238 ms against 106) and sank the backward's reduce-scatter
    waits, with the updates, to its end."""
    from graphddp.compiler.inductor import pinned_config
    from graphddp.config.inductor_settings import INDUCTOR_FX_ORDER_CONFIG, INDUCTOR_PINNED_CONFIG

    gd, record = _two_steps(fake_world)
    assert pinned_config(record.graph) is INDUCTOR_FX_ORDER_CONFIG
    assert pinned_config(gd._state.backend.forwards[0].slot_graph) is INDUCTOR_FX_ORDER_CONFIG
    plain = graphddp.compile(MLP(width=32, depth=4), backend="aot_eager", bucket_cap_mb=0.002)
    plain(torch.randn(8, 16)).sum().backward()
    assert pinned_config(plain.records[0].graph) is INDUCTOR_PINNED_CONFIG, "replicated graphs keep inductor's comm passes"


def test_gather_needs_sharding_and_names_the_option(fake_world):
    fake_world(2)
    with pytest.raises(ValueError, match="gather='forward'.*sharding='optimizer'"):
        graphddp.compile(MLP(), gather="forward")
    with pytest.raises(ValueError, match="gather must be one of"):
        graphddp.compile(MLP(), optimizer=torch.optim.SGD(MLP().parameters(), lr=0.1), sharding="optimizer", gather="later")


def _mutate_wait_in_backward(gm: fx.GraphModule) -> str:
    ag = next(n for n in gm.graph.nodes if n.target is AG)
    with gm.graph.inserting_after(ag):
        gm.graph.call_function(WAIT, (ag,))
    return "S5"


def _mutate_read_old_value(gm: fx.GraphModule) -> str:
    """A read of a parameter that no longer goes through its write: it would see the old value."""
    write = next(n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == "write" and n.target is aten.copy_.default)
    reader = next(u for u in write.users)
    reader.replace_input_with(write, write.args[0])
    return "F2"


def _mutate_write_unwaited(gm: fx.GraphModule) -> str:
    """A write from the all-gather's input itself, not from its wait."""
    wait = next(n for n in gm.graph.nodes if n.target is WAIT)
    wait.replace_all_uses_with(wait.args[0])
    return "F1"


def test_each_rule_fails_on_its_mutation(fake_world):
    gd, record = _two_steps(fake_world)
    backward = copy.deepcopy(record.graph)
    verify_sharded(backward, record.schedule)  # as made: passes
    expected = _mutate_wait_in_backward(backward)
    with pytest.raises(VerificationError, match=expected):
        verify_sharded(backward, record.schedule)
    shards = [s for s in gd._state.backend.dispatches[0].variants["sync"].update.shards]
    forward = gd._state.backend.forwards[0].slot_graph
    verify_forward_gathers(forward, shards)
    for mutate in (_mutate_read_old_value, _mutate_write_unwaited):
        mutated = copy.deepcopy(forward)
        expected = mutate(mutated)
        with pytest.raises(VerificationError, match=expected):
            verify_forward_gathers(mutated, shards)


def test_parameters_read_through_the_module_complete_the_gathers_and_zero_grad_does_not(fake_world):
    """What users read between steps through the graphddp module holds the updated values; the
    benchmark's count of what a rank holds reads the pending all-gathers before that."""
    from tools.bench.sharded import param_bytes

    gd, _ = _two_steps(fake_world)
    gathers = gd._state.step.gathers
    own = sum(p.numel() * p.element_size() for p in gd.module.parameters())
    assert gathers
    gd.zero_grad()
    assert gathers, "zero_grad() touches no value: the all-gathers stay pending"
    assert param_bytes(gd) >= 2 * own, "the pending all-gathers are held between steps"
    assert gathers
    list(gd.parameters())
    assert not gathers, "parameters() completes the pending all-gathers"
    assert param_bytes(gd) == own
