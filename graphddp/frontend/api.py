"""``graphddp.compile``: the user entry point, the module it returns in every mode, and the
surface it shares with ``graphddp.backend``'s object (:class:`ModelView`)."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from graphddp.compiler.aot import ISOLATED
from graphddp.compiler.record import GraphRecord, graphs_of
from graphddp.config import DDPConfig
from graphddp.frontend.auto import choose_placement
from graphddp.frontend.full import FullyShardedState
from graphddp.frontend.mesh import resolve_mesh
from graphddp.frontend.replica import Replica
from graphddp.frontend.wrap import ModelState, check_and_broadcast, check_module_and_world, check_optimizer
from graphddp.runtime.calibrate import resolve_cost
from graphddp.values.choice import PlacementChoice

_OUTER_COMPILE = (
    "a graphddp module compiles itself: an outer torch.compile (or .compile()) runs it as it is "
    "and its backend, mode and options do not apply; pass mode=/options= to graphddp.compile, or "
    "use torch.compile(model, backend=graphddp.backend(model)) to own the torch.compile call"
)


class ModelView(Joinable):
    """The surface both forms (``graphddp.compile``'s module, ``graphddp.backend``'s object) show
    of their mode's :class:`ModelState`. A ``Joinable``, so ``Join([model, ...])`` takes it."""

    _state: ModelState

    def _view(self, module: nn.Module, state: ModelState) -> None:
        """``module`` and its state, and what ``Joinable.__init__`` sets, without calling it: on a
        module it would re-run ``nn.Module.__init__``."""
        self.module = module
        self._state = state
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._state.joinable = self

    @property
    def config(self) -> DDPConfig:
        """The options, as compiled (a hook given to :meth:`register_comm_hook` included)."""
        return self._state.config

    @property
    def process_group(self) -> Any:
        """Every rank's group: the wrap-time broadcast, the forward's work, the buffers."""
        return self._state.group

    @property
    def world_size(self) -> int:
        """The ranks the gradients are averaged over (full sharding: each parameter is cut over)."""
        return self._state.world_size

    @property
    def schedules(self) -> list[Any]:
        """One per compiled graph: a ``Schedule`` per backward, or a ``FullSchedule`` per Dynamo
        graph with ``sharding="full"``; with ``sharding="auto"`` each carries the choice."""
        choice = self._state.choice
        return [s if choice is None else dataclasses.replace(s, choice=choice) for s in self._state.schedules]

    @property
    def placement_choice(self) -> PlacementChoice | None:
        """``sharding="auto"``'s choice: every placement weighed, its predictions and verdict (None when sharding was given)."""
        return self._state.choice

    @property
    def records(self) -> list[GraphRecord]:
        """One per compiled backward graph, in every mode: its plan, the rewritten graph, its
        variants and, under inductor, the generated code."""
        return [r for r in self._state.records if r.kind == "backward"]

    @property
    def graphs(self) -> list[tuple[str, Any]]:
        """Every compiled forward and backward graph and its variants, in order, as (kind, graph)."""
        return graphs_of(self._state.records)

    @property
    def parts(self) -> dict[str, Any]:
        """The parameters this rank holds a part of, by name: with ``sharding="full"`` every one (tied
        weights: each of their names); in the other modes none, every rank holds them whole."""
        return self._state.parts

    @property
    def updates(self) -> dict[str, int]:
        """With an optimizer inside the backward, in every mode: how many synchronising backwards
        updated inside (``"inside"``; ``"inside, carried"`` where full sharding's parts held an
        accumulated gradient) and how many left the update to torch's step, by reason."""
        return self._state.updates

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch (nanoGPT sets it per micro-step), read at every forward: a forward run
        while it is False does not synchronise its backward, as under :meth:`no_sync`."""
        return self._state.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._state.sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients, as DDP's do: what counts is
        where the *forward* runs. Fully sharded, such a backward still reduce-scatters but does not
        update the parts: ``opt.step()`` after the synchronising micro-step steps them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook``, once, before the first forward: DDP's own hooks become
        their in-graph equivalents, any other is traced like ``comm_hook=(state, hook)``."""
        self._state.register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
        """DDP's context manager for uneven inputs (:mod:`graphddp.runtime.join`)."""
        return self._state.join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._state.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        from graphddp.runtime.agree import _device

        return _device(self._state.group)

    join_process_group = process_group

    def finish_gathers(self) -> None:
        """With ``gather="forward"`` the parameters are updated only once the next forward completes
        the backward's all-gathers: code touching them in between calls this first."""
        self._state.finish_gathers()

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """:func:`full_optimizer_state_dict` of this model."""
        return full_optimizer_state_dict(self)

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """:func:`load_full_optimizer_state_dict` into this model."""
        load_full_optimizer_state_dict(self, state)


