"""graphddp for pipelines that own their ``torch.compile`` call.

Trainers and frameworks call ``torch.compile`` themselves, on whatever model they are handed,
often with a backend given as an object or as a string. Two forms fit them:

* ``torch.compile(model, backend=graphddp.backend(model, process_group=..., **options))``:
  :func:`backend` does at once what ``graphddp.compile`` does at wrap time (parameter
  agreement, the broadcast) and returns a torch.compile backend. It wraps ``model.forward``
  (an instance attribute, removed by :meth:`GraphDDPCompileBackend.remove`) with the
  per-forward work of the mode's state (replicated: :class:`~graphddp.frontend.replica.Replica`'s
  buffer broadcast, average of gradients accumulated under ``no_sync``, uncovered-parameter
  guard; fully sharded: :class:`~graphddp.frontend.full.FullyShardedState`'s), which runs eagerly, graph breaks before and after the compiled forward. DDP's
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

from graphddp.frontend.api import ModelView, build_state
from graphddp.frontend.full import FullyShardedState
from graphddp.frontend.replica import Replica

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


class GraphDDPCompileBackend(ModelView):
    """A torch.compile backend bound to one model: ``torch.compile(model, backend=this)``.

    Made by :func:`backend`, in every mode. Holds the model's state (:class:`ModelView`), so
    the same inspection and switches as a ``graphddp.compile`` module are here; it wraps the
    model's forward with the mode's per-forward work and is found by the name ``"graphddp"``
    for that model's graphs. With ``sharding="full"`` the model's parameters are this rank's
    parts from now on (:mod:`graphddp.frontend.parts`); ``model.state_dict()`` gives whole
    tensors and ``model.load_state_dict`` takes them (every rank calls both:
    :mod:`graphddp.frontend.full_state`).
    """

    def __init__(self, module: nn.Module, state: Replica | FullyShardedState) -> None:
        """Puts the mode's per-forward work around ``module.forward`` (an instance attribute):
        ``state.before_forward(args, kwargs)`` returns the arguments the forward runs on,
        ``state.after_forward(out)`` what it returns.

        Not forward hooks: ``torch.compile`` runs those outside Dynamo only for user classes;
        for a torch.nn class (``nn.Sequential``) it traces them, and a Dynamo-disabled hook
        inside the traced call would make the whole forward run eagerly, uncompiled. A wrapper
        defined here is traced like user code: the two disabled calls are graph breaks before
        and after the compiled forward.
        """
        self._state = state
        self._joinable()
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
            return state.before_forward(args, kwargs)

        first = torch._dynamo.disable(before_forward, reason=_WRAPPER_REASON)
        last = torch._dynamo.disable(state.after_forward, reason=_WRAPPER_REASON)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = first(args, kwargs)
            return last(original(*args, **kwargs))

        self._restore = module.__dict__.get("forward", _UNSET)
        module.forward = forward
        BACKENDS.add(self)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
        return self._state.compile_graph(gm, example_inputs, **compile_kwargs)

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


_UNSET, _DETACHED = object(), object()
_SWITCH = "require_backward_grad_sync"  # DDP's attribute: this form keeps it on the backend object
_WRAPPER_REASON = "graphddp's per-forward work (buffer broadcast, no_sync average, guard) runs eagerly"


def backend(
    module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, **options: Any,
) -> GraphDDPCompileBackend:
    """A torch.compile backend doing graphddp's job for ``module`` (see the module docstring).

    ``options`` are ``graphddp.compile``'s (DDPConfig's fields), and so is ``optimizer`` (the
    update inside the backward, :mod:`graphddp.optim.attached`). Parameters are broadcast from the
    group's first rank now, as by ``graphddp.compile``; ``device_mesh`` as there.
    """
    return GraphDDPCompileBackend(module, build_state("graphddp.backend", module, process_group, device_mesh, optimizer, options))


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
