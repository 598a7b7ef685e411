"""Overlap survives into what runs: compute sits between every bucket's all-reduce and wait.

Checked on the code that executes, not on the FX graph graphddp wrote: inductor's
generated wrapper code, and the graph aot_eager runs. Uses a fake 8-rank process group in
this process (the generated code does not depend on real communication).
"""
from __future__ import annotations

import re

import torch

import graphddp
from graphddp.graph.codeinspect import windows_in_generated_code, windows_in_graph
from graphddp.models import MLP
from graphddp.runtime import failures

_ALLOC = re.compile(r"(buf\d+) = empty_strided_\w+\(\((\d+), \)")
_COLLECTIVE = re.compile(r"_c10d_functional\.(all_reduce_|wait_tensor)\.default\((buf\d+)")


def _compile_and_step(backend: str):
    torch.manual_seed(0)
    model = graphddp.compile(MLP(width=128, depth=6), backend=backend, bucket_cap_mb=0.1, first_bucket_cap_mb=0.05)
    model(torch.randn(8, 16)).sum().backward()
    (record,) = model.records
    return record


def _assert_overlapped(windows, num_buckets):
    assert len(windows) == num_buckets
    # Every bucket but the last (ready only when the backward ends) has compute in flight.
    assert all(w.kernels_in_flight > 0 for w in windows[:-1]), windows
    # Earlier buckets hide behind more work than later ones.
    counts = [w.kernels_in_flight for w in windows]
    assert counts == sorted(counts, reverse=True), counts


def test_inductor_generated_code_keeps_overlap(fake_world, tmp_path):
    fake_world(8)
    record = _compile_and_step("inductor")
    assert record.generated_code and "all_reduce_" in record.generated_code
    assert record.schedule.num_buckets >= 3
    _assert_overlapped(windows_in_generated_code(record.generated_code), record.schedule.num_buckets)
    _assert_collective_lines_name_their_buckets(record, tmp_path)


def _assert_collective_lines_name_their_buckets(record, tmp_path) -> None:
    """graphddp.runtime.failures maps a failing collective line to its bucket by issue order: check
    that the k-th all-reduce of the code that runs reduces a buffer of bucket k's size."""
    path = tmp_path / "generated.py"
    path.write_text(record.generated_code)
    lines = record.generated_code.splitlines()
    sizes = {m.group(1): int(m.group(2)) for m in map(_ALLOC.search, lines) if m}
    seen = []
    for lineno, line in enumerate(lines, start=1):
        if m := _COLLECTIVE.search(line):
            ordinal, phase = failures._bucket_of_line(str(path), lineno)
            assert phase == ("issue" if m.group(1) == "all_reduce_" else "wait")
            assert sizes[m.group(2)] == record.schedule.buckets[ordinal].numel, (line, ordinal)
            seen.append((phase, ordinal))
    n = record.schedule.num_buckets
    assert sorted(seen) == sorted([("issue", k) for k in range(n)] + [("wait", k) for k in range(n)])


def test_aot_eager_graph_keeps_overlap(fake_world):
    fake_world(8)
    record = _compile_and_step("aot_eager")
    _assert_overlapped(windows_in_graph(record.graph), record.schedule.num_buckets)


def test_window_parser_sees_collapsed_waits():
    """The analysis must be able to fail: back-to-back all-reduce/wait reports zero overlap."""
    source = """
    def call(self, args):
        cpp_fused_0(buf0)
        torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '0')
        torch.ops._c10d_functional.wait_tensor.default(buf0)
        extern_kernels.mm(buf1, buf2, out=buf3)
        torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '0')
        cpp_fused_1(buf4)
        torch.ops._c10d_functional.wait_tensor.default(buf3)
    """
    windows = windows_in_generated_code(source)
    assert [(w.buffer, w.kernels_in_flight) for w in windows] == [("buf0", 0), ("buf3", 1)]
