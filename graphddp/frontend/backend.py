"""graphddp for pipelines that own their ``torch.compile`` call.

Trainers and frameworks call ``torch.compile`` themselves, on whatever model they are handed,
often with a backend given as an object or as a string. Two forms fit them:

* ``torch.compile(model, backend=graphddp.backend(model, process_group=..., **options))``:
  :func:`backend` does at once what ``graphddp.compile`` does at wrap time (parameter
  agreement, the broadcast) and returns a torch.compile backend. It wraps ``model.forward``
  (an instance attribute, removed by :meth:`GraphDDPCompileBackend.remove`) with the
  per-forward work of :class:`~graphddp.frontend.replica.Replica` (buffer broadcast, the average of
  gradients accumulated under :meth:`GraphDDPCompileBackend.no_sync`, the uncovered-parameter
  guard), which runs eagerly, graph breaks before and after the compiled forward. DDP's
  ``no_sync()``, ``require_backward_grad_sync`` and ``register_comm_hook`` are the backend
  object's: there is no wrapper module to carry them, and the switch set on the model itself
  (``torch.compile``'s module forwards attributes to it) is refused at the next forward,
  since nothing would read it.
* ``torch.compile(model, backend="graphddp")``: the same, for code that takes a backend name.
  The name finds the :func:`backend` made for the model the graph's parameters belong to, so
  call ``graphddp.backend(model, ...)`` first (it carries the process group and the options).

``torch.compile``'s ``mode`` and ``options`` reach graphddp's inductor compile in both forms
(``fullgraph`` and ``dynamic`` are torch.compile's own and apply as usual).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from graphddp.config import DDPConfig
from graphddp.frontend.replica import Replica, ReplicaView
from graphddp.frontend.full import compile_fully_sharded
from graphddp.frontend.mesh import resolve_mesh
from graphddp.frontend.wrap import prepare, resolve_group
from graphddp.optim.attached import AttachedOptimizer

NAME = "graphddp"  # the registered backend name


class _Backends:
    """The process-wide registry the name ``"graphddp"`` looks in: every
    :class:`GraphDDPCompileBackend` made, most recent last. Why process-wide: Dynamo calls a
    backend registered by name with the graph alone, so the name must find the backend made
    for that graph's model. Lifetime: each entry is a weak reference, kept while its backend
    lives; dead ones are dropped whenever a backend is added."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def add(self, backend: "GraphDDPCompileBackend") -> None:
        self._refs = [ref for ref in self._refs if ref() is not None]
        self._refs.append(weakref.ref(backend))

    def attached(self) -> list["GraphDDPCompileBackend"]:
        """The live, attached backends, most recent first."""
        return [b for b in (ref() for ref in reversed(self._refs)) if b is not None and b.attached]


BACKENDS = _Backends()


