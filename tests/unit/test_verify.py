"""verify on test_passes' small fake-traced FX graphs: rewrites broken by hand (an unreduced or
swapped gradient, a missing wait, a buffer read in flight, a gradient from the wrong bucket) and
schedules that do not describe the graph, each rejected with its message; FX lint runs last,
and collectives the model issues itself are left alone. The mutation tests
(``test_verify_mutations.py``) break real rewritten graphs in many more ways.

The graphs are only built and inspected, never run, so no process group is needed.
"""
from __future__ import annotations

import pytest
import torch
from test_passes import (MIXED, ONE_PER_BUCKET, ONE_PER_DTYPE, PARAMS, all_reduces, nodes_by_name, rewritten,
                         schedule_for, set_outputs, waits, with_buckets)
from torch.fx.experimental.proxy_tensor import make_fx

from graphddp.graph.capture import extract_facts, output_nodes
from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.verify import VerificationError, verify

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# verify rejects broken graphs


def test_verify_rejects_an_unreduced_gradient():
    gm, schedule, facts, _ = rewritten()
    outs = output_nodes(gm)
    (w1,) = [s for s in facts.slots if s.param_name == "w1"]
    outs[w1.output_index] = nodes_by_name(gm)[w1.producer]
    set_outputs(gm, outs)
    with pytest.raises(VerificationError, match=r"gradient of 'w1' \(output 3\) is returned unreduced"):
        verify(gm, schedule, PARAMS)


def test_verify_rejects_a_missing_wait():
    gm, schedule, _, _ = rewritten()
    wait = waits(gm)[0]
    (piece,), reduce = wait.users, wait.args[0]
    wait.replace_all_uses_with(reduce)
    gm.graph.erase_node(wait)
    with pytest.raises(VerificationError, match=rf"the all-reduce of bucket 0: {reduce.name} must have exactly one user, its wait; has \['{piece.name}'\] \(rule 1\)"):
        verify(gm, schedule, PARAMS)


def test_verify_rejects_a_second_user_of_an_all_reduce():
    gm, schedule, _, _ = rewritten()
    ar = all_reduces(gm)[1]
    with gm.graph.inserting_before(gm.graph.output_node()):
        gm.graph.call_function(aten.clone.default, (ar,))
    with pytest.raises(VerificationError, match=r"exactly one user, its wait; has \['wait_tensor.*', 'clone.*'\]"):
        verify(gm, schedule, PARAMS)


@pytest.mark.parametrize("through_a_view", [False, True], ids=["buffer", "view-of-buffer"])
def test_verify_rejects_reading_the_buffer_while_it_is_reduced(through_a_view):
    gm, schedule, _, _ = rewritten()
    reduce = all_reduces(gm)[0]
    buffer = read = reduce.args[0]
    if through_a_view:  # an alias made before the issue, read after it
        with gm.graph.inserting_before(reduce):
            read = gm.graph.call_function(aten.view.default, (buffer, [-1]))
    with gm.graph.inserting_before(waits(gm)[0]):
        gm.graph.call_function(aten.add.Tensor, (read, 1))
    with pytest.raises(VerificationError, match=rf"add_tensor reads bucket 0's buffer {buffer.name} after its all-reduce {reduce.name} was issued"):
        verify(gm, schedule, PARAMS)


def test_verify_rejects_gradients_swapped_within_a_bucket():
    gm, schedule, facts, _ = rewritten(ONE_PER_DTYPE)
    big = max(schedule.buckets, key=lambda b: len(b.slots))
    first, second = big.slots[0], big.slots[1]
    outs = output_nodes(gm)
    outs[first.output_index], outs[second.output_index] = outs[second.output_index], outs[first.output_index]
    set_outputs(gm, outs)
    piece = outs[first.output_index].args[0]
    with pytest.raises(VerificationError, match=rf"gradient of '{first.param_name}' \(output {first.output_index}\) is {piece.name}, the slice .* not its own slice"):
        verify(gm, schedule, PARAMS)


def test_verify_rejects_a_bucket_without_an_all_reduce():
    gm, coarse, facts, _ = rewritten(ONE_PER_DTYPE)
    finer = schedule_for(facts, MIXED)
    assert (coarse.num_buckets, finer.num_buckets) == (2, 3)
    with pytest.raises(VerificationError, match=r"buckets \[2\] have no all-reduce in the graph"):
        verify(gm, finer, PARAMS)


