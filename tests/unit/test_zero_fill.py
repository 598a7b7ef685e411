"""Zero-filled slots on a hand-traced graph: a recompile that stopped a parameter's gradient
keeps its place in a hooked bucket (``GradSlot.zero_filled``); insert_collectives sends zeros
there and returns no gradient, and the verifier names a place filled with anything else.
Built and inspected only, like ``test_passes``, whose traced graph and plan this reuses.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_passes import MIXED, PARAMS, planned

from graphddp.config import DDPConfig
from graphddp.graph.capture import extract_facts, output_nodes
from graphddp.graph.insert_comm import insert_collectives
from graphddp.graph.verify import VerificationError, verify
from graphddp.plan.planner import plan
from graphddp.values.comm import BUCKET_KEY

aten = torch.ops.aten


def _zero_filled():
    """The MIXED plan made as if an earlier graph also produced 'ghost' (a [6] float32 gradient
    in w1's bucket): planned with ``like=`` and a hook, as a recompile of that graph is, then
    given the built-in hook (``hook=None``) so this pass's own checks apply."""
    gm, schedule = planned()
    facts = extract_facts(gm, PARAMS)
    w1 = next(s for b in schedule.buckets for s in b.slots if s.param_name == "w1")
    ghost = dataclasses.replace(w1, param_name="ghost", shape=(6,), numel=6, nbytes=24, output_index=99)
    like = tuple(tuple(s for s in b.slots) + ((ghost,) if w1 in b.slots else ()) for b in schedule.buckets)
    filled = plan(facts, DDPConfig(first_bucket_cap_mb=MIXED[0], bucket_cap_mb=MIXED[1]), world_size=2,
                  group_name="0", like=like, hook="h")
    filled = dataclasses.replace(filled, buckets=tuple(dataclasses.replace(b, hook=None) for b in filled.buckets))
    return gm, filled


def test_a_zero_filled_slot_is_sent_as_zeros_and_returns_no_gradient():
    gm, schedule = _zero_filled()
    (bucket,) = [b for b in schedule.buckets if "ghost" in b.param_names]
    ghost = next(s for s in bucket.slots if s.param_name == "ghost")
    assert ghost.zero_filled and ghost.output_index == -1 and schedule.structure_error() is None
    before = list(output_nodes(gm))
    insert_collectives(gm, schedule)
    zeros = [n for n in gm.graph.nodes if n.target == aten.zeros.default]
    assert len(zeros) == 1 and zeros[0].meta[BUCKET_KEY] == bucket.index and list(zeros[0].args[0]) == [6]
    outs = output_nodes(gm)
    assert len(outs) == len(before)  # no output for the ghost; the others are its bucket's views
    verify(gm, schedule, PARAMS)


def test_the_verifier_names_a_zero_filled_slot_that_is_not_its_buckets_zeros():
    gm, schedule = _zero_filled()
    insert_collectives(gm, schedule)
    (zeros,) = [n for n in gm.graph.nodes if n.target == aten.zeros.default]
    zeros.target = aten.ones.default  # the place of a parameter that took no gradient, filled with ones
    with pytest.raises(VerificationError, match=r"'ghost' is zero-filled: expected bucket \d+'s zeros"):
        verify(gm, schedule, PARAMS)
