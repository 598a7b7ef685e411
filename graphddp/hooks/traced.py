"""Communication hooks users write, traced into the backward graph once per bucket.

DDP's ``register_comm_hook(state, hook)`` runs ``hook(state, bucket)`` eagerly for every
bucket and gets a Future back. graphddp takes the same pair, ``comm_hook=(state, hook)``, but
*traces* ``hook`` on the bucket's fake values when the backward graph is compiled, so what it
does is compiled into the graph and overlapped like any bucket. The vocabulary is DDP's; the
one difference is that the hook returns the averaged flat tensor, not a Future::

    import torch.distributed._functional_collectives as funcol

    def int8_hook(state, bucket):                   # bucket: GradBucket (below)
        flat = bucket.buffer()                      # the local, un-averaged gradients
        scale = funcol.all_reduce(flat.abs().amax(), "max", bucket.group) / 127
        q = (flat / scale).round().to(torch.int8)
        total = funcol.all_reduce(q.to(torch.int32), "sum", bucket.group)
        return total.to(flat.dtype) * scale / bucket.world_size

    model = graphddp.compile(model, comm_hook=(None, int8_hook))

What a traced hook may do: torch ops on ``bucket.buffer()``, ``bucket.gradients()`` and its
state tensors; collectives from ``torch.distributed._functional_collectives`` on
``bucket.group`` (they become ``_c10d_functional`` ops and ``wait_tensor``\\ s in the graph);
Python control flow on shapes, on ``bucket.index()`` and on the hook's own ``state`` object
(read when the graph is compiled: a change later does not reach the compiled graph). What it
may not do, each refused with an error that names the hook and the call: eager collectives
(``torch.distributed.all_reduce``, futures), reading tensor values in Python (``.item()``,
``if tensor:``), tensors from outside its inputs (they would be baked in as constants, the
parameters' values included), random numbers (ranks would disagree), collectives on a group
other than ``bucket.group``.

State. ``bucket.state_tensor(name, shape)`` declares a tensor graphddp keeps for this bucket
across steps (zero-filled at first). It is an input of the graph; write it in place
(``t.copy_(new)``) and the next step reads the new value. graphddp owns these tensors
(:class:`HookState`): ``GraphDDP.state_dict()`` saves them under the key
``"graphddp_comm_hook"`` and ``load_state_dict`` restores them. A hook declares its state by
calling ``state_tensor`` while it is traced, so it is traced twice: once to learn its state,
once for the graph (it must be a pure function of its inputs and ``state``).

Where the pieces run. A bucket's hook is one traced function; graphddp splits it in two. The
collectives that no other collective of the hook depends on (its last stage) are issued right
after the bucket's gradients are ready, with everything they depend on; their waits and what
follows run at the bucket's wait point (by default the end of the backward). A one-collective
hook therefore overlaps exactly like DDP's default hook; an earlier stage (a max for the
scale, PowerSGD's P) runs to completion at the issue point.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from graphddp.values.schedule import Bucket

HookFunction = Callable[[Any, "GradBucket"], torch.Tensor]
HOOK_STATE_KEY = "graphddp_comm_hook"  # the state_dict key the hook's state is saved under


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state tensor a hook declared for a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class GradBucket:
    """What a traced hook sees: DDP's ``GradBucket`` vocabulary, on fake tensors.

    ``buffer()`` is the bucket's local gradients, flattened in slot order and *not* divided
    by the world size (as DDP hands it to a hook): the hook averages. It is fresh memory, so
    the hook may write it in place. ``gradients()`` are views into it, one per parameter.
    """

    def __init__(
        self, bucket: Bucket, flat: torch.Tensor, group: Any, world_size: int, is_last: bool,
        parameters: Sequence[nn.Parameter], states: Sequence[torch.Tensor] | None,
    ) -> None:
        self._bucket = bucket
        self._flat = flat
        self.group = group
        self.world_size = world_size
        self._is_last = is_last
        self._parameters = list(parameters)
        self._states = states  # None while the hook is traced to learn its state
        self.declared: list[StateSpec] = []

    def buffer(self) -> torch.Tensor:
        return self._flat

    @property
    def plan(self) -> Bucket:
        """The Schedule's bucket: slots (names, shapes, offsets), dtype, index."""
        return self._bucket

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        """The last bucket of this backward graph (DDP: of the backward)."""
        return self._is_last

    def gradients(self) -> list[torch.Tensor]:
        return [
            self._flat[off:off + slot.numel].view(slot.shape) for slot, off in zip(self._bucket.slots, self._bucket.offsets())
        ]

    def parameters(self) -> list[nn.Parameter]:
        """The bucket's parameters, for their shapes and names; reading their values is refused."""
        return list(self._parameters)

    def parameter_names(self) -> tuple[str, ...]:
        return self._bucket.param_names

    def state_tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """This bucket's persistent tensor ``name`` (zeros at first); write it with ``copy_``."""
        if any(s.name == name for s in self.declared):
            raise ValueError(f"state_tensor({name!r}) declared twice for bucket {self.index()}")
        spec = StateSpec(name, tuple(int(s) for s in shape), dtype or self._flat.dtype, self._flat.device)
        self.declared.append(spec)
        if self._states is None:
            return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        return self._states[len(self.declared) - 1]


