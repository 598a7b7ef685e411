"""The pure planner, fed hand-built GraphFacts: no graphs, no process groups. The same rules
end to end, against the buckets DDP's reducer builds on ranks: ranks/test_plans_on_ranks.py."""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest
import torch

from graphddp.config import DDP_DEFAULT_CAPS, DDPConfig
from graphddp.plan.planner import plan
from graphddp.values.schedule import GradSlot, GraphFacts, NodeFact, Schedule

KIB = 1 / 1024  # in MB: caps below are given in KiB so gradient sizes stay small


def make_facts(specs, *, num_nodes=None, non_compute=()):
    """GraphFacts from ``(name, numel, dtype, position[, device])`` specs.

    Output index = index in ``specs``. Node ``n{p}`` at position ``p`` produces the gradients
    at ``p``; the graph has ``num_nodes`` nodes (default: two past the last producer) plus a
    final ``output`` node. Positions in ``non_compute`` are view-like nodes. Slots are put in
    production order, (position, output_index), as ``extract_facts`` returns them.
    """
    last = max((s[3] for s in specs), default=0)
    num_nodes = last + 3 if num_nodes is None else num_nodes
    nodes = tuple(NodeFact(f"n{p}", p, p not in non_compute) for p in range(num_nodes))
    nodes += (NodeFact("output", num_nodes, False),)
    slots = []
    for index, (name, numel, dtype, position, *device) in enumerate(specs):
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        slots.append(
            GradSlot(
                output_index=index,
                param_name=name,
                shape=(numel,),
                dtype=dtype,
                device=device[0] if device else "cpu",
                numel=numel,
                nbytes=numel * itemsize,
                producer=f"n{position}",
                position=position,
            )
        )
    slots.sort(key=lambda s: (s.position, s.output_index))
    return GraphFacts(nodes=nodes, slots=tuple(slots))


def config(first_kib=1, rest_kib=4, **kwargs):
    return DDPConfig(first_bucket_cap_mb=first_kib * KIB, bucket_cap_mb=rest_kib * KIB, **kwargs)


def names(schedule):
    """The bucket layout as nested tuples of parameter names: the shape of a schedule."""
    return [b.param_names for b in schedule.buckets]


def order_key(slot):
    return (slot.position, slot.output_index)


def buckets_by_key(schedule):
    """(dtype, device) -> that key's buckets in the order they were opened."""
    out = collections.defaultdict(list)
    for b in sorted(schedule.buckets, key=lambda b: order_key(b.slots[0])):
        out[(b.dtype, b.device)].append(b)
    return out


def random_specs(n, seed=0, dtypes=("float32",), devices=("cpu",)):
    """``n`` gradients of mixed size/dtype/device at distinct positions, shuffled output order."""
    rng = random.Random(seed)
    positions = rng.sample(range(4, 4 + 3 * n), n)  # leave non-producer nodes in between
    return [
        (f"p{i}", rng.choice([1, 16, 100, 256, 300, 700, 1024, 2000]), rng.choice(dtypes), pos, rng.choice(devices))
        for i, pos in enumerate(positions)
    ]


def test_buckets_follow_production_order_not_output_order():
    # outputs listed c, a, b but produced a (pos 3), b (pos 5), c (pos 9): 256 floats = 1 KiB
    facts = make_facts([("c", 256, "float32", 9), ("a", 256, "float32", 3), ("b", 256, "float32", 5)])
    assert names(plan(facts, config(first_kib=1, rest_kib=1))) == [("a",), ("b",), ("c",)]
    assert names(plan(facts, config(first_kib=100, rest_kib=100))) == [("a", "b", "c")]


def test_production_ties_are_broken_by_output_index():
    # one node finalises two gradients (same position): lower output index first
    facts = make_facts([("x", 8, "float32", 7), ("w", 8, "float32", 4), ("y", 8, "float32", 7)])
    assert names(plan(facts, config())) == [("w", "x", "y")]


def test_bucket_order_ties_are_broken_by_output_index():
    # two buckets (different dtypes) become ready at the same node; 'full' closes first
    facts = make_facts([("half", 8, "float16", 5), ("full", 256, "float32", 5)])
    schedule = plan(facts, config(first_kib=1))
    assert names(schedule) == [("half",), ("full",)]
    assert [b.issue_after for b in schedule.buckets] == ["n5", "n5"]


