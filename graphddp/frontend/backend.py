"""graphddp for pipelines that own their ``torch.compile`` call (docs/compiled-pipelines.md).

* ``torch.compile(model, backend=graphddp.backend(model, **options))``: :func:`backend` does the
  wrap-time work of ``graphddp.compile`` now and wraps ``model.forward`` with the mode's
  per-forward work, which runs eagerly, graph breaks around the compiled forward. DDP's switches
  (``no_sync()``, ``require_backward_grad_sync``, ``register_comm_hook``) are the backend object's.
* ``torch.compile(model, backend="graphddp")``: the same for code that takes a backend name, which
  finds the :func:`backend` made for the graph's model: call ``graphddp.backend`` first.

``torch.compile``'s ``mode`` and ``options`` reach graphddp's inductor compile in both forms.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from graphddp.frontend.api import ModelView, build_state
from graphddp.frontend.wrap import ModelState

NAME = "graphddp"  # the registered backend name


# Every GraphDDPCompileBackend made, weakly, most recent last (a dict keeps its order): process-wide
# because Dynamo calls a backend registered by name with the graph alone.
_MADE: "weakref.WeakKeyDictionary[GraphDDPCompileBackend, None]" = weakref.WeakKeyDictionary()


class GraphDDPCompileBackend(ModelView):
    """A torch.compile backend bound to one model, with the same :class:`ModelView` surface as a
    ``graphddp.compile`` module. With ``sharding="full"`` the model's parameters are this rank's
    parts from now on; its state dicts hold whole tensors (every rank calls them)."""

    def __init__(self, module: nn.Module, state: ModelState) -> None:
        """Puts the mode's per-forward work around ``module.forward`` (an instance attribute).
        Not forward hooks: for a torch.nn class (``nn.Sequential``) Dynamo traces those, and a
        disabled hook inside would run the whole forward eagerly; this wrapper is traced like user
        code, its two disabled calls graph breaks around the compiled forward."""
        self._view(module, state)
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
        _MADE[self] = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
        return self._state.compile_graph(gm, example_inputs, **compile_kwargs)

    @property
    def attached(self) -> bool:
        return self._restore is not _DETACHED

    def owns(self, tensors: Sequence[Any]) -> bool:
        return any(isinstance(t, nn.Parameter) and id(t) in self._param_ids for t in tensors)

    def remove(self) -> None:
        """Restore the model's forward; the name no longer finds this backend."""
        if not self.attached:
            return
        if self._restore is _UNSET:
            del self.module.forward
        else:
            self.module.forward = self._restore
        self._restore = _DETACHED


_UNSET, _DETACHED = object(), object()
_SWITCH = "require_backward_grad_sync"  # DDP's attribute: this form keeps it on the backend object
_WRAPPER_REASON = "graphddp's per-forward work (buffer broadcast, no_sync average, guard) runs eagerly"


def backend(
    module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, example: Any = None, **options: Any,
) -> GraphDDPCompileBackend:
    """A torch.compile backend doing graphddp's job for ``module``; the arguments are
    ``graphddp.compile``'s (``sharding="auto"`` chooses now, from ``example``), and parameters are
    broadcast now as there."""
    return GraphDDPCompileBackend(
        module, build_state("graphddp.backend", module, process_group, device_mesh, optimizer, options, example)
    )


def _by_name(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """``backend="graphddp"``: the backend made for the graph's parameters' model; a graph with
    no parameter (the loss after a graph break) goes to the most recent backend."""
    live = [b for b in reversed(list(_MADE)) if b.attached]  # the most recent first
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