class _BoundBackend:
    """What every ``graphddp.backend`` object is: a torch.compile backend bound to one model,
    whose forward it wraps with its mode's per-forward work, found by the name ``"graphddp"``
    for that model's graphs."""

    module: nn.Module

    def _bind(self, module: nn.Module, before: Callable[[tuple, dict], tuple[tuple, dict]], after: Callable[[Any], Any]) -> None:
        """Put the mode's per-forward work around ``module.forward`` (an instance attribute):
        ``before(args, kwargs)`` returns the arguments the forward runs on, ``after(out)`` what
        it returns.

        Not forward hooks: ``torch.compile`` runs those outside Dynamo only for user classes;
        for a torch.nn class (``nn.Sequential``) it traces them, and a Dynamo-disabled hook
        inside the traced call would make the whole forward run eagerly, uncompiled. A wrapper
        defined here is traced like user code: the two disabled calls are graph breaks before
        and after the compiled forward.
        """
        self.module = module
        self._param_ids = {id(p) for p in module.parameters()}
        original = module.forward  # the bound method, or a forward the user set on the instance

        def before_forward(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if _SWITCH in module.__dict__:  # set through torch.compile's module, it lands here
                raise RuntimeError(
                    f"graphddp.backend: {_SWITCH} was set on the model, where nothing reads it; in this form the "
                    f"switch is the graphddp.backend object's (backend.{_SWITCH} = ..., or backend.no_sync()); "
                    f"delete the model's attribute (del model.{_SWITCH})"
                )
            return before(args, kwargs)

        first = torch._dynamo.disable(before_forward, reason=_WRAPPER_REASON)
        last = torch._dynamo.disable(after, reason=_WRAPPER_REASON)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = first(args, kwargs)
            return last(original(*args, **kwargs))

        self._restore = module.__dict__.get("forward", _UNSET)
        module.forward = forward
        BACKENDS.add(self)

    @property
    def attached(self) -> bool:
        """Until :meth:`remove`: the model's forward is wrapped and the name finds this backend."""
        return self._restore is not _DETACHED

    def owns(self, tensors: Sequence[Any]) -> bool:
        return any(isinstance(t, nn.Parameter) and id(t) in self._param_ids for t in tensors)

    def remove(self) -> None:
        """Detach from the model: restore its forward; the name no longer finds this backend."""
        if not self.attached:
            return
        if self._restore is _UNSET:
            del self.module.forward
        else:
            self.module.forward = self._restore
        self._restore = _DETACHED
        self._param_ids = set()


class GraphDDPCompileBackend(ReplicaView, _BoundBackend):
    """A torch.compile backend bound to one model: ``torch.compile(model, backend=this)``.

    Made by :func:`backend`. Holds the model's :class:`~graphddp.frontend.replica.Replica`, so the same
    inspection as a ``graphddp.compile`` module is here: ``config``, ``schedules``, ``records``,
    ``world_size``, and DDP's ``no_sync()``, ``require_backward_grad_sync``,
    ``register_comm_hook`` and ``join()``.
    """

    def __init__(self, module: nn.Module, group: Any, config: DDPConfig, optimizer: AttachedOptimizer | None = None) -> None:
        self._replica = Replica(module, group, config, optimizer)
        self._joinable()
        replica = self._replica

        def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            replica.before_forward()
            return args, kwargs

        def after(out: Any) -> Any:
            replica.after_forward(out)
            return out

        self._bind(module, before, after)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
        return self._replica.compile_graph(gm, example_inputs, **compile_kwargs)


class FullyShardedCompileBackend(_BoundBackend):
    """``graphddp.backend(model, optimizer=opt, sharding="full")``: the model's parameters become
    this rank's parts now (:mod:`graphddp.frontend.parts`), its forward checks that every rank
    runs it, and ``torch.compile(model, backend=this)`` compiles its graphs as
    ``graphddp.compile(..., sharding="full")`` does. ``model.state_dict()`` gives whole tensors
    and ``model.load_state_dict`` takes them (every rank calls both:
    :mod:`graphddp.frontend.full_state`); ``model.parameters()`` are the parts the optimizer
    steps. The inspection of the compiled module is here: ``config``, ``schedules``, ``graphs``,
    ``parts``, ``updates``, ``world_size``, ``no_sync()``, ``require_backward_grad_sync``."""

    def __init__(self, module: nn.Module, groups: Any, config: DDPConfig, optimizer: Any) -> None:
        self.sharded = compile_fully_sharded(module, groups, config, optimizer, where="graphddp.backend", own_compile=False)
        self._bind(module, self.sharded.before_forward, self.sharded.after_forward)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
        return self.sharded.compile_graph(gm, example_inputs, **compile_kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _FULL_VIEW:
            return getattr(self.__dict__["sharded"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.sharded.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.sharded.require_backward_grad_sync = value


# What the backend object of sharding="full" shows of the module graphddp.compile would return.
_FULL_VIEW = frozenset({
    "config", "schedules", "graphs", "parts", "updates", "world_size", "no_sync", "optimizer", "process_group",
    "full_optimizer_state_dict", "load_full_optimizer_state_dict", "join", "register_comm_hook",
})


_UNSET, _DETACHED = object(), object()
_SWITCH = "require_backward_grad_sync"  # DDP's attribute: this form keeps it on the backend object
_WRAPPER_REASON = "graphddp's per-forward work (buffer broadcast, no_sync average, guard) runs eagerly"


def backend(
    module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, **options: Any,
) -> GraphDDPCompileBackend | FullyShardedCompileBackend:
    """A torch.compile backend doing graphddp's job for ``module`` (see the module docstring).

    ``options`` are ``graphddp.compile``'s (DDPConfig's fields), and so is ``optimizer`` (the
    update inside the backward, :mod:`graphddp.optim.attached`). Parameters are broadcast from the
    group's first rank now, as by ``graphddp.compile``; ``device_mesh`` as there.
    """
    resolve_group("graphddp.backend", module, process_group, options)
    config = DDPConfig.from_options("graphddp.backend", options)
    groups = resolve_mesh("graphddp.backend", device_mesh, process_group, config.sharding)
    if config.sharding == "full":
        return FullyShardedCompileBackend(module, groups, config, optimizer)
    attached, config = prepare("graphddp.backend", module, groups.whole, config, optimizer, groups)
    return GraphDDPCompileBackend(module, groups.whole, config, attached)


def _by_name(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """``backend="graphddp"``: hand the graph to the backend made for its parameters' model.

    A graph with no parameter among its inputs (after a graph break, say the loss) has no
    gradient to average: the most recently made backend compiles it, with its options.
    """
    live = BACKENDS.attached()
    owner = next((b for b in live if b.owns(example_inputs)), None)
    if owner is None and live and not any(isinstance(t, nn.Parameter) for t in example_inputs):
        owner = live[0]
    if owner is None:
        raise RuntimeError(
            "graphddp: torch.compile(..., backend='graphddp') compiled a model graphddp has not prepared; "
            "call graphddp.backend(model, process_group=..., **options) once before torch.compile (it "
            "broadcasts the parameters and carries the options), then pass backend='graphddp' or that object"
        )
    return owner(gm, example_inputs, **compile_kwargs)


def register() -> None:
    """Register the name ``"graphddp"`` with Dynamo (done on ``import graphddp``)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if NAME not in _COMPILER_FNS:
        register_backend(_by_name, name=NAME)
