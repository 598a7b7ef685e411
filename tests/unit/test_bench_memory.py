"""The benchmark's step-memory figure counts what a step frees, also memory allocated before it.

torch.profiler reports no free of memory allocated before it started, so a step profiled alone
counts what it frees from earlier steps (the old gradients its ``zero_grad`` drops, the
all-gathers ``gather="forward"`` completes) as live to its end: that peak was one gradient's
size too high for DDP. ``tools.bench.modes._profile_step`` measures the second of two profiled
steps instead.
"""
from __future__ import annotations

import torch

from tools.bench.modes import _profile_step

MB = 2**20


class _SwapsABuffer:
    """A step that frees the buffer the step before made, then makes one of the same size."""

    def __init__(self) -> None:
        self.held = torch.ones(4 * MB // 4)

    def step(self) -> None:
        self.held = None
        self.held = torch.ones(4 * MB // 4)


class _GrowsThenShrinks:
    """A step that, at its peak, holds 8 MB more than at its start."""

    def step(self) -> None:
        extra = torch.ones(8 * MB // 4)
        del extra


def test_a_step_that_frees_earlier_memory_is_not_charged_for_it(fake_world):
    fake_world(2)
    assert _profile_step(_SwapsABuffer())["peak_mb"] < 0.5, "the freed 4 MB counted as live"
    assert abs(_profile_step(_GrowsThenShrinks())["peak_mb"] - 8.0) < 0.5
