"""The invariants every mode's verifier shares, stated once; each caller passes what its placement
gives (the group, which wait averages, the rule's name in that mode):

W. **Waited once.** A collective graphddp issued is read only by its one wait: read before, it is a
   buffer still on the wire; waited twice, two completions of one work (rule 1, S1, P1).
L. **One write, last.** A tensor updated inside the backward is written by exactly one ``copy_``,
   and after it nothing reads its memory but through the write: a read by the old name (the input,
   a view, an aliasing input) may be run before the write or after, as the compiler pleases (U3, S5, P4).
G. **No gradient kept.** A tensor the graph updates returns no gradient, which a loop still calling
   ``step()`` would step again (U2, S4, P4).
A. **From the average.** What an update writes, or a gather sends, depends on the wait of the
   collective that averaged it: around it, it is this rank's gradient alone (S3, S5, P4, F1).
R. **On its group.** Each collective runs on the group its placement names: on another it averages
   over the wrong ranks, or hangs (rules 3 and 12, S1, P6).
O. **Carried once.** A carried input (gradients accumulated under ``no_sync``) is read once, by the
   ``add`` into its bucket: else a micro-step is lost or counted twice (rule 7, S7).
H. **Hybrid: each part averaged over its replicas, once**, by its own bucket's all-reduce over the
   replicate group: without it a replica group steps on its own data; twice, it divides by R twice (S1, P6).
C. **One clip coefficient, read by every returned gradient** (none without ``max_grad_norm``): two
   would clip by different norms, and a gradient around it leaves unclipped (U7, S6).

Memory is told by the storage of each node's fake value, so views are found without naming each
view op. Nothing here edits a graph.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from graphddp.graph.capture import ancestors, storage_of
from graphddp.graph.verify_common import VerificationError, _fail, _names
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, group_of, is_ours, is_wait
from graphddp.values.placement import REPLICATE

aten = torch.ops.aten


def _storage(node: Any) -> int | None:
    """Identity of the memory behind a node's (fake) value; views share it."""
    return storage_of(node.meta.get("val")) if isinstance(node, fx.Node) else None


