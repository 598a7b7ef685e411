"""``graphddp.compile``: the user entry point, the module it returns in every mode, and the
surface it shares with ``graphddp.backend``'s object (:class:`ModelView`)."""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from graphddp.compiler.record import GraphRecord
from graphddp.config import DDPConfig
from graphddp.frontend.full import FullyShardedState, compile_fully_sharded
from graphddp.frontend.mesh import resolve_mesh
from graphddp.frontend.replica import Replica
from graphddp.frontend.wrap import prepare, resolve_group

# Each wrapper counts its own recompiles (torch >= 2.13): by default every torch.compile of the
# same code shares one recompile limit, so earlier compiles of the model's class (explain's,
# another wrapper's) would push this one into eager fallback.
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
# Compiling a graphddp module again (torch.compile(gd), gd.compile()) composes: its forward is
# opaque to the outer compile, which runs it as it is. The outer compile's settings do nothing.
_OUTER_COMPILE = (
    "a graphddp module compiles itself: an outer torch.compile (or .compile()) runs it as it is "
    "and its backend, mode and options do not apply; pass mode=/options= to graphddp.compile, or "
    "use torch.compile(model, backend=graphddp.backend(model)) to own the torch.compile call"
)


class ModelView(Joinable):
    """What both forms (the module ``graphddp.compile`` returns, the ``graphddp.backend``
    object) show of their mode's state (``self._state``): a :class:`Replica` (replicated,
    ``sharding="optimizer"``) or a :class:`FullyShardedState` (``sharding="full"``). The state
    supplies what differs between the modes (the work around a forward, what a schedule is,
    where the tensors live, what a mode refuses); every job here is written once. A
    ``Joinable``, so ``torch.distributed.algorithms.Join([model, ...])`` takes it
    (:mod:`graphddp.runtime.join`)."""

    _state: Replica | FullyShardedState

    def _joinable(self) -> None:
        """Called by a form's constructor once it has its state (what ``Joinable.__init__``
        sets, without calling it again: for a module that would re-run ``nn.Module.__init__``)."""
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
        """One schedule per compiled graph: a :class:`~graphddp.values.schedule.Schedule` per
        backward, or with ``sharding="full"`` a :class:`~graphddp.values.part_schedule.FullSchedule`
        per Dynamo graph."""
        return self._state.schedules

    @property
    def records(self) -> list[GraphRecord]:
        """Schedules with the rewritten graphs and, under inductor, the generated code."""
        return self._state.records

    @property
    def graphs(self) -> list[Any]:
        """``sharding="full"``: every compiled forward and backward graph, in order."""
        return self._state.graphs

    @property
    def parts(self) -> dict[str, Any]:
        """``sharding="full"``: every parameter name (tied weights: each of theirs) and this rank's part of it."""
        return self._state.parts

    @property
    def updates(self) -> dict[str, int]:
        """``sharding="full"``: how many backwards updated their parts inside, and why the others did not."""
        return self._state.updates

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch (nanoGPT sets it per micro-step instead of using ``no_sync()``): read
        at every forward; a forward run while it is False does not synchronise its backward,
        exactly as under :meth:`no_sync`. Assigned values count by their truth, as DDP reads them."""
        return self._state.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._state.sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients, as DDP's do.

        DDP's implementation: ``require_backward_grad_sync`` is False inside and restored on
        exit. What counts is where the *forward* runs. Replicated, the backward inside
        communicates nothing (:mod:`graphddp.runtime.dispatch`), and the next synchronised
        step averages what accumulated, launched when its forward starts and hidden behind it;
        fully sharded, the backward still reduce-scatters and does not update the parts:
        ``opt.step()`` after the synchronising micro-step steps them.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook``, before the first forward and once. DDP's own hooks
        (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``
        with its ``PowerSGDState``) become graphddp's in-graph equivalents; any other hook is
        traced into the graph as ``comm_hook=(state, hook)`` would be
        (:mod:`graphddp.frontend.ddp_hooks`)."""
        self._state.register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
        """DDP's context manager for uneven inputs: inside it, a rank that runs out of batches
        shadows the collectives of the ranks still training (:mod:`graphddp.runtime.join`)."""
        return self._state.join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._state.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        from graphddp.runtime.agree import _device

        return _device(self._state.group)

    @property
    def join_process_group(self) -> Any:
        return self._state.group

    def finish_gathers(self) -> None:
        """With ``gather="forward"``, the parameters hold their updated values only once the
        next forward (or a checkpoint) completes the all-gathers the backward issued; code that
        reads or writes parameter tensors directly between a backward and the next forward
        calls this first. Otherwise (and when nothing is pending) it does nothing."""
        self._state.finish_gathers()

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """:func:`full_optimizer_state_dict` of this model."""
        return self._state.full_optimizer_state_dict()

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """:func:`load_full_optimizer_state_dict` into this model."""
        self._state.load_full_optimizer_state_dict(state)


