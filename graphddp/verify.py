"""The checker run after every rewrite: prove the communication in a graph is sound.

Invariants (each failure raises :class:`VerificationError` showing the offending node with
its neighbours in the graph):

1. The graph is lint-clean and topologically ordered (FX lint: every argument is defined
   before use, so the graph is acyclic).
2. Every all-reduce graphddp inserted belongs to a schedule bucket, and every bucket has
   exactly one all-reduce.
3. Every all-reduce has exactly one user, its ``wait_tensor``.
4. Nothing reads a bucket's buffer between its all-reduce and its wait, and nothing but the
   all-reduce reads the pre-reduction buffer after the all-reduce is issued.
5. Every gradient that needs synchronisation (``expected``: output index -> parameter) is
   returned as its own slice of exactly one wait, the wait of the bucket that holds it;
   no gradient is reduced twice and none is left out.

Only collectives graphddp inserted (tagged with a bucket) are checked: collectives the model
issues itself (tensor parallelism, say) are left alone. Views of a bucket buffer count as
the buffer (invariant 4).

The checker reads the graph and the schedule; it never mutates either.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.fx as fx

from graphddp.capture import output_nodes
from graphddp.comm import BUCKET_KEY, is_all_reduce, is_wait
from graphddp.schedule import Schedule


class VerificationError(RuntimeError):
    pass


def _context(gm: fx.GraphModule, node: fx.Node, radius: int = 3) -> str:
    nodes = list(gm.graph.nodes)
    i = nodes.index(node)
    lines = []
    for j in range(max(0, i - radius), min(len(nodes), i + radius + 1)):
        n = nodes[j]
        mark = ">>" if n is node else "  "
        lines.append(f"{mark} {j:4d}: {n.format_node()}")
    return "\n".join(lines)


def _fail(gm: fx.GraphModule, node: fx.Node, message: str) -> None:
    raise VerificationError(f"graphddp verify: {message}\n{_context(gm, node)}")


_VIEW_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.reshape.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.select.int,
    torch.ops.aten.alias.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
}


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view of it, transitively (they share its storage)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if u.op == "call_function" and u.target in _VIEW_OPS)
    return out


def _source(node: object) -> tuple[fx.Node | None, fx.Node | None]:
    """Follow a returned gradient back through graphddp's unflatten nodes: (wait, slice)."""
    piece = None
    while isinstance(node, fx.Node):
        if is_wait(node):
            return node, piece
        if node.meta.get(BUCKET_KEY) is None:
            return None, None
        if node.target == torch.ops.aten.slice.Tensor:
            piece = node
        node = node.args[0]
    return None, None


def verify(gm: fx.GraphModule, schedule: Schedule, expected: Mapping[int, str]) -> None:
    """Check invariants 1-5 (module docstring). ``expected``: output index -> param name."""
    gm.graph.lint()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Collectives the model itself issues (e.g. tensor parallelism) are not ours to check.
    reduces = [n for n in gm.graph.nodes if is_all_reduce(n) and BUCKET_KEY in n.meta]
    by_bucket: dict[int, fx.Node] = {}
    for ar in reduces:
        index = ar.meta.get(BUCKET_KEY)
        if not 0 <= index < schedule.num_buckets:
            _fail(gm, ar, "all-reduce that belongs to no schedule bucket")
        if index in by_bucket:
            _fail(gm, ar, f"bucket {index} is all-reduced twice")
        by_bucket[index] = ar
        users = list(ar.users)
        if len(users) != 1 or not is_wait(users[0]):
            _fail(gm, ar, f"all-reduce must have exactly one user, its wait; has {[u.name for u in users]}")
        wait = users[0]
        buffer = ar.args[0]
        for alias in _aliases(buffer):
            for reader in alias.users:
                if reader is not ar and order[reader] > order[ar]:
                    _fail(gm, reader, f"reads bucket {index}'s buffer {buffer.name} after its all-reduce was issued")
        for reader in wait.users:
            if order[reader] < order[wait]:
                _fail(gm, reader, f"reads bucket {index} before its wait")
    missing = sorted(set(range(schedule.num_buckets)) - set(by_bucket))
    if missing:
        raise VerificationError(f"graphddp verify: buckets {missing} have no all-reduce in the graph")

    bucket_of_slot = {s.output_index: b.index for b in schedule.buckets for s in b.slots}
    offset_of_slot = {
        s.output_index: (off, off + s.numel) for b in schedule.buckets for s, off in zip(b.slots, b.offsets())
    }
    outs = output_nodes(gm)
    out_node = gm.graph.output_node()
    for index, name in sorted(expected.items()):
        if index not in bucket_of_slot:
            raise VerificationError(f"graphddp verify: gradient of {name!r} (output {index}) is in no bucket")
        wait, piece = _source(outs[index])
        if wait is None:
            _fail(gm, out_node, f"gradient of {name!r} (output {index}) is returned unreduced")
        if wait.meta.get(BUCKET_KEY) != bucket_of_slot[index]:
            _fail(gm, wait, f"gradient of {name!r} comes from bucket {wait.meta.get(BUCKET_KEY)}, planned {bucket_of_slot[index]}")
        if piece is None or tuple(piece.args[2:4]) != offset_of_slot[index]:
            _fail(gm, piece or wait, f"gradient of {name!r} is not the slice {offset_of_slot[index]} of its bucket")
    extra = sorted(set(bucket_of_slot) - set(expected))
    if extra:
        raise VerificationError(f"graphddp verify: outputs {extra} are reduced but need no synchronisation")
