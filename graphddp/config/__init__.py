"""The user's options, defined once, validated once, frozen for the life of a compiled model.

:class:`DDPConfig` is the one definition of graphddp's options (``compile``, ``explain``, the CLI's
flags from the fields' metadata). It holds the user's policy only; facts of the job (world size,
process group) reach the planner separately. Every option that changes the plan is a field, so
the plan is a pure function of (graph, options, world size) and ranks with equal options agree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from graphddp.config import ddp_keywords, inductor_settings, sharding
from graphddp.config.clipping import check_clipping
from graphddp.hooks.builtin import COMM_HOOKS
from graphddp.hooks.traced import as_traced_hook
from graphddp.config.inductor_settings import INDUCTOR_MODES
from graphddp.values import links
from graphddp.values.schedule import CostModel
from graphddp.values.schedule_table import MB  # graphddp.config.MB, re-exported

BACKENDS = ("inductor", "aot_eager", "eager")
SHARDINGS = (None, "optimizer", "full", "auto")
GATHERS = ("backward", "forward")
# DDP's defaults: torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB and
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), the latter used only while
# bucket_cap_mb is left unset.
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0
# DDP's default buckets as graphddp's options (graphddp's own default is "auto").
DDP_DEFAULT_CAPS = {"bucket_cap_mb": DEFAULT_BUCKET_CAP_MB, "first_bucket_cap_mb": DEFAULT_FIRST_BUCKET_CAP_MB}
# bucket_cap_mb's value for "no cap: the buckets that minimise the predicted step".
AUTO = "auto"


def _check_megabytes(name: str, value: Any) -> None:
    """A cap is a positive, finite number (bools are ints in Python, but never a size)."""
    if name == "bucket_cap_mb" and isinstance(value, str):
        raise ValueError(f"bucket_cap_mb must be a positive, finite number of megabytes or {AUTO!r}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number of megabytes, got {value!r}")


def _normalise_cap_list(value: Any) -> tuple[float, ...] | None:
    """``bucket_cap_mb_list`` as a tuple, so the config stays hashable; empty means not given, as in DDP."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"bucket_cap_mb_list must be a list or tuple of megabytes, got {value!r}")
    for i, cap in enumerate(value):
        _check_megabytes(f"bucket_cap_mb_list[{i}]", cap)
    return tuple(value) or None


def _option(default: Any, help: str) -> Any:  # noqa: A002 - argparse's word
    """A field of DDPConfig with the help text the CLI shows."""
    return dataclasses.field(default=default, metadata={"help": help})


