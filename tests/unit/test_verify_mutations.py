"""Mutation tests for the verifier: corrupt rewritten backward graphs, expect a named rejection.

Each case is a rewritten backward graph with its schedule: real ones, captured from
``graphddp.compile(..., backend="aot_eager")`` under a fake process group of 4 ranks (an MLP,
two buckets of several gradients, with and without a bf16 compression hook, and gated as for
real ranks: no division in the graph, the gate's group), and hand-traced
ones from ``test_passes`` (three buckets, two dtypes, a strided gradient that is cloned; with an
fp16 hook; and with waits placed before an interior node). Each mutation breaks one thing the
rewrite could get wrong while, mostly, keeping the graph lint-clean, and names the node the
verifier must point at: the error has to mention it and mark it (``>>``) in the context it shows.
The pristine graphs must verify. The cases are built in ``mutation_cases.py``, the mutations
are in ``graph_mutations.py``.
"""
from __future__ import annotations

import pytest
from graph_mutations import MUTATIONS
from mutation_cases import ALL, COMPRESSED, fresh

from graphddp.graph.verify import VerificationError, verify


@pytest.mark.parametrize("case", ALL)
def test_pristine_graph_verifies(case):
    c = fresh(case)
    assert c.schedule.num_buckets >= 2 and len(c.biggest().slots) >= 2
    assert c.compressed() == (case in COMPRESSED)
    code = c.gm.code
    verify(c.gm, c.schedule, c.expected)
    assert c.gm.code == code  # verify only reads


@pytest.mark.parametrize(
    "mutation, case",
    [pytest.param(m, case, id=f"{m}-{case}") for m, (_, cases) in MUTATIONS.items() for case in cases],
)
def test_mutation_is_rejected_naming_the_node(mutation, case):
    c = fresh(case)
    mutate, _ = MUTATIONS[mutation]
    offender = mutate(c)
    with pytest.raises(VerificationError) as info:
        verify(c.gm, c.schedule, c.expected)
    message = str(info.value)
    assert offender in message.splitlines()[0], message
    (marked,) = [line for line in message.splitlines() if line.startswith(">>")]
    assert f"%{offender} :" in marked, message


def test_every_mutation_runs_on_a_real_graph_or_needs_a_hand_made_one():
    real = {"mlp", "mlp-bf16", "mlp-gated"}
    hand_only = {m for m, (_, cases) in MUTATIONS.items() if not real & set(cases)}
    # an interior wait_before; a carrying graph (the step after no_sync)
    assert hand_only == {"wait-after-wait-before", "carried-into-the-wrong-slot", "carry-left-out"}
    assert len(MUTATIONS) >= 8