def test_plan_does_not_depend_on_the_order_of_facts_slots():
    facts = make_facts([("a", 256, "float32", 3), ("b", 256, "float32", 5)])
    shuffled = dataclasses.replace(facts, slots=facts.slots[::-1])
    assert plan(shuffled, config(first_kib=100)) == plan(facts, config(first_kib=100))


def test_first_bucket_uses_first_cap_and_later_buckets_the_bucket_cap():
    # ten 1 KiB gradients, first cap 1 KiB, rest 3 KiB -> 1 + 3 + 3 + 3
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(10)])
    schedule = plan(facts, config(first_kib=1, rest_kib=3))
    assert [len(b.slots) for b in schedule.buckets] == [1, 3, 3, 3]


def test_bucket_closes_at_cap_and_exceeds_it_by_at_most_its_last_gradient():
    facts = make_facts(random_specs(60, seed=1))
    cfg = config(first_kib=2, rest_kib=5)
    for buckets in buckets_by_key(plan(facts, cfg)).values():
        for i, b in enumerate(buckets):
            cap = cfg.first_bucket_cap_bytes if i == 0 else cfg.bucket_cap_bytes
            before_last = b.nbytes - b.slots[-1].nbytes
            assert before_last < cap, f"bucket {b.index} stayed open past its cap"
            if i < len(buckets) - 1:  # only a key's trailing bucket may end below its cap
                assert b.nbytes >= cap, f"bucket {b.index} closed below its cap"


def test_a_gradient_larger_than_the_cap_gets_a_bucket_of_its_own():
    facts = make_facts([("small", 16, "float32", 2), ("huge", 4096, "float32", 3), ("tail", 16, "float32", 4)])
    # 'small' (64 B) + 'huge' (16 KiB) closes the 1 KiB first bucket; 'tail' starts the next
    assert names(plan(facts, config(first_kib=1, rest_kib=1))) == [("small", "huge"), ("tail",)]
    facts = make_facts([("huge", 4096, "float32", 2), ("tail", 16, "float32", 4)])
    assert names(plan(facts, config(first_kib=1, rest_kib=1))) == [("huge",), ("tail",)]


def test_last_bucket_cap_splits_off_the_last_produced_gradients():
    # ten 1 KiB gradients, caps 1 / 4 KiB: without a tail cap the last bucket is the remainder
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(10)])
    assert [len(b.slots) for b in plan(facts, config(first_kib=1, rest_kib=4)).buckets] == [1, 4, 4, 1]
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(11)])
    assert [len(b.slots) for b in plan(facts, config(first_kib=1, rest_kib=4)).buckets] == [1, 4, 4, 2]
    # a 1 KiB tail cap: the last gradient alone, the rest partitioned as before
    schedule = plan(facts, config(first_kib=1, rest_kib=4, last_bucket_cap_mb=KIB))
    assert names(schedule)[-1] == ("p10",)
    assert [len(b.slots) for b in schedule.buckets] == [1, 4, 4, 1, 1]
    # a 2 KiB tail cap takes the last two; the tail is always issued last
    schedule = plan(facts, config(first_kib=1, rest_kib=4, last_bucket_cap_mb=2 * KIB))
    assert names(schedule)[-1] == ("p9", "p10")
    assert schedule.buckets[-1].issue_after == "n12"
    assert schedule.last_bucket_cap_mb == 2 * KIB


