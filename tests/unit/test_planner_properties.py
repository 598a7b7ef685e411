"""Property-based tests of the pure planner: random gradients, random caps, DDP's rules.

Each test draws a gradient list (sizes, dtypes, devices, production positions with ties, output
order shuffled) and a cap configuration in one of the shapes users write (DDP's default, a set
``bucket_cap_mb``, graphddp's ``first_bucket_cap_mb``, a ``bucket_cap_mb_list``, with or without
``last_bucket_cap_mb``), and checks a rule that must hold for every input. The partition is also
checked against torch's own ``compute_bucket_assignment_by_size``, the function DDP's reducer runs.
"""
from __future__ import annotations

import collections
import dataclasses

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphddp.config import DDP_DEFAULT_CAPS, DDPConfig
from graphddp.plan.planner import plan
from graphddp.values.schedule import Bucket, GradSlot, GraphFacts, NodeFact, Schedule

MB = 2**20
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DEVICES = ("cpu", "meta")  # real device types, so torch's reducer function can take the same tensors

# Bounded and quick: the planner is pure Python over at most a few dozen slots. No example
# database, so running the tests writes nothing into the repository.
SETTINGS = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# strategies


@st.composite
def gradient_facts(draw: st.DrawFn) -> GraphFacts:
    """GraphFacts with 0-40 gradients: small and large sizes, mixed keys, tied positions."""
    keys = draw(st.lists(st.sampled_from([(d, dev) for d in ITEMSIZE for dev in DEVICES]), min_size=1, max_size=3, unique=True))
    # sizes from empty to 2 MiB of float32, so DDP's default 1 MiB first bucket and small caps both matter
    numel = st.one_of(st.integers(0, 1024), st.integers(1024, 2**19))
    specs = draw(st.lists(st.tuples(st.sampled_from(keys), numel, st.integers(1, 60)), max_size=40))
    output_indices = draw(st.permutations(range(len(specs))))
    slots = tuple(
        GradSlot(output_index=out, param_name=f"p{out}", shape=(count,), dtype=dtype, device=device, numel=count,
                 nbytes=count * ITEMSIZE[dtype], producer=f"n{position}", position=position)
        for out, ((dtype, device), count, position) in zip(output_indices, specs)
    )
    num_nodes = max((s.position for s in slots), default=0) + 3
    nodes = tuple(NodeFact(f"n{p}", p, p % 5 != 0) for p in range(num_nodes)) + (NodeFact("output", num_nodes, False),)
    return GraphFacts(nodes=nodes, slots=slots)


# caps from 1 byte to 3 MiB, often small so several buckets close, as exact binary fractions of
# a megabyte so bytes round-trip exactly
cap_mb = st.one_of(st.integers(1, 64 * 1024), st.integers(1, 3 * MB)).map(lambda b: b / MB)


@st.composite
def configs(draw: st.DrawFn, with_tail: bool | None = None) -> DDPConfig:
    """A DDPConfig in one of the shapes users write; ``with_tail`` forces last_bucket_cap_mb on/off."""
    shape = draw(st.sampled_from(["default", "cap", "cap+first", "first", "list"]))
    kwargs: dict = dict(DDP_DEFAULT_CAPS) if shape == "default" else {}  # DDP's: graphddp's own is "auto"
    if shape in ("cap", "cap+first"):
        kwargs["bucket_cap_mb"] = draw(cap_mb)
    if shape in ("first", "cap+first"):
        kwargs["first_bucket_cap_mb"] = draw(cap_mb)
    if shape == "list":
        kwargs["bucket_cap_mb_list"] = draw(st.lists(cap_mb, min_size=1, max_size=4))
    tail = draw(st.booleans()) if with_tail is None else with_tail
    if tail:
        kwargs["last_bucket_cap_mb"] = draw(cap_mb)
    return DDPConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# helpers


def order(slot: GradSlot) -> tuple[int, int]:
    return (slot.position, slot.output_index)


def key_of(slot: GradSlot) -> tuple[str, str]:
    return (slot.dtype, slot.device)


def produced(facts: GraphFacts, key: tuple[str, str]) -> list[GradSlot]:
    """One key's gradients in production order."""
    return sorted((s for s in facts.slots if key_of(s) == key), key=order)


def buckets_by_key(schedule: Schedule) -> dict[tuple[str, str], list[Bucket]]:
    """(dtype, device) -> its buckets in schedule (issue) order."""
    out: dict[tuple[str, str], list[Bucket]] = collections.defaultdict(list)
    for b in schedule.buckets:
        out[(b.dtype, b.device)].append(b)
    return out


def split_tail(cfg: DDPConfig, buckets: list[Bucket]) -> tuple[list[Bucket], Bucket | None]:
    """A key's buckets without and with its last_bucket_cap_mb tail (issued last of the key)."""
    if cfg.last_bucket_cap_mb is None:
        return buckets, None
    return buckets[:-1], buckets[-1]


def limit(cfg: DDPConfig, i: int) -> int:
    """The byte cap of a key's i-th bucket: one limit per bucket, the last repeating."""
    limits = cfg.bucket_size_limits
    return limits[min(i, len(limits) - 1)]


# ---------------------------------------------------------------------------------------------
# properties


