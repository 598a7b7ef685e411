"""``sharding="auto"``'s choice as a value: every placement it weighed, what it predicted for
each, and why the chosen one won, so that the choice can be shown, stored, compared between
ranks and between runs like the rest of a plan (:mod:`graphddp.plan.choose` makes it)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from graphddp.values.schedule_table import MB


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One placement weighed: the options it compiles with, its predicted step and memory per
    rank (at the step's peak and between steps), the step's forward and backward, and the verdict."""

    name: str
    options: tuple[tuple[str, Any], ...]
    step_seconds: float
    peak_bytes: int
    between_bytes: int
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0  # the optimizer's update inside it
    verdict: str = ""


@dataclasses.dataclass(frozen=True)
class PlacementChoice:
    """The candidates in preference order (a simpler placement first) and the chosen one's name."""

    chosen: str
    budget_bytes: int | None
    candidates: tuple[Candidate, ...]

    @property
    def winner(self) -> Candidate:
        return next(c for c in self.candidates if c.name == self.chosen)

    def options(self) -> dict[str, Any]:
        """The compile options of the chosen placement."""
        return dict(self.winner.options)

    def to_table(self) -> str:
        budget = "no memory budget" if self.budget_bytes is None else f"memory budget {self.budget_bytes / MB:.1f} MB per rank"
        width = max([46] + [len(c.name) for c in self.candidates])
        head = f"  {'placement':<{width}} {'step ms':>9} {'fwd ms':>8} {'bwd ms':>8} {'peak MB':>9} {'held MB':>9}  verdict"
        rows = [f"sharding='auto' chose {self.chosen} ({budget})", head, "  " + "-" * (len(head) - 2)]
        for c in self.candidates:
            rows.append(f"  {c.name:<{width}} {c.step_seconds * 1e3:>9.3f} {c.forward_seconds * 1e3:>8.2f} {c.backward_seconds * 1e3:>8.2f} "
                        f"{c.peak_bytes / MB:>9.2f} {c.between_bytes / MB:>9.2f}  {c.verdict}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.to_table()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for c in data["candidates"]:
            c["options"] = [list(o) for o in c["options"]]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "PlacementChoice | None":
        if data is None:
            return None
        candidates = tuple(Candidate(**{**c, "options": tuple(tuple(o) for o in c["options"])}) for c in data["candidates"])
        return cls(data["chosen"], data["budget_bytes"], candidates)

    def fingerprint(self) -> str:
        """What every rank must agree on: the chosen placement and the figures it was chosen by."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
