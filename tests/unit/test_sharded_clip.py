"""``max_grad_norm`` with ``sharding="optimizer"`` in one process (a fake group of 4): where the
norm's pieces go in the rewritten graph, the verifier's clipping rule (S6) with one mutation
each, and the graph without clipping holding no coefficient. The numbers against DDP +
``clip_grad_norm_`` are checked on gloo ranks (tests/ranks/test_clip_ranks.py)."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.fx as fx

import graphddp
from graphddp.graph.verify import VerificationError
from graphddp.models import MLP
from graphddp.optim.clip import CLIP, CLIP_COEFFICIENT, CLIP_NORM
from graphddp.optim.verify import verify_sharded
from graphddp.values.collectives import kind
from graphddp.values.schedule import Schedule
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_collective, is_wait

aten = torch.ops.aten
RS, AG, AR = kind("reduce_scatter").op, kind("all_gather").op, kind("all_reduce").op


def _compiled(fake_world, held_from: int = 0, max_grad_norm: float | None = 0.05, grad_norm_type: float = 2.0):
    """An MLP whose optimizer holds its parameters from ``held_from`` on (2: all but the first
    layer's, which then have a bucket of their own, all-reduced and returned)."""
    fake_world(4)
    torch.manual_seed(0)
    model = MLP(width=32, depth=4)
    opt = torch.optim.AdamW(list(model.parameters())[held_from:], lr=1e-2)
    gd = graphddp.compile(
        model, optimizer=opt, sharding="optimizer", max_grad_norm=max_grad_norm, grad_norm_type=grad_norm_type,
        backend="aot_eager", bucket_cap_mb=0.005,
    )
    gd(torch.randn(8, 16)).sum().backward()
    (record,) = gd.records
    return record


def _coefficient(gm: fx.GraphModule) -> fx.Node:
    (coef,) = [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == CLIP_COEFFICIENT]
    return coef


def _issued(gm: fx.GraphModule, op, bucket: int) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is op and n.meta.get(BUCKET_KEY) == bucket and n.meta.get(ROLE_KEY) != CLIP)


def test_parts_are_normed_as_they_arrive_and_updated_after_one_all_reduce_of_their_squares(fake_world):
    record = _compiled(fake_world)
    gm, buckets = record.graph, record.schedule.buckets
    assert record.schedule.max_grad_norm == 0.05
    assert len(buckets) > 1 and all(b.collective == "reduce_scatter" for b in buckets)
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    coef = _coefficient(gm)
    (summed,) = [n for n in nodes if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    assert summed.target is AR and at[summed] < at[coef]
    for b in buckets:
        scatter, gather = _issued(gm, RS, b.index), _issued(gm, AG, b.index)
        (wait,) = [u for u in scatter.users if is_wait(u)]
        squares = [n for n in nodes if n.meta.get(BUCKET_KEY) == b.index and n.meta.get(ROLE_KEY) == CLIP_NORM]
        assert squares and all(at[wait] < at[n] < at[summed] for n in squares), f"bucket {b.index}: its squares not between its wait and the all-reduce"
        assert at[coef] < at[gather], f"bucket {b.index}: all-gathered before the coefficient"
    # The reduce-scatters stay spread through the backward: the first is issued before the
    # last bucket's gradients are computed, not at the end with the updates.
    first, last = _issued(gm, RS, buckets[0].index), _issued(gm, RS, buckets[-1].index)
    assert any(n.target is aten.mm.default for n in nodes[at[first]:at[last]])
    verify_sharded(gm, record.schedule)
    # The schedule says so (not the unclipped placement, each all-gather after the next reduce-scatter).
    table = record.schedule.to_table()
    assert "one all-reduce of those sums gives the norm" in table and "issued after the next bucket's reduce-scatter" not in table


def test_gradients_the_optimizer_does_not_hold_are_in_the_norm_once_and_returned_clipped(fake_world):
    record = _compiled(fake_world, held_from=2)
    gm = record.graph
    returned = [b for b in record.schedule.buckets if b.collective == "all_reduce"]
    assert [b.param_names for b in returned] == [("0.bias", "0.weight")]
    coef = _coefficient(gm)
    outs = list(gm.graph.output_node().args[0])
    for s in returned[0].slots:
        assert coef in outs[s.output_index].all_input_nodes, f"{s.param_name}: returned without the coefficient"
    verify_sharded(gm, record.schedule)


def test_without_clipping_no_coefficient_and_no_all_reduce(fake_world):
    gm = _compiled(fake_world, max_grad_norm=None).graph
    assert not [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) in (CLIP, CLIP_NORM, CLIP_COEFFICIENT)]
    assert AR not in {n.target for n in gm.graph.nodes}