class GraphDDP(ModelView, nn.Module):
    """A data-parallel module whose compiled graphs carry their own collectives, in every mode.

    It shares parameters with ``self.module`` (the module it wraps); ``state_dict()`` and
    ``load_state_dict()`` use the wrapped module's keys, so checkpoints move freely between
    a plain model and a graphddp one (fully sharded: whole tensors out, this rank's part kept
    in; every rank calls them). ``parameters()`` hold their current values (fully sharded:
    gathered whole, detached). The rest is :class:`ModelView`'s.
    """

    def __init__(self, module: nn.Module, state: Replica | FullyShardedState) -> None:
        super().__init__()
        self.module = module
        self._state = state
        self._joinable()
        config = state.config
        # Stored outside the module registry so parameters are not listed twice.
        object.__setattr__(
            self, "_compiled", torch.compile(module, backend=state.compile_graph, fullgraph=config.fullgraph, dynamic=config.dynamic, **_ISOLATED)
        )

    @torch._dynamo.disable(reason=_OUTER_COMPILE)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._state.before_forward(args, kwargs)
        return self._state.after_forward(self._compiled(*args, **kwargs))

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """A graphddp module is compiled already: ``nn.Module.compile`` would add nothing.

        Kept working, as pipelines call it on whatever model they are handed; their
        ``backend``/``mode``/``options`` do not reach graphddp's graphs, so a warning says where
        to pass them instead.
        """
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


def build_state(where: str, module: nn.Module, process_group: Any, device_mesh: Any, optimizer: Any, options: dict[str, Any]) -> Replica | FullyShardedState:
    """The wrap of both forms (``where`` names the one asked): the options read, the groups
    resolved, the mode's wrap-time work done, and the mode's state made."""
    resolve_group(where, module, process_group, options)
    config = DDPConfig.from_options(where, options)
    groups = resolve_mesh(where, device_mesh, process_group, config.sharding)
    if config.sharding == "full":
        return compile_fully_sharded(module, groups, config, optimizer, where)
    attached, config = prepare(where, module, groups.whole, config, optimizer, groups)
    return Replica(module, groups.whole, config, attached)


