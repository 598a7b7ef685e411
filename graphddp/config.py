"""User-facing options, validated once, frozen for the lifetime of a compiled model.

Every option that changes the plan is part of :class:`DDPConfig`, so the plan is a pure
function of (graph, config) and two ranks with equal configs plan identically.
"""
from __future__ import annotations

import dataclasses
import math

BACKENDS = ("inductor", "aot_eager", "eager")
# Built-in communication hooks, applied to whole buckets inside the graph (DDP's
# fp16_compress_hook / bf16_compress_hook): cast, divide, all-reduce, cast back.
COMM_HOOKS = {"fp16_compress": "float16", "bf16_compress": "bfloat16"}
MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Options that shape the bucket plan and the rewrite.

    bucket_cap_mb / first_bucket_cap_mb follow DDP: the first bucket of each (dtype, device)
    is small so communication starts early, the rest are ``bucket_cap_mb``. A bucket closes
    once it reaches its cap, so it may exceed the cap by at most one gradient.
    ``last_bucket_cap_mb`` (None: off, as in DDP) caps the bucket of the gradients produced
    last; its transfer starts after the last backward kernel, so all of it is exposed.
    """

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    last_bucket_cap_mb: float | None = None
    backend: str = "inductor"
    world_size: int = 1
    group_name: str = ""
    verify: bool = True
    comm_hook: str | None = None

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_cap_mb", "last_bucket_cap_mb"):
            value = getattr(self, name)
            if name == "last_bucket_cap_mb" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive, finite number of megabytes, got {value!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be None or one of {sorted(COMM_HOOKS)}, got {self.comm_hook!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")

    @property
    def comm_dtype(self) -> str | None:
        """The dtype buckets travel in, or None to send them as they are."""
        return COMM_HOOKS.get(self.comm_hook) if self.comm_hook else None

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * MB)

    @property
    def first_bucket_cap_bytes(self) -> int:
        return int(self.first_bucket_cap_mb * MB)

    @property
    def last_bucket_cap_bytes(self) -> int:
        if self.last_bucket_cap_mb is None:
            raise ValueError("last_bucket_cap_mb is not set")
        return int(self.last_bucket_cap_mb * MB)
