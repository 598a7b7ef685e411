"""graphddp.testing.spawn, the harness of every multi-rank test: a failing rank is reported at
once, whatever the size of its traceback (a compiled graph in an error message is easily larger
than a pipe's buffer; its rank then blocked in the report until the timeout)."""
import time

import pytest
import torch.distributed as dist

from graphddp.testing import spawn


def _fail_loudly(rank: int, world: int) -> None:
    if rank == 0:
        raise RuntimeError("graph:\n" + "x" * 500_000)
    dist.barrier()  # the other rank waits for the failed one, as a collective would


def test_a_long_traceback_is_reported_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0") as failure:
        spawn(_fail_loudly, 2, timeout=100, fresh=True)
    assert "x" * 1000 in str(failure.value)
    assert time.monotonic() - start < 60, "the report waited for the timeout"
