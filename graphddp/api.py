"""``graphddp.compile``: the user entry point and the module it returns."""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.agree import check_parameter_agreement
from graphddp.backend import GraphDDPBackend, GraphRecord
from graphddp.capture import names_by_identity
from graphddp.config import DDPConfig
from graphddp.schedule import Schedule
from graphddp.sync import average_async, broadcast_tensors

log = logging.getLogger("graphddp")

# Each wrapper counts its own recompiles (torch >= 2.13): by default every torch.compile of the
# same code shares one recompile limit, so earlier compiles of the model's class (explain's,
# another wrapper's) would push this one into eager fallback.
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def _check_devices(module: nn.Module) -> None:
    devices: dict[torch.device, str] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        spread = ", ".join(f"{name!r} on {dev}" for dev, name in devices.items())
        raise ValueError(
            "graphddp.compile: module parameters and buffers must live on one device "
            f"(data parallelism replicates the whole module per rank); found {spread}"
        )


class GraphDDP(nn.Module):
    """A data-parallel module whose backward graphs carry their own gradient all-reduces.

    It shares parameters with ``self.module`` (the module it wraps); ``state_dict()`` and
    ``load_state_dict()`` use the wrapped module's keys, so checkpoints move freely between
    a plain model and a graphddp one.
    """

    def __init__(self, module: nn.Module, process_group: Any, config: DDPConfig) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.process_group = process_group
        self._records: list[GraphRecord] = []
        self._sync = True  # cleared inside no_sync(); read by every compiled graph at each forward
        self._backend = GraphDDPBackend(
            config,
            names_by_identity(module.named_parameters()),
            self._records.append,
            process_group,
            sync_enabled=lambda: self._sync,
        )
        # Stored outside the module registry so parameters are not listed twice.
        object.__setattr__(
            self, "_compiled", torch.compile(
                module, backend=self._backend, fullgraph=config.fullgraph, dynamic=config.dynamic, **_ISOLATED
            )
        )
        self._guard_handles: dict[str, Any] = {}
        self._sync_buffers_next = True  # DDP: buffers sync before a forward that follows a synced one
        self._grads_accumulated_locally = False

    # -- inspection -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The size of ``process_group``: a fact of the job, read once by the backend."""
        return self._backend.world_size

    @property
    def schedules(self) -> list[Schedule]:
        """One Schedule per compiled backward graph, in compile order (after the first backward)."""
        return [r.schedule for r in self._records]

    @property
    def records(self) -> list[GraphRecord]:
        """Schedules with the rewritten graphs and, under inductor, the generated code."""
        return list(self._records)

    # -- execution ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication.

        As in DDP, what counts is where the *forward* runs: the backward of a forward run
        inside uses each compiled graph's communication-free backward, whatever the frame
        structure (graph breaks included; see :mod:`graphddp.variants`). The next
        synchronised backward yields DDP's result: the average over ranks of everything
        accumulated. The locally accumulated gradients are averaged by one async all-reduce
        launched when that synchronised forward starts and waited when it ends, so it hides
        behind the forward; the new gradients are reduced in the backward graph as usual.
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        distributed = self.world_size > 1
        if distributed and self.config.broadcast_buffers and self._sync_buffers_next:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_tensors(buffers, self.process_group)
        syncing = self._sync and torch.is_grad_enabled()
        pending = None
        if distributed and syncing and self._grads_accumulated_locally:
            trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
            pending = average_async(trainable, self.process_group)
        self._backend.ran_params.clear()
        out = self._compiled(*args, **kwargs)
        if pending is not None:
            pending.wait()
            self._grads_accumulated_locally = False
        if torch.is_grad_enabled():
            self._guard_uncovered_parameters(syncing)
            if not self._sync:
                self._grads_accumulated_locally = True
        self._sync_buffers_next = syncing
        return out

    def _guard_uncovered_parameters(self, syncing: bool) -> None:
        """Fail loudly if a gradient is produced outside the compiled graphs that ran.

        A parameter that no compiled graph of this forward covers (used in eager code between
        graph breaks, or a frame Dynamo ran eagerly after hitting its recompile limit) would
        get a gradient nobody averages. Such parameters get a hook that raises at backward
        time, instead of a silently wrong gradient. Unused parameters get no gradient, so
        their hook never fires. No hooks in the steady state, where every graph ran.
        """
        covered = self._backend.ran_params
        for name, handle in list(self._guard_handles.items()):
            if name in covered or not syncing:
                handle.remove()
                del self._guard_handles[name]
        if self.world_size == 1 or not syncing:
            return
        for name, p in self.module.named_parameters():
            if p.requires_grad and name not in covered and name not in self._guard_handles:
                self._guard_handles[name] = p.register_post_accumulate_grad_hook(_uncovered_error(name))

    # -- checkpoints use the wrapped module's keys -------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)


def _uncovered_error(name: str) -> Any:
    def hook(_param: torch.Tensor) -> None:
        raise RuntimeError(
            f"graphddp: parameter {name!r} received a gradient outside graphddp's compiled "
            "graphs (used in eager code between graph breaks, or Dynamo ran the frame eagerly, "
            "e.g. after torch._dynamo.config.recompile_limit was hit), so it would not be "
            "averaged across ranks. Move its use inside the compiled region or raise the limit."
        )

    return hook


def compile(module: nn.Module, *, process_group: Any = None, **options: Any) -> GraphDDP:  # noqa: A001 - mirrors torch.compile
    """Compile ``module`` for data-parallel training with all-reduces inside its backward graph.

    ``options`` are :class:`~graphddp.config.DDPConfig`'s fields (the one definition that
    ``explain``, the CLI and the benchmark share); an unknown name is a TypeError.

    Drop-in for ``DistributedDataParallel(torch.compile(module))``: after ``loss.backward()``
    every ``p.grad`` is the average over the ranks of ``process_group`` (default: WORLD).
    Parameters are broadcast from the group's first rank now, like DDP; with
    ``broadcast_buffers`` buffers are too, and again before every forward, like DDP (without
    it they stay rank-local, as DDP leaves them).

    Bucket caps mean what they mean to DDP, per (dtype, device), a bucket closing once its
    bytes reach its cap: ``bucket_cap_mb=None`` is DDP's default, 25 MB buckets after a 1 MB
    first one (so communication starts early); a set ``bucket_cap_mb`` caps every bucket, the
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
    (DDP's compression hooks, run inside the graph); the schedule shows the bytes on the wire.
    """
    if callable(options.get("comm_hook")):
        raise NotImplementedError(
            "comm_hook: user-supplied hook functions are not supported yet; use "
            "'fp16_compress' or 'bf16_compress'"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"graphddp.compile: module must be a torch.nn.Module, got {type(module).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "graphddp.compile: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    config = DDPConfig.from_options("graphddp.compile", options)
    _check_devices(module)
    check_parameter_agreement(module, group)
    if dist.get_world_size(group) > 1:
        # Like DDP (torch >= 2.13, init_sync_buffers follows broadcast_buffers): buffers are
        # made equal at wrap time only when they will be kept equal; otherwise rank-local.
        buffers = list(module.buffers()) if config.broadcast_buffers else []
        broadcast_tensors(list(module.parameters()) + buffers, group)
    return GraphDDP(module, group, config)