def compile(module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, **options: Any) -> GraphDDP:  # noqa: A001 - mirrors torch.compile
    """Compile ``module`` for data-parallel training with all-reduces inside its backward graph.

    ``options`` are :class:`~graphddp.config.DDPConfig`'s fields (the one definition that
    ``explain``, the CLI and the benchmark share); an unknown name is a TypeError.

    Drop-in for ``DistributedDataParallel(torch.compile(module))``: after ``loss.backward()``
    every ``p.grad`` is the average over the ranks of ``process_group`` (default: WORLD).
    Parameters are broadcast from the group's first rank now, like DDP; with
    ``broadcast_buffers`` buffers are too, and again before every forward, like DDP (without
    it they stay rank-local, as DDP leaves them).

    With no cap option given (or ``bucket_cap_mb="auto"``) the buckets are those that minimise
    the backward a cost model predicts, the model measured on ``process_group`` now
    (:mod:`graphddp.runtime.calibrate`) or given as ``cost=graphddp.CostModel(...)``
    (:mod:`graphddp.plan.auto`). Bucket caps mean what they mean to DDP, per (dtype, device), a
    bucket closing once its bytes reach its cap: ``bucket_cap_mb=25, first_bucket_cap_mb=1`` is
    DDP's default, 25 MB buckets after a 1 MB first one (also what unset caps mean when another
    cap option is given); a set ``bucket_cap_mb`` caps every bucket, the
    first included, exactly as DDP does. ``bucket_cap_mb_list`` gives one cap per bucket in
    the order buckets become ready, its last entry repeating (DDP's option; it overrides
    ``bucket_cap_mb``). ``first_bucket_cap_mb`` is graphddp's extension for a smaller first
    bucket with a set ``bucket_cap_mb``; it is clamped to the bucket cap and cannot be combined
    with ``bucket_cap_mb_list``. ``model.schedules`` record the resolved caps.
    ``last_bucket_cap_mb`` caps the bucket of the gradients produced last (default: off, the
    last bucket is what remains, as in DDP); its all-reduce starts after the last backward
    kernel, so nothing hides it: on a slow link a small tail bucket shortens the step.
    ``verify`` runs the graph checker after every rewrite (cheap; on by default).
    ``comm_hook``: ``"fp16_compress"`` or ``"bf16_compress"`` sends buckets in half precision
    (DDP's compression hooks, run inside the graph); ``(state, hook)`` traces a hook written
    with DDP's vocabulary and functional collectives into every bucket
    (:mod:`graphddp.hooks.traced`); ``graphddp.hooks.PowerSGD(...)`` is DDP's PowerSGD in the
    graph. The schedule shows each bucket's hook and bytes on the wire; a hook's state is
    saved in ``state_dict()`` under ``"graphddp_comm_hook"``.
    ``mode`` and ``options`` are torch.compile's, for inductor; graphddp's own inductor
    settings stay on top of them (``inductor_settings.INDUCTOR_PINNED_CONFIG``).

    ``optimizer``: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the module's parameters.
    Its update is compiled into the backward, each bucket's parameters right after that
    bucket's wait: after a synchronising ``backward()`` the parameters are updated and every
    ``p.grad`` is None; ``optimizer.step()``/``zero_grad()`` become no-ops, hyperparameters
    are read from ``param_groups`` every step, state stays in ``optimizer.state``.
    ``max_grad_norm`` clips the averaged gradients by their global norm before the update, as
    ``clip_grad_norm_(model.parameters(), max_grad_norm, norm_type=grad_norm_type)`` before
    ``optimizer.step()`` (L2 unless ``grad_norm_type`` says another p > 0 or inf;
    :mod:`graphddp.optim.clip`; with ``sharding="optimizer"`` each rank norms its parts and one
    all-reduce of their shares, a MAX for inf, gives the norm); calling ``clip_grad_norm_`` on the parameters yourself
    raises (:mod:`graphddp.optim.guards`), but after ``scaler.unscale_`` in a step an enabled ``GradScaler`` scaled:
    such a step leaves its gradients to the scaler (:mod:`graphddp.optim.scaled_step`). See
    :mod:`graphddp.optim.attached`.

    ``device_mesh``: a ``DeviceMesh`` instead of ``process_group``; 1-D, its group; 2-D with
    ``sharding="optimizer"`` or ``"full"``, hybrid sharding (FSDP2's HSDP: dim 0 replicates,
    dim 1 shards): the state (or parameters) cut over dim 1's group, each part's gradient also
    averaged over dim 0's (:mod:`graphddp.frontend.mesh`).

    Compiling the result again (``torch.compile(gd)``, ``gd.compile()``) runs it as it is; for
    a pipeline that owns its torch.compile call, see :func:`graphddp.backend`.
    """
    return GraphDDP(module, build_state("graphddp.compile", module, process_group, device_mesh, optimizer, options))


def full_optimizer_state_dict(model: Any) -> dict[str, Any]:
    """The state dict a plain optimizer of the attached one's class would have, on every rank,
    whatever the sharding: a checkpoint written from it loads into a plain ``torch.optim``
    optimizer of that class, and a run on another world size resumes from it. Sharded, every
    rank takes part (it gathers the parts): call it on all ranks."""
    return _state_of(model, "graphddp.full_optimizer_state_dict").full_optimizer_state_dict()


def load_full_optimizer_state_dict(model: Any, state: Mapping[str, Any]) -> None:
    """Load a whole optimizer state (from :func:`full_optimizer_state_dict` on any world size, or
    from a plain optimizer's ``state_dict()``); sharded, each rank keeps its parts."""
    _state_of(model, "graphddp.load_full_optimizer_state_dict").load_full_optimizer_state_dict(state)


def _state_of(model: Any, where: str) -> Replica | FullyShardedState:
    state = getattr(model, "_state", None)
    if not isinstance(state, (Replica, FullyShardedState)):
        raise TypeError(f"{where}: expects a model from graphddp.compile(..., optimizer=) or graphddp.backend(..., optimizer=)")
    return state
