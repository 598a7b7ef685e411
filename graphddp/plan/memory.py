"""Each rank's memory, in bytes, under every placement, predicted from facts read once off one trace.

:class:`MemoryFacts` are the model's own (its compiled forward and backward before graphddp rewrites
them, its parameters, the optimizer's state per parameter), read by
:func:`graphddp.compiler.model_trace.trace_model`; :func:`predict` is pure, so one trace predicts
every placement, at any world size.

Counted: a loop of ``forward; backward; opt.step(); opt.zero_grad()`` on one rank.
**Between steps**: parameters (a rank's parts, padded, where they are sharded), buffers, the
optimizer's state (of the parts), the send buffer a replicated one-bucket graph keeps from step to
step on the CPU (:mod:`graphddp.runtime.steady`), and with ``gather="forward"`` the all-gathered
parameters that wait for the next forward; gradients are None after ``zero_grad``.
**Peak**: that plus the fullest of these phases: a forward (the activations earlier graphs saved, the
graph's own peak, the parameters gathered); a backward (its graph's live bytes, from
:mod:`graphddp.graph.liveness`, with the gradients kept to its end, the bucket's flat copy, the
update's temporaries inside it, the gathers of full sharding); the optimizer's step after a
replicated backward (every gradient and its step's temporaries on the largest parameter). Under full
sharding's mixed-precision policy the graphs were traced computing in its ``param_dtype``, and the
gradients are reduced in its ``reduce_dtype``.

Not counted: the allocator's caching and fragmentation (a GPU's reserved bytes exceed these),
autograd's own workspace, the user's inputs and outputs, and kernels' scratch memory. The compiled
code's temporaries are counted as the graph runs op by op (``aot_eager``); inductor fuses pointwise
ops, so its peaks are lower. Each graph is taken as one bucket (its gradients in flight at once):
what small models plan, and an upper bound for a graph of several buckets.
"""
from __future__ import annotations

import dataclasses

from graphddp.values.schedule_table import MB
from graphddp.values.shards import chunk

PLACEMENTS = ("replicated", "optimizer_inside", "optimizer", "optimizer_forward", "full", "full_no_reshard")
SHARDED = ("optimizer", "optimizer_forward", "full", "full_no_reshard")
_HEADER_BYTES = 32  # the steady all-reduce's header after the payload (runtime/steady.py's HEADER float32s)


@dataclasses.dataclass(frozen=True)
class ParamFact:
    name: str
    numel: int
    itemsize: int
    requires_grad: bool
    dtype: str


@dataclasses.dataclass(frozen=True)
class StateRule:
    """The optimizer's state of one parameter of ``dtype``: ``per_element * numel + fixed`` bytes
    (Adam's moments grow with the parameter, its ``step`` does not)."""

    dtype: str
    per_element: int
    fixed: int


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """One Dynamo graph's bytes: its forward's peak, what it saves for the backward (parameters left
    out), its parameters (whole), their gradients, and its backward's peak with the gradients kept to
    its end (saved activations included)."""

    param_bytes: int
    forward_peak: int
    saved: int
    gradients: int
    backward_peak: int
    backward_peak_held: int  # the same with its saved activations held to its end
    params: tuple[str, ...] = ()  # its parameters' names (ParamFact.name): which of them a placement holds whole