def test_last_bucket_cap_takes_one_gradient_even_if_it_exceeds_the_cap():
    facts = make_facts([("a", 256, "float32", 2), ("b", 256, "float32", 3), ("emb", 4096, "float32", 4)])
    schedule = plan(facts, config(first_kib=100, rest_kib=100, last_bucket_cap_mb=KIB))
    assert names(schedule) == [("a", "b"), ("emb",)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_last_bucket_cap_per_dtype_keeps_every_slot_once_and_in_order(seed):
    specs = random_specs(40, seed, dtypes=("float32", "bfloat16"))
    facts = make_facts(specs)
    cfg = config(first_kib=1, rest_kib=3, last_bucket_cap_mb=2 * KIB)
    schedule = plan(facts, cfg)
    assert sorted(s.output_index for b in schedule.buckets for s in b.slots) == list(range(40))
    for key, buckets in buckets_by_key(schedule).items():
        tail = buckets[-1]
        produced = [s for s in facts.slots if (s.dtype, s.device) == key]
        assert tail.slots == tuple(produced[-len(tail.slots):])  # the key's last-produced suffix
        assert len(tail.slots) == 1 or tail.nbytes <= cfg.last_bucket_cap_bytes
        slots = [s for b in buckets for s in b.slots]
        assert slots == sorted(slots, key=order_key)
    ready = [order_key(b.slots[-1]) for b in schedule.buckets]
    assert ready == sorted(ready)


MIB_F32 = 2**20 // 4  # float32 elements in 1 MiB


def sizes(schedule):
    return [len(b.slots) for b in schedule.buckets]


def test_rule_default_is_a_1mb_first_bucket_then_25mb():
    """DDP's default, spelled out for graphddp (whose own default is "auto", test_autoplan)."""
    cfg = DDPConfig(**DDP_DEFAULT_CAPS)
    assert cfg.bucket_size_limits == DDPConfig(last_bucket_cap_mb=1e6).bucket_size_limits  # unset caps with a tail
    assert cfg.bucket_size_limits == (2**20, 25 * 2**20)
    facts = make_facts([(f"p{i}", MIB_F32, "float32", 2 + i) for i in range(60)])  # sixty 1 MiB grads
    schedule = plan(facts, cfg)
    assert sizes(schedule) == [1, 25, 25, 9]
    assert (schedule.first_bucket_cap_mb, schedule.bucket_cap_mb) == (1.0, 25.0)


def test_rule_a_set_bucket_cap_is_also_the_first_bucket_cap():
    # 16 KiB gradients, cap 0.1 MB = 104857 B: 7 per bucket from the first on (never a 1 MB first)
    facts = make_facts([(f"p{i}", 4096, "float32", 2 + i) for i in range(100)])
    schedule = plan(facts, DDPConfig(bucket_cap_mb=0.1))
    assert sizes(schedule) == [7] * 14 + [2]
    assert (schedule.first_bucket_cap_mb, schedule.bucket_cap_mb) == (0.1, 0.1)
    assert "caps first=0.1 MB rest=0.1 MB" in schedule.to_table()


def test_rule_setting_the_default_value_explicitly_drops_the_small_first_bucket():
    # DDP tests ``bucket_cap_mb is None``, not the value: 25 passed explicitly means 25 for all
    assert DDPConfig(bucket_cap_mb=25).bucket_size_limits == (25 * 2**20, 25 * 2**20)
    facts = make_facts([(f"p{i}", MIB_F32, "float32", 2 + i) for i in range(60)])
    assert sizes(plan(facts, DDPConfig(bucket_cap_mb=25))) == [25, 25, 10]


def test_rule_a_bucket_closes_when_its_bytes_reach_the_cap():
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(10)])  # ten 1 KiB grads
    assert sizes(plan(facts, DDPConfig(bucket_cap_mb=2 * KIB))) == [2, 2, 2, 2, 2]  # == cap closes
    # one byte more: the third gradient takes the bucket past its cap, by less than one gradient
    assert sizes(plan(facts, DDPConfig(bucket_cap_mb=2049 / 2**20))) == [3, 3, 3, 1]


def test_rule_megabytes_become_bytes_truncated_as_ddp_does():
    assert DDPConfig(bucket_cap_mb=0.1).bucket_cap_bytes == int(0.1 * 2**20) == 104857
    assert DDPConfig(bucket_cap_mb_list=[0.1, 1 / 3]).bucket_size_limits == (104857, 349525)


def test_rule_first_bucket_cap_is_clamped_to_the_bucket_cap():
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(10)])
    # below the cap it is used: 1 + 3 + 3 + 3; above it, clamped: 2 KiB for every bucket
    assert sizes(plan(facts, config(first_kib=1, rest_kib=3))) == [1, 3, 3, 3]
    schedule = plan(facts, config(first_kib=4, rest_kib=2))
    assert sizes(schedule) == [2, 2, 2, 2, 2]
    assert schedule.first_bucket_cap_mb == schedule.bucket_cap_mb == 2 * KIB
    # with bucket_cap_mb unset the clamp is against DDP's 25 MB
    assert DDPConfig(first_bucket_cap_mb=0.5).bucket_size_limits == (2**19, 25 * 2**20)
    assert DDPConfig(first_bucket_cap_mb=100).bucket_size_limits == (25 * 2**20, 25 * 2**20)