def test_verify_rejects_an_all_reduce_outside_the_schedule():
    gm, fine, facts, _ = rewritten(ONE_PER_BUCKET)
    coarse = schedule_for(facts, ONE_PER_DTYPE)
    with pytest.raises(VerificationError, match=f"all-reduce {all_reduces(gm)[2].name} is tagged bucket 2, which belongs to no schedule bucket"):
        verify(gm, coarse, PARAMS)


def test_verify_rejects_a_gradient_taken_from_the_wrong_bucket():
    gm, schedule, facts, _ = rewritten(ONE_PER_BUCKET)
    outs = output_nodes(gm)
    slot = {s.param_name: s.output_index for s in facts.slots}
    outs[slot["w1"]], outs[slot["wt"]] = outs[slot["wt"]], outs[slot["w1"]]
    set_outputs(gm, outs)
    with pytest.raises(VerificationError, match=rf"gradient of 'w1' \(output 3\) comes from bucket 4's wait {waits(gm)[4].name}, planned bucket 2"):
        verify(gm, schedule, PARAMS)


def test_verify_rejects_an_expected_gradient_in_no_bucket():
    gm, schedule, _, _ = rewritten()
    with pytest.raises(VerificationError, match=r"gradient of 'x' \(output 0\) is in no bucket"):
        verify(gm, schedule, {**PARAMS, 0: "x"})


def test_verify_rejects_a_reduced_gradient_that_is_not_expected():
    gm, schedule, _, _ = rewritten()
    expected = {i: name for i, name in PARAMS.items() if name != "bias"}
    with pytest.raises(VerificationError, match=r"outputs \[4\] are reduced but need no synchronisation"):
        verify(gm, schedule, expected)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(b1=dict(index=7)), r"verify: bucket 7 is at position 1 of the schedule$"),
        (dict(b0=dict(slots=None)), r"verify: output 2 \('w2'\) is in bucket 0 and bucket 1: it would be reduced twice$"),
        (dict(b1=dict(issue_after="nope")), r"bucket 1's issue_after 'nope' is not in the graph\n(.*\n)*>> .*%{all_reduce_1} :"),
        (dict(b2=dict(wait_before="nope")), r"bucket 2's wait_before 'nope' is not in the graph\n(.*\n)*>> .*%{wait_2} :"),
    ],
    ids=["index-not-position", "output-in-two-buckets", "unknown-issue-after", "unknown-wait-before"],
)
def test_verify_rejects_a_schedule_that_does_not_describe_the_graph(changes, message):
    gm, schedule, _, _ = rewritten(MIXED)
    if "b0" in changes:  # bucket 0 also claims bucket 1's gradient
        changes = {"b0": dict(slots=schedule.buckets[0].slots + schedule.buckets[1].slots)}
    message = message.format(all_reduce_1=all_reduces(gm)[1].name, wait_2=waits(gm)[2].name)  # the pointed-at node
    with pytest.raises(VerificationError, match=message):
        verify(gm, with_buckets(schedule, **changes), PARAMS)


def test_verify_runs_fx_lint_last():
    gm, schedule, _, _ = rewritten()
    with gm.graph.inserting_before(gm.graph.output_node()), pytest.warns(UserWarning, match="no underlying reference"):
        gm.graph.get_attr("no_such_attribute")
    with pytest.raises(VerificationError, match=r"not lint-clean: .*no_such_attribute"):
        verify(gm, schedule, PARAMS)


def test_verify_ignores_collectives_the_model_itself_issues():
    def tp_backward(x, w, tangent):  # e.g. a tensor-parallel layer all-reduces its input grad
        funcol = torch.ops._c10d_functional
        return funcol.wait_tensor(funcol.all_reduce(tangent @ w.t(), "sum", "tp")), x.t() @ tangent

    gm = make_fx(tp_backward, tracing_mode="fake")(torch.randn(8, 4), torch.randn(4, 4), torch.randn(8, 4))
    params = {1: "w"}
    schedule = schedule_for(extract_facts(gm, params), ONE_PER_DTYPE)
    insert_collectives(gm, schedule)
    verify(gm, schedule, params)
