"""What a recompile inherits from the graphs of its frame: their buckets and their hook state.

A recompile replaces an older graph of the same Dynamo frame. Planned afresh, two ranks that
recompile at different steps (one got a short batch) could bucket the same gradients differently,
and a traced hook's state (PowerSGD's error feedback) would start over where DDP's hook goes on.
So a recompile whose gradients an earlier plan of its frame covers takes that plan's buckets
(``planner.plan(like=)``), and a bucket with the same wire layout as an earlier one of its frame
uses that bucket's hook state (``HookState.share``). Pure bookkeeping: no graph, no process group.
"""
from __future__ import annotations

from typing import Any, Iterable

from graphddp.values.schedule import Bucket, GradSlot, Schedule

Plan = tuple[tuple[GradSlot, ...], ...]  # the slots of a schedule's buckets


class FramePlans:
    """Per frame: the plans made so far, and the first (graph, bucket) of each bucket layout."""

    def __init__(self) -> None:
        self._plans: dict[int, list[Plan]] = {}
        self._owners: dict[tuple[int, Any], tuple[int, int]] = {}

    def like(self, frame: int | None, names: Iterable[str]) -> Plan | None:
        """The first plan of ``frame`` that holds every one of ``names`` (None: plan afresh)."""
        wanted = set(names)
        plans = self._plans.get(frame, []) if frame is not None else []
        return next((p for p in plans if wanted <= {s.param_name for b in p for s in b}), None)

    def add(self, frame: int | None, schedule: Schedule) -> None:
        """A plan made afresh for ``frame``: later recompiles may take it."""
        if frame is not None:
            self._plans.setdefault(frame, []).append(tuple(b.slots for b in schedule.buckets))

    def names(self, frame: int | None) -> list[Any]:
        """Per plan of ``frame``, the parameter names per bucket (for the compile cache's key)."""
        return [tuple(tuple(s.param_name for s in b) for b in p) for p in self._plans.get(frame, [])] if frame is not None else []

    def owner(self, frame: int | None, graph_index: int, bucket: Bucket) -> tuple[int, int]:
        """The (graph, bucket) whose hook state ``bucket`` of graph ``graph_index`` uses."""
        if frame is None:
            return graph_index, bucket.index
        return self._owners.setdefault((frame, bucket.wire()), (graph_index, bucket.index))
