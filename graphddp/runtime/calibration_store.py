"""The calibration an earlier run stored, kept when this run measures close to it: the same
plan after a restart. It sits in torch's inductor cache directory; a run that plans with it
says so on the ``graphddp`` logger, and ``GRAPHDDP_RECALIBRATE=1`` measures anew.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

from graphddp.plan.cost import CostModel
from graphddp.runtime import disk
from graphddp.runtime.agree import layout_hash, same_on_every_rank

log = logging.getLogger("graphddp")

RECALIBRATE_ENV = "GRAPHDDP_RECALIBRATE"


# A measurement within this factor of the stored one, in every number (microseconds with
# US_SLACK added: tens of microseconds of latency are noise; the host share with SHARE_SLACK),
# keeps the stored one. 2x: the auto plan holds up under a 1.5x error of the model, two
# calibrations of one link differ by about that much, another link by far more.
KEEP_WITHIN = 2.0
US_SLACK = 100.0
SHARE_SLACK = 0.1  # added to the host share likewise: a tenth of a collective's time on the host is noise


def settle(measured: CostModel, key: tuple[str, str, int, str], group: Any) -> CostModel:
    """This run's cost model: the one an earlier run of the same group stored, if this run's
    measurement is within ``KEEP_WITHIN`` of it on every rank (a plan made from other numbers is
    another compile), else the measurement. Each rank may have its own cache directory, so the
    choice is agreed. A measurement outside the band replaces the stored model only when the run
    before measured outside it too: one outlier plans this run anew without making every later
    restart replan. A rank whose caches are off keeps nothing, so no rank keeps, but it agrees:
    the others wait for it there."""
    path = _stored_path(key)
    anew = os.environ.get(RECALIBRATE_ENV, "0") == "1"  # a rank that measures anew keeps nothing: no rank keeps
    stored, outside_before = (None, False) if anew or not disk.enabled() else _load(path)
    keep = stored is not None and _close(stored, measured)
    mine = layout_hash(_numbers(stored)) if keep else -1  # type: ignore[arg-type]
    if same_on_every_rank([mine], group) and keep:
        if outside_before:
            _store(path, stored)  # type: ignore[arg-type] # the outlier is forgotten
        log.info(
            "graphddp: bucket_cap_mb='auto' plans with the calibration an earlier run stored in %s (%s), this run "
            "measured %s, within %gx; to measure anew, set %s=1 or delete that file", path, stored.describe(),  # type: ignore[union-attr]
            _numbers(measured), KEEP_WITHIN, RECALIBRATE_ENV,
        )
        return dataclasses.replace(
            stored, source=f"{measured.source}, kept from an earlier run: this run measured {_numbers(measured)}"  # type: ignore[arg-type]
        )
    if not disk.enabled():
        return measured
    if anew:
        log.info("graphddp: %s=1: the calibration measured now replaces any stored in %s", RECALIBRATE_ENV, path)
    if stored is None or (not keep and outside_before):
        _store(path, measured)
    elif not keep:
        _store(path, stored, outside=True)
    return measured


def _stored_path(key: tuple[str, str, int, str]) -> str:
    name = "-".join(str(part) or "solo" for part in key)
    return disk.graphddp_path(f"calibration-{name}.json")


def _numbers(model: CostModel) -> str:
    return json.dumps(model.numbers, sort_keys=True)


def _close(stored: CostModel, measured: CostModel) -> bool:
    for name, a in stored.numbers.items():
        b = measured.numbers[name]
        if a == b:
            continue
        if name.endswith("_us"):
            a, b = a + US_SLACK, b + US_SLACK
        elif name == "collective_host_share":
            a, b = a + SHARE_SLACK, b + SHARE_SLACK
        if a <= 0 or b <= 0 or not (math.isfinite(a) and math.isfinite(b)) or max(a / b, b / a) > KEEP_WITHIN:
            return False
    return True


def _load(path: str) -> tuple[CostModel | None, bool]:
    """The stored model, and whether the run that last read it measured outside its band."""
    try:
        with open(path) as f:
            data = json.load(f)
        outside = bool(data.pop("outside_before", False))
        return CostModel(**data), outside
    except Exception:  # noqa: BLE001 - none stored, or a damaged file: measured over
        return None, False


def _store(path: str, model: CostModel, outside: bool = False) -> None:
    disk.write_atomically(path, json.dumps({**model.to_dict(), "outside_before": outside}).encode())