def root(node: fx.Node, storage: Callable[[Any], int | None] = _storage) -> fx.Node:
    """Follow views (first argument) back to the node whose memory they show (a write is a root)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and storage(node.args[0]) == storage(node) and node.target is not aten.copy_.default:
        node = node.args[0]
    return node


class Memory:
    """Each node's storage, computed once, and who reads and who updates each storage: asking every
    edge per updated tensor would make the verifier quadratic."""

    def __init__(self, nodes: list[fx.Node]) -> None:
        self.of: dict[fx.Node, int | None] = {n: _storage(n) for n in nodes}
        self.order = {n: i for i, n in enumerate(nodes)}
        self.readers: dict[int, list[tuple[fx.Node, fx.Node]]] = {}  # storage -> (node, the input it reads it by)
        self.updates: dict[int, list[fx.Node]] = {}  # storage -> graphddp's update copy_ nodes writing it
        for node in nodes:
            if node.op == "output":
                continue
            for arg in node.all_input_nodes:
                memory = self.of.get(arg)
                if memory is not None:
                    self.readers.setdefault(memory, []).append((node, arg))
            if node.target is aten.copy_.default and node.meta.get(ROLE_KEY) == "update":
                memory = self.of.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
                if memory is not None:
                    self.updates.setdefault(memory, []).append(node)

    def __call__(self, node: Any) -> int | None:
        return self.of.get(node) if isinstance(node, fx.Node) else None


def waited_once(gm: fx.GraphModule, issue: fx.Node, rule: str, what: str, bucket: int | None = None) -> fx.Node:
    """W for ``issue``; returns its wait. With ``bucket``, the wait must be tagged that bucket too
    (the rewrite's passes find it by its tag)."""
    users = list(issue.users)
    if len(users) != 1 or not is_wait(users[0]):
        _fail(gm, issue, f"{what}: {issue.name} must have exactly one user, its wait; has {_names(users)} ({rule})")
    if bucket is not None and not is_ours(users[0], bucket):
        _fail(gm, users[0], f"{what}: wait {users[0].name} of {issue.name} is not tagged bucket {bucket} ({rule})")
    return users[0]


def written_last(
    gm: fx.GraphModule, writes: Sequence[fx.Node], memory: Memory, rule: str, what: str, aliases: Sequence[fx.Node] = (),
) -> fx.Node:
    """L for one updated tensor written by ``writes``; returns the write. ``aliases``: other inputs
    that are the same tensor at run time (their fake values do not share its storage)."""
    if not writes:
        raise VerificationError(f"graphddp verify: {what}: no write of it, expected 1 ({rule})")
    if len(writes) > 1:
        _fail(gm, writes[0], f"{what}: {len(writes)} writes of it, expected 1 ({_names(writes)}) ({rule})")
    (write,) = writes
    targets = {memory(root(write.args[0], memory)), *(memory(a) for a in aliases)} - {None}
    for target in targets:
        for node, arg in memory.readers.get(target, ()):  # type: ignore[arg-type]
            if node is not write and memory.order[node] > memory.order[write] and root(arg, memory) is not write:
                _fail(gm, node, f"{what}: {node.name} reads its memory after {write.name} updated it ({rule})")
    return write


def not_returned(gm: fx.GraphModule, out: Any, rule: str, what: str) -> None:
    """G for one updated tensor whose gradient output is ``out``."""
    if out is not None:
        _fail(gm, out if isinstance(out, fx.Node) else gm.graph.output_node(), f"{what}: its gradient is still returned ({rule})")


def from_average(gm: fx.GraphModule, node: fx.Node, waits: Sequence[fx.Node], rule: str, what: str, source: str) -> None:
    """A: ``node`` depends on one of ``waits``, those of ``source``."""
    above = ancestors(node)
    if not any(w in above for w in waits):
        _fail(gm, node, f"{what}: {node.name} does not depend on {source}'s wait ({rule})")


def on_group(gm: fx.GraphModule, issue: fx.Node, group: object, rule: str, what: str, whose: str) -> None:
    """R: ``issue`` runs on ``group``, ``whose`` it is."""
    if group_of(issue) != group:
        _fail(gm, issue, f"{what}: {issue.name} runs on group {group_of(issue)!r}, not {whose} {group!r} ({rule})")


def over_replicas(gm: fx.GraphModule, scatter: fx.Node, reduces: Sequence[fx.Node], group: object, rule: str, what: str) -> fx.Node:
    """H for the part ``scatter`` delivers, among ``reduces``; returns the replicate all-reduce's wait."""
    done = [u for u in scatter.users if is_wait(u)]
    mine = [r for r in reduces if any(w in ancestors(r) for w in done)]
    if len(mine) != 1 or mine[0].meta.get(ROLE_KEY) != REPLICATE or mine[0].meta.get(BUCKET_KEY) != scatter.meta.get(BUCKET_KEY):
        _fail(gm, scatter, f"{what}: the part {scatter.name} reduce-scatters is all-reduced over the replicate group by "
                           f"{_names(mine)}, not once by its bucket's all-reduce ({rule})")
    on_group(gm, mine[0], group, rule, what, "the replicate group")
    return waited_once(gm, mine[0], rule, what)


def carried_once(gm: fx.GraphModule, carried: fx.Node, into: Callable[[fx.Node], bool], rule: str, what: str, by: str) -> None:
    """O: ``carried`` has one reader, a ``carry`` add for which ``into`` holds."""
    users = list(carried.users)
    if len(users) != 1 or users[0].meta.get(ROLE_KEY) != "carry" or not into(users[0]):
        _fail(gm, carried, f"{what}: the carried gradient {carried.name} is read by {_names(users)}, not once by {by} ({rule})")


def clip_coefficient(gm: fx.GraphModule, max_grad_norm: float | None, rule: str, role: str) -> fx.Node | None:
    """C: the one clip coefficient (node of ``role``), or None without ``max_grad_norm``."""
    coefs = [n for n in gm.graph.nodes if n.meta.get(ROLE_KEY) == role]
    if max_grad_norm is None:
        if coefs:
            _fail(gm, coefs[0], f"a clip coefficient in a graph whose schedule has no max_grad_norm ({rule})")
        return None
    if len(coefs) != 1:
        raise VerificationError(f"graphddp verify: max_grad_norm={max_grad_norm}: {len(coefs)} clip coefficients, expected 1 ({rule})")
    return coefs[0]


def returned_clipped(gm: fx.GraphModule, buckets: Sequence[Any], outs: Sequence[Any], clipped: set[fx.Node], rule: str) -> None:
    """C's second half: each gradient of ``buckets`` returned is among ``clipped``."""
    for bucket in buckets:
        for slot in (s for s in bucket.slots if not s.zero_filled):
            out = outs[slot.output_index]
            if isinstance(out, fx.Node) and out not in clipped:
                _fail(gm, out, f"the gradient of {slot.param_name!r} (output {slot.output_index}) is returned unclipped ({rule})")
