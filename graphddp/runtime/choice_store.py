"""The placement an earlier run chose for the same model, batch, optimizer and group: offered to
:func:`graphddp.plan.choose.choose`, which keeps it while this run predicts it fits and within
the tie band of the fastest, so that a restart trains in the placement it was trained in: two runs
measure with their noise, and a choice between candidates the band does not tell apart would follow
it. It follows the stored calibration's switches; ``GRAPHDDP_RECALIBRATE=1`` forgets it too.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch.distributed as dist

from graphddp.runtime import disk
from graphddp.runtime.agree import layout_hash, same_on_every_rank
from graphddp.runtime.calibration_store import RECALIBRATE_ENV


def key_of(*facts: Any) -> str:
    """The store's key: a hash of what the choice was predicted from (any values with a stable repr)."""
    return f"{layout_hash(facts):015x}"


def earlier(key: str, names: Sequence[str], group: Any) -> str | None:
    """The name an earlier run stored under ``key``, if it is one of ``names`` on every rank (each
    may have its own cache directory). Every rank of a real group agrees, even one whose caches are
    off (it holds none): a rank that skipped the agreement would leave the others waiting in it."""
    if dist.get_backend(group) == "fake":
        return None
    stored = _load(key) if disk.enabled() and os.environ.get(RECALIBRATE_ENV, "0") != "1" else None
    index = names.index(stored) if stored in names else -1
    agreed = same_on_every_rank([index], group)
    return names[index] if agreed and index >= 0 else None


def remember(key: str, name: str, group: Any) -> None:
    """Keep ``name`` under ``key``: on a run's own ranks (not ``explain``'s fake group), caches on."""
    if dist.get_backend(group) != "fake" and disk.enabled():
        disk.write_atomically(_path(key), json.dumps({"chosen": name}).encode())


def _path(key: str) -> str:
    return disk.graphddp_path(f"choice-{key}.json")


def _load(key: str) -> str | None:
    try:
        with open(_path(key)) as f:
            return str(json.load(f)["chosen"])
    except Exception:  # noqa: BLE001 - none stored, or a damaged file: chosen anew
        return None