def test_rule_bucket_cap_mb_list_is_walked_one_cap_per_bucket_and_its_last_repeats():
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(10)])
    schedule = plan(facts, DDPConfig(bucket_cap_mb_list=[1 * KIB, 2 * KIB, 3 * KIB]))
    assert sizes(schedule) == [1, 2, 3, 3, 1]
    assert (schedule.first_bucket_cap_mb, schedule.bucket_cap_mb) == (1 * KIB, 3 * KIB)  # first, max


def test_rule_bucket_cap_mb_list_restarts_for_each_dtype_and_device():
    # float32 / float16 on cpu and float32 on meta interleaved, 1 KiB each: every key 1 + 2 + 1
    keys = [("float32", 256, "cpu"), ("float16", 512, "cpu"), ("float32", 256, "meta")]
    specs = [(f"{d}{dev}{i}", n, d, 3 * i + k + 2, dev) for i in range(4) for k, (d, n, dev) in enumerate(keys)]
    schedule = plan(make_facts(specs), DDPConfig(bucket_cap_mb_list=(1 * KIB, 2 * KIB)))
    for buckets in buckets_by_key(schedule).values():
        assert [len(b.slots) for b in buckets] == [1, 2, 1]


def test_rule_bucket_cap_mb_list_overrides_bucket_cap_mb():
    cfg = DDPConfig(bucket_cap_mb=100, bucket_cap_mb_list=[1 * KIB])
    assert cfg.bucket_size_limits == (1024,)
    facts = make_facts([(f"p{i}", 256, "float32", 2 + i) for i in range(3)])
    assert sizes(plan(facts, cfg)) == [1, 1, 1]


def test_rule_bucket_cap_mb_list_excludes_first_bucket_cap_mb():
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list and first_bucket_cap_mb cannot both be set"):
        DDPConfig(bucket_cap_mb_list=[1.0, 2.0], first_bucket_cap_mb=1.0)


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.1, 1, 4.5, 25, 100])
@pytest.mark.parametrize("cap_list", [None, [0.5, 2.0, 1.0], [3]])
def test_resolved_limits_equal_ddps_own_resolution(bucket_cap_mb, cap_list):
    """Against torch itself: the limits DDP's reducer uses when it rebuilds buckets in ready order."""
    ddp_config = getattr(torch.nn.parallel.distributed, "_BucketCapacityConfig", None)
    if ddp_config is None:
        pytest.skip("this torch has no _BucketCapacityConfig")
    ddp = ddp_config.create(bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=cap_list, use_python_reducer=False)
    expected = ddp.per_bucket_bytes_caps or (ddp.first_bucket_bytes_cap, ddp.bucket_bytes_cap)
    unset = bucket_cap_mb is None and cap_list is None  # graphddp's "auto"; DDP's default spelled out
    cfg = DDPConfig(**DDP_DEFAULT_CAPS) if unset else DDPConfig(bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=cap_list)
    assert cfg.bucket_size_limits == tuple(expected)
    assert cfg.bucket_cap_bytes == ddp.bucket_bytes_cap


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buckets_never_mix_dtypes_or_devices(seed):
    specs = random_specs(40, seed, dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "meta"))
    schedule = plan(make_facts(specs), config(first_kib=1, rest_kib=3))
    for b in schedule.buckets:
        assert {(s.dtype, s.device) for s in b.slots} == {(b.dtype, b.device)}