@SETTINGS
@given(gradient_facts(), configs())
def test_every_gradient_is_in_exactly_one_bucket(facts, cfg):
    schedule = plan(facts, cfg)
    placed = collections.Counter(s.output_index for b in schedule.buckets for s in b.slots)
    assert placed == collections.Counter(s.output_index for s in facts.slots)
    assert all(b.slots for b in schedule.buckets)
    assert [b.index for b in schedule.buckets] == list(range(schedule.num_buckets))


@SETTINGS
@given(gradient_facts(), configs())
def test_buckets_never_mix_dtypes_or_devices(facts, cfg):
    for b in plan(facts, cfg).buckets:
        assert {key_of(s) for s in b.slots} == {(b.dtype, b.device)}


@SETTINGS
@given(gradient_facts(), configs())
def test_each_key_concatenates_to_its_production_order(facts, cfg):
    schedule = plan(facts, cfg)
    for key, buckets in buckets_by_key(schedule).items():
        assert [s for b in buckets for s in b.slots] == produced(facts, key)
    ready = [order(b.slots[-1]) for b in schedule.buckets]
    assert ready == sorted(ready)  # issued in the order buckets become ready


@SETTINGS
@given(gradient_facts(), configs())
def test_every_bucket_but_a_keys_last_reaches_its_cap_and_not_before_its_last_gradient(facts, cfg):
    """DDP's close rule: a bucket closes as soon as its bytes reach its cap, and only then."""
    for buckets in buckets_by_key(plan(facts, cfg)).values():
        body, _ = split_tail(cfg, buckets)
        for i, b in enumerate(body):
            assert b.nbytes - b.slots[-1].nbytes < limit(cfg, i), f"bucket {b.index} stayed open past its cap"
            if i < len(body) - 1:
                assert b.nbytes >= limit(cfg, i), f"bucket {b.index} closed below its cap"


@SETTINGS
@given(gradient_facts(), configs(with_tail=False))
def test_first_bucket_of_each_key_uses_the_first_cap(facts, cfg):
    expected_mb = (
        cfg.bucket_cap_mb_list[0] if cfg.bucket_cap_mb_list
        else min(cfg.first_bucket_cap_mb, cfg.bucket_cap_mb or 25.0) if cfg.first_bucket_cap_mb is not None
        else cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None
        else 1.0  # DDP's small first bucket: only when bucket_cap_mb is left unset
    )
    assert cfg.first_bucket_cap_bytes == int(expected_mb * MB)
    schedule = plan(facts, cfg)
    assert schedule.first_bucket_cap_mb == expected_mb
    for key, buckets in buckets_by_key(schedule).items():
        first, slots = buckets[0], produced(facts, key)
        assert first.nbytes - first.slots[-1].nbytes < cfg.first_bucket_cap_bytes
        if len(buckets) > 1:
            assert first.nbytes >= cfg.first_bucket_cap_bytes
        # the first bucket is the shortest prefix of the key's gradients that reaches the first cap
        prefix = 0
        for n, s in enumerate(slots, 1):
            prefix += s.nbytes
            if prefix >= cfg.first_bucket_cap_bytes or n == len(slots):
                assert first.slots == tuple(slots[:n])
                break


@SETTINGS
@given(gradient_facts(), configs(with_tail=True))
def test_last_bucket_cap_splits_off_the_longest_suffix_that_fits(facts, cfg):
    cap = cfg.last_bucket_cap_bytes
    for key, buckets in buckets_by_key(plan(facts, cfg)).items():
        _, tail = split_tail(cfg, buckets)
        slots = produced(facts, key)
        n = len(tail.slots)
        assert tail.slots == tuple(slots[-n:])  # the key's last-produced gradients
        assert n == 1 or tail.nbytes <= cap  # at least one gradient, else within the cap
        if n < len(slots):
            assert tail.nbytes + slots[-n - 1].nbytes > cap  # one more would not fit


@SETTINGS
@given(gradient_facts(), configs(with_tail=False))
def test_partition_equals_torchs_compute_bucket_assignment_by_size(facts, cfg):
    """The oracle is torch itself: DDP's reducer function, on tensors of the same sizes."""
    ordered = sorted(facts.slots, key=order)
    if not ordered:  # torch's function asserts on an empty list; no gradients, no buckets
        assert plan(facts, cfg).buckets == ()
        return
    tensors = [torch.empty(s.numel, dtype=getattr(torch, s.dtype), device=s.device) for s in ordered]
    indices, _ = dist._compute_bucket_assignment_by_size(
        tensors, list(cfg.bucket_size_limits), [False] * len(tensors), list(range(len(tensors)))
    )
    ddp = {tuple(ordered[i].output_index for i in bucket) for bucket in indices}
    ours = {tuple(s.output_index for s in b.slots) for b in plan(facts, cfg).buckets}
    assert ours == ddp


@SETTINGS
@given(gradient_facts(), configs(), st.randoms(use_true_random=False))
def test_plan_is_deterministic(facts, cfg, rng):
    first = plan(facts, cfg)
    again = plan(dataclasses.replace(facts), dataclasses.replace(cfg))
    shuffled_slots = list(facts.slots)
    rng.shuffle(shuffled_slots)
    shuffled = plan(dataclasses.replace(facts, slots=tuple(shuffled_slots)), cfg)
    assert first == again == shuffled
    assert first.fingerprint() == again.fingerprint() == shuffled.fingerprint()
    assert Schedule.from_json(first.to_json()) == first