class TracedHook:
    """A communication hook traced into the graph: ``(state, hook)`` as DDP takes them.

    Subclasses (``graphddp.hooks.PowerSGD``) may have phases: a phase is a variant of the
    backward graph compiled on first use (``"allreduce"``: graphddp's built-in average).
    """

    def __init__(self, state: Any, hook: HookFunction, name: str | None = None) -> None:
        if not callable(hook):
            raise TypeError(f"comm_hook: the hook of (state, hook) must be callable, got {type(hook).__name__}")
        self.state = state
        self.hook = hook
        self.name = name or getattr(hook, "__name__", None) or type(hook).__name__

    def __repr__(self) -> str:
        return f"TracedHook({self.name})"

    phases: tuple[str, ...] = ("hook",)

    def phase(self) -> str:
        """Which phase the coming synchronising step runs (read before every step)."""
        return "hook"

    def __call__(self, bucket: GradBucket) -> torch.Tensor:
        return self.hook(self.state, bucket)

    # -- what the runtime calls around a step; a stateless hook does nothing -----------------
    def before_step(self, states: "HookState", graph_index: int, schedule: Any) -> None:
        """Eager work before a synchronising step runs this graph (PowerSGD draws Q here)."""

    def after_backward(self) -> None:
        """Once per synchronising backward, at its end (PowerSGD counts iterations here)."""

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


def as_traced_hook(value: Any) -> TracedHook | None:
    """``comm_hook=`` normalised: a TracedHook for ``(state, hook)`` or a TracedHook, else None."""
    if isinstance(value, TracedHook):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return TracedHook(*value)
    if callable(value):
        raise TypeError(
            "comm_hook: pass a hook as (state, hook), as DDP's register_comm_hook takes them: "
            f"comm_hook=(None, {getattr(value, '__name__', 'hook')})"
        )
    return None


class HookState:
    """The state tensors of every bucket's hook, owned by graphddp: graph inputs per step.

    Keyed ``"g{graph}.b{bucket}.{name}"`` (graph and bucket indices are deterministic for a
    model and its options, so a checkpoint restores into the same slots in a new process).
    Loaded state waiting for a graph that is not compiled yet is kept until it is. A bucket of
    a recompiled graph that puts the same gradients on the wire as a bucket of the graph it
    replaces shares that bucket's state (:meth:`share`), as DDP's hook keeps one state per
    bucket whatever Dynamo compiles: PowerSGD's error feedback and warm-started Q go on.
    """

    def __init__(self, hook: TracedHook) -> None:
        self.hook = hook
        self.tensors: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._owners: dict[tuple[int, int], tuple[int, int]] = {}

    def share(self, graph_index: int, bucket_index: int, owner: tuple[int, int]) -> None:
        """Bucket ``bucket_index`` of graph ``graph_index`` uses the state of ``owner``'s bucket."""
        if owner != (graph_index, bucket_index):
            self._owners[(graph_index, bucket_index)] = owner

    def owner(self, graph_index: int, bucket_index: int) -> tuple[int, int]:
        """The (graph, bucket) whose state this bucket uses: itself unless shared."""
        return self._owners.get((graph_index, bucket_index), (graph_index, bucket_index))

    def key(self, graph_index: int, bucket_index: int, name: str) -> str:
        graph, bucket = self.owner(graph_index, bucket_index)
        return f"g{graph}.b{bucket}.{name}"

    def allocate(self, graph_index: int, bucket_index: int, specs: Sequence[StateSpec]) -> list[torch.Tensor]:
        """The real tensors for one bucket's specs (a loaded checkpoint's where there is one)."""
        out = []
        for spec in specs:
            key = self.key(graph_index, bucket_index, spec.name)
            if key not in self.tensors:
                value = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
                loaded = self._pending.pop(key, None)
                if loaded is not None:
                    if tuple(loaded.shape) != spec.shape:
                        raise ValueError(f"{HOOK_STATE_KEY}: checkpoint's {key} is {list(loaded.shape)}, the hook declares {list(spec.shape)}")
                    value.copy_(loaded)
                self.tensors[key] = value
            out.append(self.tensors[key])
        return out

    def of(self, graph_index: int, bucket_index: int) -> list[torch.Tensor]:
        """One bucket's tensors, in the order its hook declared them (the order allocated)."""
        prefix = self.key(graph_index, bucket_index, "")
        return [t for k, t in self.tensors.items() if k.startswith(prefix)]

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": {k: t.detach().clone() for k, t in self.tensors.items()}, "hook": self.hook.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.get("tensors", {}).items():
            if key in self.tensors:
                self.tensors[key].copy_(value)
            else:
                self._pending[key] = value
        self.hook.load_extra_state(state.get("hook", {}))