def test_each_dtype_gets_its_own_first_bucket():
    specs = [(f"f{i}", 256, "float32", 2 * i + 2) for i in range(4)]
    specs += [(f"h{i}", 512, "float16", 2 * i + 3) for i in range(4)]
    schedule = plan(make_facts(specs), config(first_kib=1, rest_kib=2))
    assert names(schedule) == [("f0",), ("h0",), ("f1", "f2"), ("h1", "h2"), ("f3",), ("h3",)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_slot_is_in_exactly_one_bucket_in_production_order(seed):
    specs = random_specs(50, seed, dtypes=("float32", "float16"))
    facts = make_facts(specs)
    schedule = plan(facts, config(first_kib=1, rest_kib=3))
    placed = collections.Counter(s.output_index for b in schedule.buckets for s in b.slots)
    assert placed == collections.Counter(range(len(specs)))
    assert [b.index for b in schedule.buckets] == list(range(schedule.num_buckets))
    # per (dtype, device), concatenating the buckets gives that key's slots in production order
    for (dtype, device), buckets in buckets_by_key(schedule).items():
        expected = [s for s in facts.slots if (s.dtype, s.device) == (dtype, device)]
        assert [s for b in buckets for s in b.slots] == sorted(expected, key=order_key)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buckets_are_ordered_by_their_last_slot(seed):
    specs = random_specs(50, seed, dtypes=("float32", "float16"))
    schedule = plan(make_facts(specs), config(first_kib=1, rest_kib=3))
    ready = [order_key(b.slots[-1]) for b in schedule.buckets]
    assert ready == sorted(ready)


def test_issue_after_is_the_producer_of_the_last_slot():
    schedule = plan(make_facts(random_specs(30, seed=3)), config(first_kib=1, rest_kib=2))
    for b in schedule.buckets:
        assert b.issue_after == b.slots[-1].producer == f"n{b.slots[-1].position}"
        assert b.wait_before == "output"


def test_overlap_is_the_compute_strictly_between_issue_and_output():
    # nodes n0..n9 then output; n6 and n8 are views; gradients finalised at n2 and n5
    facts = make_facts(
        [("a", 256, "float32", 2), ("b", 256, "float32", 5)], num_nodes=10, non_compute={6, 8}
    )
    schedule = plan(facts, config(first_kib=1, rest_kib=1))
    assert [(b.issue_after, b.overlap) for b in schedule.buckets] == [
        ("n2", ("n3", "n4", "n5", "n7", "n9")),
        ("n5", ("n7", "n9")),
    ]


def test_overlap_is_empty_when_the_last_gradient_is_the_last_node():
    facts = make_facts([("a", 8, "float32", 4)], num_nodes=5)
    (bucket,) = plan(facts, config()).buckets
    assert bucket.issue_after == "n4" and bucket.overlap == ()


def test_overlap_holds_only_compute_nodes_after_the_issue_point():
    facts = make_facts(random_specs(30, seed=4), non_compute={5, 9, 10, 20, 33})
    position = {n.name: n for n in facts.nodes}
    output = facts.nodes[-1].position
    for b in plan(facts, config(first_kib=1, rest_kib=2)).buckets:
        issue = position[b.issue_after].position
        assert all(position[name].is_compute for name in b.overlap)
        assert all(issue < position[name].position < output for name in b.overlap)
        assert len(b.overlap) == sum(n.is_compute and issue < n.position < output for n in facts.nodes)


def test_no_gradients_no_buckets():
    schedule = plan(make_facts([]), config(), unreduced=("frozen",))
    assert schedule.buckets == () and schedule.unreduced == ("frozen",)


def test_plan_is_deterministic():
    facts = make_facts(random_specs(40, seed=5, dtypes=("float32", "float16")))
    cfg = config(first_kib=1, rest_kib=3)
    same_facts = make_facts(random_specs(40, seed=5, dtypes=("float32", "float16")))
    first, second = plan(facts, cfg, world_size=4, group_name="7"), plan(same_facts, cfg, world_size=4, group_name="7")
    assert first == second
    assert first.fingerprint() == second.fingerprint()


def test_fingerprint_changes_with_the_caps_but_not_the_group_name():
    facts = make_facts(random_specs(20, seed=6))
    base = plan(facts, config(first_kib=1, rest_kib=3), group_name="0").fingerprint()
    assert plan(facts, config(first_kib=1, rest_kib=3), group_name="9").fingerprint() == base
    assert plan(facts, config(first_kib=1, rest_kib=5)).fingerprint() != base
    assert plan(facts, config(first_kib=2, rest_kib=3)).fingerprint() != base
    # caps so large that the buckets are the same still give a different plan identity
    big = plan(facts, config(first_kib=10_000, rest_kib=10_000))
    assert names(big) == names(plan(facts, config(first_kib=20_000, rest_kib=20_000)))
    assert big.fingerprint() != plan(facts, config(first_kib=20_000, rest_kib=20_000)).fingerprint()


def mixed_schedule():
    specs = random_specs(12, seed=7, dtypes=("float32", "bfloat16"))
    return plan(make_facts(specs), config(first_kib=1, rest_kib=2, last_bucket_cap_mb=KIB),
                world_size=2, group_name="3", graph_index=1, unreduced=("frozen.weight",))


def test_schedule_json_round_trip():
    schedule = mixed_schedule()
    assert schedule.num_buckets > 2
    again = Schedule.from_json(schedule.to_json())
    assert again == schedule
    assert again.fingerprint() == schedule.fingerprint()
    assert Schedule.from_json(schedule.to_json(indent=None)) == schedule


def test_schedule_json_rejects_other_schema_versions():
    text = mixed_schedule().to_json().replace('"schema_version": 1', '"schema_version": 99')
    with pytest.raises(ValueError, match="schema_version"):
        Schedule.from_json(text)


def test_to_table_has_one_row_per_bucket_naming_every_parameter():
    schedule = plan(make_facts([(f"layer{i}.w", 256, "float32", 2 + i) for i in range(5)]),
                    config(first_kib=1, rest_kib=2), unreduced=("frozen.weight",))
    table = schedule.to_table()
    assert names(schedule) == [("layer0.w",), ("layer1.w", "layer2.w"), ("layer3.w", "layer4.w")]
    for name in schedule.param_names + schedule.unreduced:
        assert name in table
    rows = [line for line in table.splitlines() if line.split()[0].isdigit()]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]
    assert [row.split()[-1] for row in rows] == ["layer0.w", "layer2.w", "layer4.w"]


