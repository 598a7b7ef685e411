"""``sharding="auto"``: the placement with the best predicted step among those predicted to fit.

Pure: the candidates' predictions and the budget in, a :class:`~graphddp.values.choice.PlacementChoice`
out, so every rank that traced the same model under the same cost model chooses the same.

Why a tie band. Two placements within :data:`TIE` of each other's predicted step are not told apart
by the cost model (its link figures come from a calibration that moves from run to run), so the
simpler wins: the candidates are listed simpler first (replicated, then the optimizer sharded, then
everything sharded), and the first within the band of the fastest is chosen. A placement an earlier
run chose (:mod:`graphddp.runtime.choice_store`) is chosen instead while it is in the band, so that a
restart trains in the placement it trained in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from graphddp.values.choice import MB, Candidate, PlacementChoice

TIE = 0.05

# Simpler first: (name, the compile options it sets).
PLACEMENTS: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = (
    ("replicated", (("sharding", None),)),
    ("sharding='optimizer'", (("sharding", "optimizer"),)),
    ("sharding='optimizer', gather='forward'", (("sharding", "optimizer"), ("gather", "forward"))),
    ("sharding='full', reshard_after_forward=False", (("sharding", "full"), ("reshard_after_forward", False))),
    ("sharding='full'", (("sharding", "full"), ("reshard_after_forward", True))),
)


# Splits of the parameters by size weighed for full sharding's replicate_below_mb: at most this
# many, each holding whole at least SPLIT_APART of the parameters' bytes less than the next larger
# one, and at least SPLIT_LEAST of them (a model's blocks beside a large embedding hold a few percent).
MAX_SPLITS = 4
SPLIT_APART = 0.1
SPLIT_LEAST = 0.01


def placements(has_optimizer: bool, param_bytes: Sequence[int] = (), mixed_precision: bool = False,
               ) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """The candidates: sharding needs the optimizer inside (``optimizer=``); without it, only replicated.
    After full sharding, full sharding with the parameters under each of :func:`whole_below_splits`
    held whole, most held whole first, each with and without resharding. With a ``mixed_precision``
    policy, full sharding's only: the mode that runs one."""
    if not has_optimizer:
        return () if mixed_precision else PLACEMENTS[:1]
    splits = tuple(
        (f"sharding='full', {name}replicate_below_mb={_plain(mb)}",
         (("sharding", "full"), ("reshard_after_forward", reshard), ("replicate_below_mb", mb)))
        for mb in reversed(whole_below_splits(param_bytes))
        for name, reshard in (("reshard_after_forward=False, ", False), ("", True))
    )
    whole_model = tuple(p for p in PLACEMENTS if dict(p[1])["sharding"] == "full") if mixed_precision else PLACEMENTS
    return whole_model + splits


def whole_below_splits(param_bytes: Sequence[int]) -> tuple[float, ...]:
    """``replicate_below_mb`` values worth weighing, ascending: each holds whole the parameters under
    one of their sizes and shards the rest (the largest always sharded). From the split that holds the
    most whole down, a split is left out where it holds less than :data:`SPLIT_APART` of all the bytes
    fewer whole than the last one kept (about the same memory, more gathers), or less than
    :data:`SPLIT_LEAST` whole at all. Each value is the roundest MB between the two sizes it separates."""
    distinct = sorted(set(param_bytes))
    total = sum(param_bytes)
    kept: list[float] = []
    last = None
    for lo, hi in reversed(list(zip(distinct, distinct[1:]))):
        held = sum(n for n in param_bytes if n <= lo)
        if held < SPLIT_LEAST * total:
            break  # this and every smaller split hold almost nothing whole: full sharding's
        if last is not None and last - held < SPLIT_APART * total:
            continue
        kept.append(_roundest_between(lo, hi))
        last = held
        if len(kept) == MAX_SPLITS:
            break
    return tuple(reversed(kept))


def _plain(mb: float) -> str:
    return f"{mb:.12f}".rstrip("0").rstrip(".")


def _roundest_between(lo: int, hi: int) -> float:
    """The MB value of fewest significant figures whose bytes (as the option counts them) hold a
    parameter of ``lo`` bytes whole and shard one of ``hi``."""
    for digits in range(1, 12):
        step = 10 ** (math.floor(math.log10((lo + 1) / MB)) - digits + 1)
        mb = round(math.ceil((lo + 1) / MB / step) * step, 12)
        if lo < int(mb * MB) <= hi:
            return mb
    return (lo + 1) / MB


def memory_placement(sharding: str | None, gather: str, reshard_after_forward: bool, has_optimizer: bool) -> str:
    """A candidate's name in :mod:`graphddp.plan.memory`'s terms."""
    if sharding == "full":
        return "full" if reshard_after_forward else "full_no_reshard"
    if sharding == "optimizer":
        return "optimizer_forward" if gather == "forward" else "optimizer"
    return "optimizer_inside" if has_optimizer else "replicated"


def choose(
    options: Sequence[tuple[str, tuple[tuple[str, Any], ...]]], predict: Callable[[dict[str, Any]], tuple[Any, ...]],
    budget_bytes: int | None, earlier: str | None = None,
) -> PlacementChoice:
    """Weigh each of ``options`` by ``predict(options) -> (step seconds, peak bytes, bytes held between
    steps[, forward seconds, backward seconds])`` and choose (module docstring). A budget no candidate
    fits is a ValueError naming the smallest predicted peak."""
    weighed = [Candidate(name, opts, *predict(dict(opts))) for name, opts in options]
    fits = [c for c in weighed if budget_bytes is None or c.peak_bytes <= budget_bytes]
    if not fits:
        least = min(weighed, key=lambda c: c.peak_bytes)
        raise ValueError(
            f"graphddp: sharding='auto' found no placement that fits memory_budget={budget_bytes} bytes "
            f"({budget_bytes / MB:.1f} MB per rank): the smallest predicted peak is {least.name}'s, "
            f"{least.peak_bytes} bytes ({least.peak_bytes / MB:.1f} MB); raise memory_budget or use more ranks"
        )
    fastest = min(c.step_seconds for c in fits)
    band = [c for c in fits if c.step_seconds <= fastest * (1 + TIE)]
    kept = next((c for c in band if c.name == earlier), None)
    chosen = kept or band[0]
    return PlacementChoice(chosen.name, budget_bytes, tuple(_verdict(c, chosen, budget_bytes, fastest, kept is not None) for c in weighed))


def _verdict(c: Candidate, chosen: Candidate, budget: int | None, fastest: float, kept: bool) -> Candidate:
    if c is chosen and kept:
        why = f"chosen: an earlier run's choice, within {TIE:.0%} of the fastest"
    elif c is chosen:
        why = "chosen: fastest predicted" if c.step_seconds == fastest else f"chosen: within {TIE:.0%} of the fastest, simpler"
    elif budget is not None and c.peak_bytes > budget:
        why = f"does not fit: peak {c.peak_bytes / MB:.1f} MB > budget {budget / MB:.1f} MB"
    elif c.step_seconds <= fastest * (1 + TIE):
        why = f"within {TIE:.0%} of the fastest, but " + (f"an earlier run chose {chosen.name}" if kept else f"{chosen.name} is simpler")
    else:
        why = f"slower: +{(c.step_seconds / chosen.step_seconds - 1):.0%} over {chosen.name}"
    return dataclasses.replace(c, verdict=why)
