"""Files graphddp keeps beside torch's inductor cache (compiled graphs, calibrations, choices).

They follow torch's own switches, so a user who turns torch's caches off turns graphddp's off too,
and are written so that ranks sharing the directory never see half a file.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch

log = logging.getLogger("graphddp")

ENV = "GRAPHDDP_COMPILE_CACHE"


def hooked() -> bool:
    """This torch has the hook a cache hit's backward is served through (inductor's
    ``cudagraph_policy``; torch 2.11 has not): without it graphddp keeps no files."""
    from torch._inductor import config as inductor_config

    return hasattr(inductor_config, "cudagraph_policy")


def enabled() -> bool:
    """Torch's local AOTAutograd cache is on, nothing forbids ours, and this torch has the hook."""
    from torch._functorch import config as functorch_config

    return (
        hooked()
        and os.environ.get(ENV, "1") != "0"
        and functorch_config.enable_autograd_cache
        and not torch.compiler.config.force_disable_caches
        # A bundled entry holds the backward's code itself; ours is a dispatcher (not an OutputCode).
        and not functorch_config.bundled_autograd_cache
        and not torch._dynamo.config.caching_precompile
    )


def write_atomically(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a reader never sees
    half a file and ranks sharing the directory can write the same bytes at once. False on
    failure (logged): what is not written is computed again next time."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except Exception:  # noqa: BLE001 - a cache that cannot be written is only a cache miss later
        log.warning("graphddp: could not write %s", path, exc_info=True)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return False


def graphddp_path(*parts: str) -> str:
    """A path in graphddp's directory inside torch's inductor cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "graphddp", *parts)
