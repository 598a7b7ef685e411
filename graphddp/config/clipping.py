"""``max_grad_norm`` and ``grad_norm_type``, checked once for every mode that clips: they mean
``torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type=grad_norm_type)`` before
``optimizer.step()``.
"""
from __future__ import annotations

import math
from typing import Any


def check_clipping(max_grad_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    """Both options as floats, or a ``ValueError`` naming the option. ``norm_type`` takes what
    ``clip_grad_norm_`` takes for p > 0, ``"inf"`` included. p <= 0 is refused: torch's vector
    norm computes it, but it is no norm to clip by (p = 0 counts the nonzero entries, p < 0
    grows as the entries shrink). A p other than 2 without ``max_grad_norm`` clips nothing, so
    it is refused too rather than ignored."""
    c, p = max_grad_norm, norm_type
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not (c > 0 and math.isfinite(c))):
        raise ValueError(f"max_grad_norm must be None or a positive, finite number, got {c!r}")
    if isinstance(p, str) and p.strip().lower() in ("inf", "infinity"):
        p = math.inf
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(f"grad_norm_type must be a number p > 0 (1, 2, float('inf') or another p), got {norm_type!r}")
    if p != 2 and c is None:
        raise ValueError(f"grad_norm_type={norm_type!r} is the norm max_grad_norm clips by, and max_grad_norm is not given")
    return (None if c is None else float(c)), float(p)