@dataclasses.dataclass(frozen=True)
class MemoryFacts:
    """What every placement's prediction reads. ``step_workspace``: the optimizer's ``step()``
    temporaries per byte of a parameter; ``update_workspace``: the same for the update traced inside
    the backward."""

    params: tuple[ParamFact, ...]
    buffer_bytes: int
    state: tuple[StateRule, ...]
    graphs: tuple[GraphMemory, ...]
    recomputed: tuple[GraphMemory, ...]  # the same graphs partitioned by min-cut, as full sharding compiles them
    step_workspace: float = 0.0
    update_workspace: float = 0.0
    device: str = "cpu"
    # under full sharding's mixed-precision policy (0 without one): the graphs' values were traced
    # in its param_dtype, of compute_itemsize bytes; gradients are reduced in reduce_itemsize
    compute_itemsize: int = 0
    reduce_itemsize: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """One placement's bytes on one rank: ``between_steps`` (the sum of ``breakdown``) and ``peak``
    (that plus ``at_peak``, the step's own bytes in its fullest ``phase``)."""

    placement: str
    world_size: int
    shard_size: int
    between_steps: int
    peak: int
    phase: str
    breakdown: dict[str, int]
    at_peak: dict[str, int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _state_bytes(facts: MemoryFacts, param: ParamFact, elements: int) -> int:
    rule = next((r for r in facts.state if r.dtype == param.dtype), None)
    return 0 if rule is None or not param.requires_grad else rule.per_element * elements + rule.fixed


def predict(facts: MemoryFacts, placement: str, world_size: int, shard_size: int | None = None, whole_below: int = 0) -> MemoryPrediction:
    """The bytes rank 0, the most loaded (the first ranks hold whole chunks), holds under ``placement``
    with ``world_size`` ranks. ``shard_size``: hybrid sharding's shard group (parts over that many
    ranks, replicated over ``world_size // shard_size``), default every rank; ``whole_below``: under
    full sharding, parameters of fewer bytes are held whole (``replicate_below_mb``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    shard = world_size if shard_size is None else shard_size
    if world_size < 1 or shard < 1 or world_size % shard:
        raise ValueError(f"shard_size must divide world_size, got shard_size={shard_size!r}, world_size={world_size!r}")
    if placement not in SHARDED and shard != world_size:
        raise ValueError(f"shard_size= is hybrid sharding's; placement {placement!r} shards nothing")
    sharded = placement in SHARDED
    full = placement.startswith("full")
    if facts.compute_itemsize and not full:
        raise ValueError(f"facts traced under a mixed-precision policy predict full sharding only, not {placement!r}")
    ranks = shard if sharded else 1
    held_whole = {p.name for p in facts.params if full and p.numel * p.itemsize < whole_below}
    parts = [p.numel if p.name in held_whole else chunk(p.numel, ranks) for p in facts.params]
    whole = sum(p.numel * p.itemsize for p in facts.params)
    trainable = [p for p in facts.params if p.requires_grad]
    largest = max((n * p.itemsize for n, p in zip(parts, facts.params) if p.requires_grad), default=0)  # one update's parameter or part
    steady = placement == "replicated" and world_size > 1 and facts.device == "cpu"
    breakdown = {
        "parameters": sum(n * p.itemsize for n, p in zip(parts, facts.params)) if full else whole,
        "buffers": facts.buffer_bytes,
        "optimizer_state": sum(_state_bytes(facts, p, n if sharded else p.numel) for n, p in zip(parts, facts.params)),
        "bucket_buffers": sum(g.gradients + _HEADER_BYTES for g in facts.graphs if g.gradients) if steady else 0,
    }
    if placement == "optimizer_forward":  # each bucket's all-gathered parameters wait for the next forward
        breakdown["pending_gathers"] = sum(p.numel * p.itemsize for p in trainable)
    computed = {p.name: p.numel * (facts.compute_itemsize or p.itemsize) for p in facts.params if p.name in held_whole}
    phases = _phases(facts, placement, largest, shard != world_size and sharded, ranks, computed)
    phase, at_peak = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    between = sum(breakdown.values())
    return MemoryPrediction(placement, world_size, shard, between, between + sum(at_peak.values()), phase, breakdown, at_peak)


def _phases(
    facts: MemoryFacts, placement: str, largest: int, hybrid: bool, ranks: int, held_whole: dict[str, int],
) -> dict[str, dict[str, int]]:
    """Each moment of a step that may be its fullest, and the bytes it adds to what is held between
    steps, by kind. A replicated backward graph's saved activations stay alive to its end (its caller
    holds their list); full sharding's compiler frees each after its last use. ``held_whole``: under
    full sharding, the bytes (as the graphs compute them) of each parameter held whole: never
    gathered, its gradient all-reduced whole; under a mixed-precision policy still cast for the
    forward, a copy as large as a gathered one."""
    full = placement.startswith("full")
    graphs = facts.recomputed if full else facts.graphs
    workspace = int(facts.update_workspace * largest)  # one parameter's (or part's) update inside the backward
    copied = {} if facts.compute_itemsize else held_whole  # what a graph reads without a gather or a cast
    reduced = facts.reduce_itemsize / facts.compute_itemsize if facts.compute_itemsize else 1.0
    phases: dict[str, dict[str, int]] = {}
    def sharded_bytes(h: GraphMemory) -> int:  # what a full-sharding graph gathers (or casts)
        return max(h.param_bytes - sum(copied.get(n, 0) for n in h.params), 0)

    for k, g in enumerate(graphs):
        earlier = sum(h.saved for h in graphs[:k])
        kept_whole = sum(held_whole.get(n, 0) for n in g.params)  # their gradients all-reduced whole
        part = chunk(g.gradients - kept_whole, ranks) + kept_whole if placement in SHARDED else 0  # this rank's part of the bucket
        part = int(part * reduced)
        gathered = 0
        if full:  # the parameters gathered: this graph's, or with them kept from the forward, every graph's so far
            gathered = sum(sharded_bytes(h) for h in graphs[: k + 1]) if placement == "full_no_reshard" else sharded_bytes(g)
        phases[f"forward {k}"] = {"activations": earlier + g.forward_peak, "gathered": gathered}
        at = f"backward {k}"
        if full:
            phases[at] = {"activations": earlier, "graph": g.backward_peak, "gathered": gathered}
            sent = int(g.gradients * reduced)  # the gradients as reduced, and their bucket's flat copy
            phases[f"bucket {k}"] = {"activations": earlier, "gradients": sent, "in_flight": sent}
            phases[f"update {k}"] = {"activations": earlier, "in_flight": part, "workspace": workspace}
            if hybrid:  # the part, and its average over the replicas
                phases[f"replicas {k}"] = {"activations": earlier, "in_flight": 2 * part}
            continue
        later = sum(h.gradients for h in graphs[k + 1:]) if placement == "replicated" else 0  # kept in p.grad
        phases[at] = {"activations": earlier, "gradients": later, "graph": g.backward_peak_held}
        held = {"activations": earlier + g.saved, "gradients": later + g.gradients}
        phases[f"bucket {k}"] = {**held, "in_flight": g.gradients}  # the flat copy, next to what it copies
        if placement == "optimizer_inside":
            phases[f"update {k}"] = {"activations": earlier + g.saved, "in_flight": g.gradients, "workspace": workspace}
        elif placement in ("optimizer", "optimizer_forward"):
            phases[f"update {k}"] = {"activations": earlier + g.saved, "in_flight": g.gradients + part, "workspace": workspace}
            phases[f"gather {k}"] = {"activations": earlier + g.saved, "in_flight": 2 * g.gradients + part}
            if hybrid:
                phases[f"replicas {k}"] = {"activations": earlier + g.saved, "in_flight": g.gradients + 2 * part}
    if placement == "replicated":
        phases["optimizer step"] = {"gradients": sum(g.gradients for g in graphs), "workspace": int(facts.step_workspace * largest)}
    return phases


def table(predictions: list[MemoryPrediction]) -> str:
    """One line per prediction: between steps, peak, the phase of the peak and what it holds."""
    mb = lambda n: f"{n / MB:9.2f}"  # noqa: E731
    lines = [f"{'placement':<18}{'ranks':>7}{'between MB':>11}{'peak MB':>10}  peak in / bytes held (MB)"]
    for p in predictions:
        ranks = f"{p.world_size}" if p.shard_size == p.world_size else f"{p.world_size // p.shard_size}x{p.shard_size}"
        held = ", ".join(f"{k} {v / MB:.2f}" for k, v in {**p.breakdown, **p.at_peak}.items() if v)
        lines.append(f"{p.placement:<18}{ranks:>7}{mb(p.between_steps):>11}{mb(p.peak):>10}  {p.phase}: {held}")
    return "\n".join(lines)
