"""Read what finally runs: where each collective and its wait sit in the executed code.

The FX graph graphddp writes is not what runs under inductor: inductor's scheduler may
reorder nodes and pull waits up. These helpers analyse the *generated* wrapper code (and,
for the FX backends, the graph that runs) and report, for every bucket collective, how many compute
kernels execute between it and its wait. Tests assert on this, not on the FX graph.
"""
from __future__ import annotations

import dataclasses
import re

import torch.fx as fx

from graphddp.graph.capture import is_compute
from graphddp.values.collectives import WAIT_PATTERN as _WAIT, all_ops, issue_pattern
from graphddp.values.comm import is_wait

_ISSUE = issue_pattern()  # any bucket collective kind's op
_ASSIGNED = re.compile(r"^\s*(\w+) = ")
_KERNEL = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|aten\.\w+|torch\.ops\.aten\.\w+)[\.(]")


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective in executed order: its buffer and the compute run while it is in flight."""

    buffer: str
    kernels_in_flight: int


def windows_in_generated_code(source: str) -> list[Window]:
    """Collective windows in inductor's generated wrapper code, in issue order.

    An in-place collective (an all-reduce) is waited on its input buffer, an out-of-place one
    (a gather, a reduce-scatter, an all-to-all) on the buffer it returns: an issue opens its
    window under both names, and a wait on either closes it."""
    body = source.split("def call(", 1)[-1]
    open_: dict[str, tuple[int, int]] = {}  # buffer name -> (issue number, kernels run before it)
    done: list[tuple[int, Window]] = []
    kernels = issued = 0
    for line in body.splitlines():
        if m := _ISSUE.search(line):
            names = {m.group(1)} | ({a.group(1)} if (a := _ASSIGNED.match(line)) else set())
            for name in names:
                open_[name] = (issued, kernels)
            issued += 1
        elif m := _WAIT.search(line):
            if m.group(1) in open_:
                number, start = open_[m.group(1)]
                for name in [n for n, (i, _) in open_.items() if i == number]:
                    del open_[name]
                done.append((number, Window(m.group(1), kernels - start)))
        elif _KERNEL.match(line):
            kernels += 1
    if open_:
        raise ValueError(f"collectives without a wait in generated code: {sorted(open_)}")
    return [w for _, w in sorted(done, key=lambda x: x[0])]


def windows_in_graph(gm: fx.GraphModule) -> list[Window]:
    """Collective windows in an FX graph that runs as written (aot_eager / eager backends)."""
    out = []
    nodes = list(gm.graph.nodes)
    for i, node in enumerate(nodes):
        if node.op == "call_function" and node.target in all_ops():
            wait = next(u for u in node.users if is_wait(u))
            j = nodes.index(wait)
            out.append(Window(node.name, sum(is_compute(n) for n in nodes[i + 1:j])))
    return out