def _ddp_keyword(help: str) -> Any:  # noqa: A002 - argparse's word
    """A field for one of DDP's constructor keywords (None: not given), taken so that ``DDP(model,
    **kw)`` becomes ``graphddp.compile(model, **kw)``; none shapes the plan, so the CLI has no flag."""
    return dataclasses.field(default=None, metadata={"help": help, "ddp_keyword": True})


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Options that shape the bucket plan and the rewrite (docs/options.md).

    Bucket caps follow ``DistributedDataParallel`` exactly (its ``_BucketCapacityConfig`` and the
    reducer's ``compute_bucket_assignment_by_size``): a bucket closes once its size reaches its
    cap, caps count per (dtype, device), and DDP's small first bucket applies only while
    ``bucket_cap_mb`` is unset. graphddp's own: ``first_bucket_cap_mb`` (clamped to the rest: a
    larger first bucket would defeat its purpose, starting early), ``last_bucket_cap_mb`` (the last
    bucket's transfer is all exposed) and ``"auto"``, the default when no cap is given: the
    partition that minimises the backward ``cost`` predicts (:mod:`graphddp.plan.auto`). The
    fields keep what the user passed; ``effective_*`` and ``bucket_size_limits`` are resolved."""

    bucket_cap_mb: float | str | None = _option(
        None, "bucket cap in MB, the first bucket's too, or 'auto': buckets chosen by the cost model "
        "(default: 'auto'; DDP's default is 25 with first_bucket_cap_mb=1)"
    )
    first_bucket_cap_mb: float | None = _option(None, "smaller first bucket (graphddp's extension; clamped to bucket_cap_mb)")
    last_bucket_cap_mb: float | None = _option(None, "cap of the bucket of the gradients produced last (default: off)")
    bucket_cap_mb_list: tuple[float, ...] | None = _option(
        None, "one cap per bucket in ready order, the last repeating (DDP's bucket_cap_mb_list)"
    )
    cost: CostModel | str | None = _option(
        None, "the CostModel bucket_cap_mb='auto' minimises, or a link preset's name (graphddp.values.links: 'dgx-h100', "
        "'a100+eth100', ...) (default: calibrated on the process group at wrap time)"
    )
    comm_hook: Any = _option(
        None, f"send buckets compressed: one of {sorted(COMM_HOOKS)} (DDP's compression hooks); from Python also (state, hook) or graphddp.hooks.PowerSGD(...)"
    )
    sharding: str | None = _option(
        None, "'optimizer': each rank keeps and updates 1/N of the optimizer state; buckets are reduce-scattered, "
        "updated in the backward and all-gathered; 'full': each rank holds 1/N of every parameter, gradient and "
        "optimizer state, each parameter gathered where the graphs read it and its part updated in the backward "
        "(both need optimizer=); 'auto': the placement (and its gather=, reshard_after_forward=) with the best predicted "
        "step among those predicted to fit memory_budget, from a trace of example= (default None: replicated)"
    )
    memory_budget: float | None = _option(
        None, "with sharding='auto': the bytes each rank may hold at the step's peak, or a fraction (0, 1] of the "
        "device's memory (default: a GPU's free memory at wrap time, no limit on CPU)"
    )
    reshard_after_forward: bool | None = _option(
        None, "with sharding='full': free each gathered parameter after the forward and gather it again in the "
        "backward (FSDP2's option, same meaning; default True), or False: keep it from the forward to the backward"
    )
    replicate_below_mb: float | None = _option(
        None, "with sharding='full': parameters smaller than this many MB stay whole on every rank (replicated: never "
        "gathered, their gradients all-reduced), as DeepSpeed ZeRO-3's param_persistence_threshold; the larger ones "
        "sharded (default 0: every parameter sharded)"
    )
    mp_policy: Any = _option(
        None, "with sharding='full': FSDP2's torch.distributed.fsdp.MixedPrecisionPolicy, same meaning: parameters "
        "gathered and computed in param_dtype, gradients reduce-scattered in reduce_dtype (default param_dtype), "
        "floating inputs cast to param_dtype (cast_forward_inputs), outputs to output_dtype (default: no cast)"
    )
    gather: str = _option(
        "backward", "with sharding='optimizer': where each bucket's all-gather of the updated parts completes, "
        "'backward' (at its end) or 'forward' (deferred into the next forward, before the bucket's parameters are read)"
    )
    max_grad_norm: float | None = _option(
        None, "with optimizer=: clip the averaged gradients to this global norm (L2, or grad_norm_type's) before the update, "
        "as torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, grad_norm_type) before optimizer.step() "
        "(default: no clipping)"
    )
    grad_norm_type: float = _option(
        2.0, "with max_grad_norm: the norm it clips by, clip_grad_norm_'s norm_type: 1, 2, inf or any other p > 0 (default: 2)"
    )
    backend: str = _option("inductor", f"inner compiler: one of {BACKENDS}")
    verify: bool = _option(True, "run the graph checker after every rewrite")
    broadcast_buffers: bool = _option(True, "keep buffers equal: broadcast from rank 0 before every forward, like DDP")
    fullgraph: bool = _option(False, "passed to torch.compile: a graph break is an error")
    dynamic: bool | None = _option(None, "passed to torch.compile: dynamic shapes (None: torch's default)")
    mode: str | None = _option(None, f"inductor's mode, as torch.compile's: one of {INDUCTOR_MODES}")
    options: tuple[tuple[str, Any], ...] | None = _option(
        None, "inductor config settings, as torch.compile's options= (a dict; JSON on the command line)"
    )
    # DistributedDataParallel's constructor keywords, each with its meaning here (docs/options.md).
    device_ids: tuple[Any, ...] | None = _ddp_keyword(
        "DDP's: one device, the one the module's parameters are on (graphddp runs the model where they are)"
    )
    output_device: Any = _ddp_keyword("DDP's: the module's parameters' device (graphddp leaves outputs where the model puts them)")
    find_unused_parameters: bool | None = _ddp_keyword(
        "DDP's: True or False, the same either way: graphddp finds parameters a step did not use itself"
    )
    static_graph: bool | None = _ddp_keyword("DDP's: True or False, the same either way: graphddp's plans are static per compiled graph")
    gradient_as_bucket_view: bool | None = _ddp_keyword(
        "DDP's: True only: gradients are views of their bucket's averaged buffer; False is refused"
    )

    @classmethod
    def option_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The user's options, in definition order."""
        return dataclasses.fields(cls)

    @classmethod
    def ddp_keywords(cls) -> tuple[str, ...]:
        """The fields that are DistributedDataParallel's constructor keywords, nothing more."""
        return tuple(f.name for f in cls.option_fields() if f.metadata.get("ddp_keyword"))

    @classmethod
    def from_options(cls, where: str, options: dict[str, Any]) -> "DDPConfig":
        """Build a config from keyword options; an unknown name is a TypeError naming it."""
        known = {f.name for f in cls.option_fields()}
        unknown = sorted(set(options) - known)
        if unknown:
            ddp = [n for n in unknown if n in ddp_keywords.constructor_keywords()]
            hint = f" ({ddp}: DistributedDataParallel's, which graphddp does not take)" if ddp else ""
            raise TypeError(f"{where} got unknown option(s) {unknown}{hint}; the options are {sorted(known)}")
        return cls(**options)

    def as_options(self) -> dict[str, Any]:
        """The options as ``compile``/``explain`` keywords: ``compile(m, **config.as_options())``."""
        return {f.name: getattr(self, f.name) for f in self.option_fields()}

    def __post_init__(self) -> None:
        self._check_caps()
        for name in ("verify", "broadcast_buffers", "fullgraph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be None, True or False, got {self.dynamic!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {self.gather!r}")
        sharding.check_auto(self)
        if self.gather != "backward" and self.sharding != "optimizer":
            raise ValueError(f"gather={self.gather!r} places the all-gathers of sharding='optimizer'; it needs that option")
        sharding.check_full_sharding(self)
        clipping = check_clipping(self.max_grad_norm, self.grad_norm_type)
        object.__setattr__(self, "max_grad_norm", clipping[0])
        object.__setattr__(self, "grad_norm_type", clipping[1])
        traced = as_traced_hook(self.comm_hook)
        if traced is not None:
            object.__setattr__(self, "comm_hook", traced)
        elif self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(
                f"comm_hook must be None, one of {sorted(COMM_HOOKS)}, (state, hook) or a graphddp.hooks hook object, got {self.comm_hook!r}"
            )
        object.__setattr__(self, "options", inductor_settings.normalise_options(self.options))
        inductor_settings.check_request(self.backend, self.mode, self.inductor_options)
        object.__setattr__(self, "device_ids", ddp_keywords.check_keywords(self))

    @property
    def inductor_options(self) -> dict[str, Any]:
        """``options`` as the dict the user passed (empty when not given)."""
        return dict(self.options or ())

    def check_inductor_settings(self, where: str, device: Any, mode: str | None = None,
                                options: dict[str, Any] | None = None) -> dict[str, Any]:
        """The inductor patches for a compile of this config (or of a ``torch.compile`` call's
        ``mode``/``options``), refused where graphddp cannot keep its promises."""
        return inductor_settings.check_inductor_settings(
            where, self.backend, device, self.mode if mode is None else mode,
            self.inductor_options if options is None else dict(options), sharded=self.sharding is not None,
        )

    def check_devices(self, where: str, device: torch.device | None) -> None:
        """``device_ids`` and ``output_device`` name the device of the module's parameters."""
        ddp_keywords.check_devices(where, self.device_ids, self.output_device, device)

    def _check_caps(self) -> None:
        object.__setattr__(self, "bucket_cap_mb_list", _normalise_cap_list(self.bucket_cap_mb_list))
        if isinstance(self.cost, str):
            object.__setattr__(self, "cost", links.preset(self.cost))
        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise ValueError(f"cost must be a graphddp.CostModel or a link preset's name, got {type(self.cost).__name__}")
        if self.bucket_cap_mb == AUTO:
            given = [n for n in ("first_bucket_cap_mb", "last_bucket_cap_mb", "bucket_cap_mb_list") if getattr(self, n)]
            if given:
                raise ValueError(
                    f"bucket_cap_mb='auto' chooses every bucket from the cost model; {given} would overrule it: "
                    "leave them out, or give caps instead of 'auto'"
                )
        if self.auto:
            return
        if self.cost is not None:
            raise ValueError(
                "cost is the model bucket_cap_mb='auto' minimises; with caps it is unused: "
                f"leave the caps or cost out (bucket_cap_mb={self.bucket_cap_mb!r}, first_bucket_cap_mb="
                f"{self.first_bucket_cap_mb!r}, last_bucket_cap_mb={self.last_bucket_cap_mb!r}, "
                f"bucket_cap_mb_list={self.bucket_cap_mb_list!r})"
            )
        for name in ("bucket_cap_mb", "first_bucket_cap_mb", "last_bucket_cap_mb"):
            value = getattr(self, name)
            if value is not None:
                _check_megabytes(name, value)
        if self.bucket_cap_mb_list is not None and self.first_bucket_cap_mb is not None:
            raise ValueError(
                "bucket_cap_mb_list and first_bucket_cap_mb cannot both be set: the list's first "
                f"entry is the first bucket's cap (got bucket_cap_mb_list={list(self.bucket_cap_mb_list)!r}, "
                f"first_bucket_cap_mb={self.first_bucket_cap_mb!r})"
            )

    @property
    def comm_dtype(self) -> str | None:
        """The dtype buckets travel in, or None to send them as they are."""
        return COMM_HOOKS.get(self.comm_hook) if isinstance(self.comm_hook, str) else None

    @property
    def traced_hook(self) -> Any:
        """The user's traced hook (``graphddp.hooks.traced.TracedHook``), or None."""
        return None if self.comm_hook is None or isinstance(self.comm_hook, str) else self.comm_hook

    @property
    def auto(self) -> bool:
        """Buckets from the cost model: ``bucket_cap_mb="auto"``, or no cap option given at all."""
        if self.bucket_cap_mb is None:
            return self.first_bucket_cap_mb is None and self.last_bucket_cap_mb is None and not self.bucket_cap_mb_list
        return isinstance(self.bucket_cap_mb, str) and self.bucket_cap_mb == AUTO

    def _no_caps(self, what: str) -> None:
        if self.auto:
            raise ValueError(f"bucket_cap_mb='auto' has no {what}: the plan's buckets are in its Schedule")

    # -- resolved caps ---------------------------------------------------------------------
    @property
    def effective_bucket_cap_mb(self) -> float:
        """DDP's ``bucket_bytes_cap`` in MB: 25 when unset, the largest entry of a cap list."""
        self._no_caps("bucket cap")
        if self.bucket_cap_mb_list is not None:
            return float(max(self.bucket_cap_mb_list))
        return float(DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb)

    @property
    def effective_first_bucket_cap_mb(self) -> float:
        """The cap the first bucket of each (dtype, device) is closed at."""
        self._no_caps("first bucket cap")
        if self.bucket_cap_mb_list is not None:
            return float(self.bucket_cap_mb_list[0])
        if self.first_bucket_cap_mb is not None:
            return float(min(self.first_bucket_cap_mb, self.effective_bucket_cap_mb))
        if self.bucket_cap_mb is None:
            return DEFAULT_FIRST_BUCKET_CAP_MB
        return float(self.bucket_cap_mb)

    @property
    def bucket_size_limits_mb(self) -> tuple[float, ...]:
        """Caps walked one per bucket of each (dtype, device), the last repeating (DDP's list)."""
        self._no_caps("caps")
        if self.bucket_cap_mb_list is not None:
            return tuple(float(c) for c in self.bucket_cap_mb_list)
        return (self.effective_first_bucket_cap_mb, self.effective_bucket_cap_mb)

    @property
    def bucket_size_limits(self) -> tuple[int, ...]:
        """``bucket_size_limits_mb`` in bytes, truncated as DDP does (``int(mb * 2**20)``)."""
        return tuple(int(c * MB) for c in self.bucket_size_limits_mb)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.effective_bucket_cap_mb * MB)

    @property
    def first_bucket_cap_bytes(self) -> int:
        return self.bucket_size_limits[0]

    @property
    def last_bucket_cap_bytes(self) -> int:
        if self.last_bucket_cap_mb is None:
            raise ValueError("last_bucket_cap_mb is not set")
        return int(self.last_bucket_cap_mb * MB)
