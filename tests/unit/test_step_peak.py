"""tools.memory_check.step_peak trusts only steps whose frees it saw: a tensor freed on another
thread (as a gloo thread drops a collective's last reference) leaves its step's count high."""
from __future__ import annotations

import threading

import pytest
import torch

from tools.memory_check import step_peak

MB = 1 << 20


def _stepper(freed_elsewhere: set[int]):
    """Steps allocating 1 MB, freed on this thread, but those in ``freed_elsewhere``: 2 MB freed on another."""
    count = iter(range(100))

    def step() -> None:
        i = next(count)
        if i not in freed_elsewhere:
            x = torch.ones(MB // 4)
            del x
            return
        box = [torch.ones(MB // 2)]
        drop = threading.Thread(target=box.clear)
        drop.start()
        drop.join()
    return step


def test_steps_with_unseen_frees_are_not_trusted():
    # the warm step is 0; measured steps 1-3 lose their frees, 4 and 5 do not
    assert step_peak(_stepper({1, 2, 3}), measured=5) == MB


def test_no_trusted_step_is_an_error():
    with pytest.raises(RuntimeError, match="never saw freed"):
        step_peak(_stepper({1, 2}), measured=2)