def _mutate_local_norm(gm: fx.GraphModule) -> str:
    """This rank's squares alone: the all-reduce's wait replaced by its input."""
    (summed,) = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    (wait,) = summed.users
    wait.replace_all_uses_with(summed.args[0])
    gm.graph.erase_node(wait)
    gm.graph.erase_node(summed)
    return "reads 0 all-reduces of the parts' norms"


def _mutate_unclipped_part(gm: fx.GraphModule) -> str:
    """Bucket 0's part updated from the average as it came, not times the coefficient."""
    scaled = next(n for n in gm.graph.nodes if n.meta.get(BUCKET_KEY) == 0 and n.meta.get(ROLE_KEY) == CLIP and n.target is aten.mul.Tensor)
    scaled.replace_all_uses_with(scaled.args[0])
    gm.graph.erase_node(scaled)
    return "sharded bucket 0: its parts are updated without the clip coefficient"


def _mutate_norm_misses_a_bucket(gm: fx.GraphModule) -> str:
    """Bucket 0's squares replaced by zeros: the norm no longer reads its reduce-scatter."""
    (summed,) = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    stacked = [a for a in summed.args[0].all_input_nodes if a.meta.get(BUCKET_KEY) == 0]
    for node in stacked:
        val = node.meta["val"]
        with gm.graph.inserting_after(node):
            zeros = gm.graph.call_function(aten.zeros.default, (list(val.shape),), {"dtype": val.dtype})
        zeros.meta["val"] = val
        summed.args[0].replace_input_with(node, zeros)
    return "sharded bucket 0: the all-reduce of the parts' norms does not read its reduce-scatter's wait"


def _mutate_returned_unclipped(gm: fx.GraphModule) -> str:
    output = gm.graph.output_node()
    outs = list(output.args[0])
    i = next(i for i, o in enumerate(outs) if isinstance(o, fx.Node) and o.meta.get(ROLE_KEY) == CLIP)
    outs[i] = outs[i].args[0]
    output.args = (tuple(outs),)
    return "is returned unclipped \\(S6\\)"


def _mutate_reduction(gm: fx.GraphModule) -> str:
    """The parts' shares combined by the other reduction (MAX for L2, SUM for inf)."""
    (summed,) = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    summed.args = (summed.args[0], "max" if summed.args[1] == "sum" else "sum", *summed.args[2:])
    return "reduces by .*, expected"


MUTATIONS = {
    "the norm of this rank's parts alone": (_mutate_local_norm, 0),
    "the parts' norms combined by MAX": (_mutate_reduction, 0),
    "a part updated unclipped": (_mutate_unclipped_part, 0),
    "the norm misses a bucket": (_mutate_norm_misses_a_bucket, 0),
    "a returned gradient unclipped": (_mutate_returned_unclipped, 2),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verify_sharded_rejects_broken_clipping(fake_world, name: str) -> None:
    mutate, held_from = MUTATIONS[name]
    record = _compiled(fake_world, held_from=held_from, grad_norm_type=2.0)
    verify_sharded(record.graph, record.schedule)  # pristine
    gm = copy.deepcopy(record.graph)
    expected = mutate(gm)
    gm.graph.lint()
    with pytest.raises(VerificationError, match=expected):
        verify_sharded(gm, record.schedule)


@pytest.mark.parametrize("norm_type, op", [(1.0, "sum"), (3.0, "sum"), (float("inf"), "max")])
def test_other_norms_combine_the_parts_by_their_own_reduction(fake_world, norm_type: float, op: str) -> None:
    """A p-norm's parts add up as sums of |g|^p; the inf-norm's as a maximum, which a SUM would
    overstate by up to the world size (the verifier holds the reduction to the norm's)."""
    record = _compiled(fake_world, held_from=2, grad_norm_type=norm_type)
    gm = record.graph
    assert record.schedule.grad_norm_type == norm_type
    (summed,) = [n for n in gm.graph.nodes if is_collective(n) and n.meta.get(ROLE_KEY) == CLIP]
    assert summed.target is AR and summed.args[1] == op
    verify_sharded(gm, record.schedule)
    assert f"global L{norm_type:g} norm of 0.05" in record.schedule.to_table()
    data = json.loads(json.dumps(record.schedule.to_dict(), allow_nan=False))  # "inf" as a string: JSON has no infinity
    assert Schedule.from_dict(data) == record.schedule
    assert dataclasses.replace(record.schedule, grad_norm_type=2.0).fingerprint() != record.schedule.fingerprint()
    broken = copy.deepcopy(gm)
    _mutate_reduction(broken)
    with pytest.raises(VerificationError, match="reduces by"):
        verify_sharded(broken, record.schedule)