class GraphDDP(ModelView, nn.Module):
    """A data-parallel module whose compiled graphs carry their own collectives. It shares
    parameters with ``self.module``, and its state dicts use that module's keys, so checkpoints move
    freely between a plain model and a graphddp one (fully sharded: every rank calls them)."""

    def __init__(self, module: nn.Module, state: ModelState) -> None:
        super().__init__()
        self._view(module, state)
        config = state.config
        # Stored outside the module registry so parameters are not listed twice.
        object.__setattr__(
            self, "_compiled", torch.compile(module, backend=state.compile_graph, fullgraph=config.fullgraph, dynamic=config.dynamic, **ISOLATED)
        )

    @torch._dynamo.disable(reason=_OUTER_COMPILE)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._state.before_forward(args, kwargs)
        return self._state.after_forward(self._compiled(*args, **kwargs))

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Kept working, as pipelines call it on any model, with a warning: its options do not
        reach graphddp's graphs."""
        warnings.warn(_OUTER_COMPILE, stacklevel=2)
        super().compile(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._state.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self._state.load_state_dict(state_dict, strict, assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        return self._state.named_parameters(prefix, recurse, remove_duplicate)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)


def build_state(
    where: str, module: nn.Module, process_group: Any, device_mesh: Any, optimizer: Any, options: dict[str, Any], example: Any = None,
) -> ModelState:
    """The wrap both forms share (``where`` names the one asked), in every mode. Its order is the
    point: ``optimizer`` checked before any collective, so every rank fails alike; the broadcast
    of whole tensors, before a mode cuts them; the cost model measured on the group now, since
    compiling never talks; the mode's state built after the last collective."""
    check_module_and_world(where, module)
    config = DDPConfig.from_options(where, options)
    if example is not None and config.sharding != "auto":
        raise ValueError(f"{where}: example= is what sharding='auto' chooses from; without it, leave example= out")
    groups = resolve_mesh(where, device_mesh, process_group, config.sharding)
    auto = config.sharding == "auto"
    check_optimizer(where, config, optimizer)
    mode, checked = (None, None) if auto else _mode(where, module, config, optimizer)
    device = check_and_broadcast(where, module, groups.whole, config)
    choice = None
    if auto:  # its mode's checks run after the broadcast: every rank chose the same, so every rank fails alike
        config, choice = choose_placement(where, module, groups, optimizer, config, example, device)
        check_optimizer(where, config, optimizer)
        mode, checked = _mode(where, module, config, optimizer)
    state = mode(module, groups, resolve_cost(config, groups.whole, device), checked)
    state.choice = choice
    return state


def _mode(where: str, module: nn.Module, config: DDPConfig, optimizer: Any) -> tuple[type[ModelState], Any]:
    """The state class of ``config``'s placement and ``optimizer`` as that class keeps it."""
    mode = FullyShardedState if config.sharding == "full" else Replica
    return mode, mode.checked_optimizer(where, module, config, optimizer)


def compile(  # noqa: A001 - mirrors torch.compile
    module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, example: Any = None, **options: Any,
) -> GraphDDP:
    """Compile ``module`` for data-parallel training with its collectives inside the compiled graphs.

    Drop-in for ``DistributedDataParallel(torch.compile(module))``: after ``loss.backward()`` every
    ``p.grad`` is the average over ``process_group`` (default: WORLD); parameters (and, with
    ``broadcast_buffers``, buffers before every forward) are broadcast from its first rank, like DDP.
    ``options`` are :class:`~graphddp.config.DDPConfig`'s fields (docs/options.md); an unknown name is
    a TypeError. Without a cap option the buckets minimise a cost model's predicted backward.

    ``optimizer`` (SGD, Adam or AdamW over the module's parameters) is compiled into the backward,
    each bucket's update right after its wait: after a synchronising ``backward()`` the parameters
    are updated and every ``p.grad`` is None; ``optimizer.step()``/``zero_grad()`` become no-ops.
    ``max_grad_norm`` clips the averaged gradients first, as ``clip_grad_norm_`` would
    (:mod:`graphddp.optim.attached`). ``device_mesh``: a ``DeviceMesh`` instead of
    ``process_group``; 2-D with sharding, dim 0 replicates and dim 1 shards (FSDP2's HSDP).
    ``sharding="auto"`` chooses the placement from a trace of ``example`` (a batch: a tuple of
    positional inputs, a dict of keyword inputs, or one input) and shows why in ``placement_choice``.
    Compiling the result again runs it as it is; a pipeline that owns its torch.compile call uses
    :func:`graphddp.backend`.
    """
    return GraphDDP(module, build_state("graphddp.compile", module, process_group, device_mesh, optimizer, options, example))


def full_optimizer_state_dict(model: Any) -> dict[str, Any]:
    """The state dict a plain optimizer of the attached one's class would have, whatever the
    sharding and world size. Sharded, it gathers the parts: call it on every rank."""
    return _state_of(model, "graphddp.full_optimizer_state_dict").full_optimizer_state_dict()


def load_full_optimizer_state_dict(model: Any, state: Mapping[str, Any]) -> None:
    """Load a whole optimizer state (from :func:`full_optimizer_state_dict` on any world size, or
    from a plain optimizer's ``state_dict()``); sharded, each rank keeps its parts."""
    _state_of(model, "graphddp.load_full_optimizer_state_dict").load_full_optimizer_state_dict(state)


def _state_of(model: Any, where: str) -> ModelState:
    state = getattr(model, "_state", None)
    if not isinstance(state, ModelState) or state.optimizer is None:
        raise TypeError(f"{where}: expects a model from graphddp.compile(..., optimizer=) or graphddp.backend(..., optimizer=)")
    return state
