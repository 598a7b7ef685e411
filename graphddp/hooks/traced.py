"""Communication hooks users write, traced into the backward graph once per bucket.

DDP's ``register_comm_hook(state, hook)`` runs ``hook(state, bucket)`` eagerly for every bucket.
graphddp takes the same pair, ``comm_hook=(state, hook)``, and traces ``hook`` on the bucket's fake
values when the backward is compiled, so that it is compiled and overlapped like any bucket; it
returns the averaged flat tensor, not a Future (docs/comm-hooks.md has an example and the rules).
A hook may use torch ops, ``_functional_collectives`` on ``bucket.group`` and Python control flow
on shapes and its ``state`` (read at compile time). Refused, naming the hook and the call: eager
collectives, reading tensor values in Python, tensors from outside its inputs (baked in as
constants), random numbers (ranks would disagree), another group.

``bucket.state_tensor(name, shape)`` declares a tensor graphddp keeps per bucket across steps
(:class:`HookState`, saved by ``GraphDDP.state_dict()``): a graph input, written in place. So a
hook is traced twice, once to learn its state and once for the graph, and must be a pure function
of its inputs and ``state``. Its last stage of collectives is issued with the bucket and waited at
the bucket's wait point; earlier stages (PowerSGD's P) complete at the issue point.
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
    """What a traced hook sees: DDP's ``GradBucket`` vocabulary, on fake tensors. ``buffer()`` is
    the bucket's local gradients, flat and not divided by the world size (as DDP hands it to a
    hook), in fresh memory the hook may write; ``gradients()`` are views into it."""

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
    """A communication hook traced into the graph. Subclasses (``graphddp.hooks.PowerSGD``) may
    have phases: variants of the backward compiled on first use (``"allreduce"``: graphddp's own)."""

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
    """The state tensors of every bucket's hook, graph inputs keyed ``"g{graph}.b{bucket}.{name}"``:
    indices are deterministic for a model and its options, so a checkpoint restores into the same
    slots in a new process (loaded state waits for its graph to compile). A recompiled graph's
    bucket with the same wire layout shares the replaced bucket's state (:meth:`share`), as DDP
    keeps one state per bucket whatever Dynamo compiles: PowerSGD's error feedback goes on."""

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