def test_with_updates_places_every_update_after_the_last_wait_only_when_clipping():
    """``Schedule.update_after`` is where the plan says each bucket's in-graph update runs:
    after its own wait, or with ``max_grad_norm`` after the last (the norm needs every
    average). A plan without clipping keeps its JSON and fingerprint; one with it says so."""
    from graphddp.plan.planner import with_updates

    facts = make_facts([(f"p{i}", 256, "float32", 2 * i) for i in range(4)])
    planned = plan(facts, config(first_kib=1, rest_kib=1), world_size=2)
    assert planned.num_buckets == 4
    names_all = planned.param_names
    plain = with_updates(planned, names_all, "SGD")
    clipped = with_updates(planned, names_all, "SGD", max_grad_norm=1.0)
    assert [plain.update_after(b.index) for b in plain.buckets] == [0, 1, 2, 3]
    assert [clipped.update_after(b.index) for b in clipped.buckets] == [3, 3, 3, 3]
    assert "max_grad_norm" not in plain.to_dict() and clipped.to_dict()["max_grad_norm"] == 1.0
    assert Schedule.from_json(clipped.to_json()) == clipped and clipped.fingerprint() != plain.fingerprint()
    with pytest.raises(ValueError, match="max_grad_norm must be None or a positive, finite number"):
        DDPConfig(max_grad_norm=0.0)
    assert DDPConfig(max_grad_norm=1).max_grad_norm == 1.0


def test_one_greedy_rule_keeps_a_bucket_open_per_key_or_closes_it_at_a_key_change():
    """bucket_by_size, the rule of both planners: DDP's keeps a bucket open per key across
    interleaved keys; full sharding's (consecutive) closes it when the key changes."""
    from graphddp.plan.greedy import bucket_by_size

    items = [("a", 2), ("b", 1), ("a", 2), ("b", 1), ("a", 1)]
    key, size = (lambda i: i[0]), (lambda i: i[1])
    assert bucket_by_size(items, key, size, lambda _: 4) == [[("a", 2), ("a", 2)], [("b", 1), ("b", 1)], [("a", 1)]]
    assert bucket_by_size(items, key, size, lambda _: 4, consecutive=True) == [[("a", 2)], [("b", 1)], [("a", 2)], [("b", 1)], [("a", 1)]]
    # the limit of a key's n-th bucket (DDP's small first bucket); the buckets left open come last
    first_small = bucket_by_size(items, key, size, lambda closed: 2 if closed == 0 else 100)
    assert first_small == [[("a", 2)], [("b", 1), ("b", 1)], [("a", 2), ("a", 1)]]
