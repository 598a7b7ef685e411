"""``graphddp.compile``: the user entry point and the module it returns."""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from graphddp.compiler.graph_compiler import GraphCompiler
from graphddp.config import DDPConfig
from graphddp.frontend.full import FullyShardedGraphDDP, compile_fully_sharded
from graphddp.frontend.mesh import resolve_mesh
from graphddp.frontend.replica import Replica, ReplicaView
from graphddp.frontend.wrap import prepare, resolve_group
from graphddp.hooks.traced import HOOK_STATE_KEY
from graphddp.optim.attached import AttachedOptimizer

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


class GraphDDP(ReplicaView, nn.Module):
    """A data-parallel module whose backward graphs carry their own gradient all-reduces.

    It shares parameters with ``self.module`` (the module it wraps); ``state_dict()`` and
    ``load_state_dict()`` use the wrapped module's keys, so checkpoints move freely between
    a plain model and a graphddp one. ``config``, ``schedules``, ``records``, ``world_size``
    and DDP's ``no_sync()``, ``require_backward_grad_sync``, ``register_comm_hook`` and
    ``join()`` come from :class:`~graphddp.frontend.replica.ReplicaView`.
    """

    def __init__(self, module: nn.Module, process_group: Any, config: DDPConfig, optimizer: AttachedOptimizer | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self._replica = Replica(module, process_group, config, optimizer)
        self._joinable()
        # Stored outside the module registry so parameters are not listed twice.
        object.__setattr__(
            self, "_compiled", torch.compile(
                module, backend=self._replica.compile_graph, fullgraph=config.fullgraph, dynamic=config.dynamic, **_ISOLATED
            )
        )

    @property
    def _backend(self) -> GraphCompiler:
        return self._replica.backend

    # -- execution ----------------------------------------------------------------------------
    @torch._dynamo.disable(reason=_OUTER_COMPILE)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._replica.before_forward()
        out = self._compiled(*args, **kwargs)
        self._replica.after_forward(out)
        return out

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """A graphddp module is compiled already: ``nn.Module.compile`` would add nothing.

        Kept working, as pipelines call it on whatever model they are handed; their
        ``backend``/``mode``/``options`` do not reach graphddp's graphs, so a warning says where
        to pass them instead.
        """
        warnings.warn(_OUTER_COMPILE, stacklevel=2)
        super().compile(*args, **kwargs)

    # -- checkpoints use the wrapped module's keys -------------------------------------------------
    # A traced communication hook's state (PowerSGD's Q and error, its step count) rides along
    # under HOOK_STATE_KEY; the model's own keys stay as they are.
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out = self.module.state_dict(*args, **kwargs)
        hook_state = self._backend.hook_state
        if hook_state is not None:
            out[HOOK_STATE_KEY] = hook_state.state_dict()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        state_dict = dict(state_dict)
        hook = state_dict.pop(HOOK_STATE_KEY, None)
        if hook is not None:
            if self._backend.hook_state is None:
                raise ValueError(f"the checkpoint has {HOOK_STATE_KEY!r} (a comm hook's state), but this module runs no traced comm hook")
            self._backend.hook_state.load_state_dict(hook)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- parameters read through this module hold their updated values ---------------------------
    # With gather="forward" the updated parameters are still on the wire between a backward and
    # the next forward; code that walks them through this module (parameters(): an EMA, a norm, a
    # copy to another model) gets them completed first. zero_grad() touches no value: it leaves the
    # all-gathers pending.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        self.finish_gathers()
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)


def compile(module: nn.Module, *, process_group: Any = None, device_mesh: Any = None, optimizer: Any = None, **options: Any) -> GraphDDP | FullyShardedGraphDDP:  # noqa: A001 - mirrors torch.compile
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
    resolve_group("graphddp.compile", module, process_group, options)
    config = DDPConfig.from_options("graphddp.compile", options)
    groups = resolve_mesh("graphddp.compile", device_mesh, process_group, config.sharding)
    if config.sharding == "full":
        return compile_fully_sharded(module, groups, config, optimizer)
    attached, config = prepare("graphddp.compile", module, groups.whole, config, optimizer, groups)
    return GraphDDP(module, groups.whole, config, attached)
