"""What one compiled graph's backward can run, as data: the variants a
:class:`~graphddp.runtime.dispatch.BackwardDispatch` chooses between (:class:`Synced`, with its
:class:`InGraphUpdate` when an optimizer is attached), and the state the graph's forward wrapper
shares with it (:class:`GraphState`). Apart from the dispatcher because the compiler builds them
and the dispatcher only reads them: what a variant is, not which one runs.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from graphddp.graph.bucket_function import write_fn
from graphddp.runtime.agree import layout_hash
from graphddp.runtime.usage import NoneOutputs
from graphddp.values.schedule import Schedule

if TYPE_CHECKING:
    from graphddp.optim.attached import AttachedOptimizer
    from graphddp.runtime.step import NotInside

_COMPILED_BACKWARD = "CompiledFunctionBackward"


class GraphState:
    """Shared by one compiled graph's forward wrapper and its backward dispatcher."""

    def __init__(self) -> None:
        self._local_next = False  # set by a pre-hook right before the node's backward runs
        self.plain_compiles = 0  # how often the communication-free backward was compiled
        self.held = 0  # gated backwards whose agreement held the buckets (graphddp.runtime.gate)

        self._renamed: dict[str, str] | None = None  # the next backward's parameters, when not the compiled ones
        self.none_outputs = NoneOutputs()  # which output gradients the next backward got as None

    def mark_local(self, _grad_outputs: Any = None) -> None:
        self._local_next = True

    def take_local(self) -> bool:
        local, self._local_next = self._local_next, False
        return local

    def rename_next(self, names: dict[str, str]) -> None:
        self._renamed = names

    def take_renamed(self) -> dict[str, str] | None:
        names, self._renamed = self._renamed, None
        return names


def compiled_backward_node(outputs: Iterable[Any], inputs: Iterable[Any]) -> Any:
    """The autograd node this call of a compiled graph created, or None: the first
    ``CompiledFunctionBackward`` from the outputs (through AOTAutograd's view nodes), never past a
    node an input already had, which belongs to an earlier graph."""
    earlier = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in earlier:
            continue
        seen.add(node)
        if node.name() == _COMPILED_BACKWARD:
            return node
        todo.extend(next_node for next_node, _ in node.next_functions)
    return None


@dataclasses.dataclass
class InGraphUpdate:
    """How one graph's variant that updates inside runs the attached optimizer, in every mode: its
    update's inputs after the graph's own, and the variant without the update for the steps it is
    not the whole step (``not_inside``)."""

    attached: "AttachedOptimizer"
    names: tuple[str, ...]  # parameters the graph updates, in its input order
    not_inside: Callable[[frozenset[str]], "NotInside | None"]  # why this step may not update inside the graph (given the unused)
    compile_grads: Callable[[], Callable[[list[Any]], Any]]  # the variant without the update
    writes: tuple[tuple[int, str], ...]  # backward inputs the update writes, each a parameter's memory
    grads: Callable[[list[Any]], Any] | None = None
    writes_checked: bool = False
    shards: tuple[Any, ...] = ()  # sharded buckets' layouts (graphddp.optim.shard_functions.ShardLayout)

    def __post_init__(self) -> None:
        self.groups = tuple(sorted({self.attached.group_of[n] for n in self.names}))  # whose hyperparameters it reads

    @property
    def deferred_shards(self) -> list[Any]:
        """The sharded buckets whose all-gathers the backward returns, in output order
        (gather="forward": the next forward completes them, :mod:`graphddp.runtime.gathers`)."""
        return [s for s in self.shards if s.bucket.gather == "forward"]

    @torch.no_grad()
    def write_deferred(self, tensors: list[torch.Tensor]) -> None:
        """Where no forward graph can take the deferred all-gathers: eagerly, what the forward
        slot does in its graph: wait, then write the parameters."""
        for shard, gathered in zip(self.deferred_shards, tensors):
            write_fn(shard.bucket, shard.placement)(gathered, *(self.attached.params[n].detach() for n in shard.bucket.param_names))

    def after(self, args: list[Any]) -> Any:
        """The variant without the update: the gradients returned, for torch's step after the backward."""
        if self.grads is None:
            self.grads = self.compile_grads()
        return self.grads(args)

    def inside(self, code: Callable[[], Callable[[list[Any]], Any]], args: list[Any], carry: Sequence[torch.Tensor] = ()) -> Any:
        """``code()``, the variant that updates, on ``args`` and the update's inputs (state created as
        torch creates it); with ``carry`` (full sharding's carrying variant), those parameters'
        accumulated gradients after them, added in, stepped, and so gone from ``grad``."""
        extra = self.attached.update_args(self.names, self.groups, self.shards)
        args.extend(extra.tensors)  # the same list: the callee frees what it no longer needs
        args.extend(p.grad if p.grad is not None else torch.zeros_like(p) for p in carry)
        if not self.writes_checked:
            self.check_writes(args)
        with torch.no_grad():
            out = code()(args)
        for p in carry:
            p.grad = None
        self.attached.updated(extra)
        return out

    def check_writes(self, args: list[Any]) -> None:
        """Once: each input the update writes a parameter through really is that parameter's
        memory (an update written into a copy would leave the parameter as it was)."""
        for index, name in self.writes:
            param = self.attached.params[name]
            if args[index].untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
                raise RuntimeError(
                    f"graphddp: backward input {index} was traced as the memory of {name!r} but is not; "
                    "the in-graph update would miss it. Please report this with the model."
                )
        self.writes_checked = True


@dataclasses.dataclass
class Synced:
    """One synchronising variant of a graph's backward (one per hook phase): its plan, its code
    (compiled on first use), its in-graph update, and the state tensors a user's hook reads."""

    schedule: Schedule
    compile: Callable[[], Callable[[list[Any]], Any]]
    update: InGraphUpdate | None = None
    hook_args: Callable[[], list[torch.Tensor]] = list
    fn: Callable[[list[Any]], Any] | None = None

    def __post_init__(self) -> None:
        # Checked before every synchronising step, computed once: the layout never changes.
        self.digest = layout_hash(self.schedule.wire_layout())
        self.steady = _steady_shape(self.schedule)  # renaming a schedule keeps its buckets' shape
        self.what = f"backward graph {self.schedule.graph_index}"

    def code(self) -> Callable[[list[Any]], Any]:
        if self.fn is None:
            self.fn = self.compile()
        return self.fn


def _steady_shape(schedule: Schedule) -> tuple[int, torch.dtype] | None:
    """A gated graph's one bucket, ``(numel, dtype)``, where its agreement can ride in the bucket's
    all-reduce once its position is steady; None elsewhere."""
    if not schedule.agreement_in_bucket:
        return None
    (bucket,) = schedule.buckets
    return bucket.numel, getattr(torch, bucket.dtype.removeprefix("torch."))
