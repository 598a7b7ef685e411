"""graphddp: data-parallel gradient all-reduces planned ahead of time inside torch.compile.

Set ``GRAPHDDP_LOG=info`` to log every plan, ``GRAPHDDP_LOG=debug`` to also log each backward
graph before and after every pass (logger name: ``graphddp``).
"""
import logging as _logging
import os as _os

import torch as _torch

# pyproject.toml's floor, said at import where pip did not check it (a 2.10 pre-release passes: NGC's builds are)
if tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 10):
    raise ImportError(f"graphddp needs torch 2.10 or newer (pyproject.toml); this is torch {_torch.__version__}")

from graphddp import render
from graphddp.config import DDPConfig
from graphddp.frontend.api import GraphDDP, compile, full_optimizer_state_dict, load_full_optimizer_state_dict
from graphddp.frontend.backend import GraphDDPCompileBackend, backend
from graphddp.frontend.backend import register as _register_backend_name
from graphddp.frontend.explain import explain, predict_memory
from graphddp.graph.verify import VerificationError, verify
from graphddp.plan.cost import CostModel, simulate
from graphddp.runtime.agree import CollectiveError, ScheduleMismatchError
from graphddp.values.schedule import Bucket, Schedule, Timeline

__all__ = [
    "Bucket", "CollectiveError", "CostModel", "DDPConfig", "GraphDDP", "GraphDDPCompileBackend", "Schedule",
    "ScheduleMismatchError", "Timeline", "VerificationError", "backend", "compile", "explain", "full_optimizer_state_dict",
    "load_full_optimizer_state_dict", "predict_memory", "render", "simulate", "verify",
]
__version__ = "0.1.0"


def _configure_logging() -> None:
    """The standard library's rule for libraries: no output unless asked (a NullHandler keeps
    logging's last-resort handler quiet); ``GRAPHDDP_LOG`` asks, and a bad value only warns."""
    logger = _logging.getLogger("graphddp")
    logger.addHandler(_logging.NullHandler())
    level = _os.environ.get("GRAPHDDP_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("INFO", "DEBUG", "WARNING", "ERROR"):
        import warnings

        warnings.warn(f"GRAPHDDP_LOG must be debug, info, warning or error, got {level.lower()!r}; ignored", stacklevel=2)
        return
    logger.setLevel(level)
    if not any(isinstance(h, _logging.StreamHandler) for h in logger.handlers):
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("[graphddp %(levelname)s] %(message)s"))
        logger.addHandler(handler)


_configure_logging()
_register_backend_name()  # torch.compile(model, backend="graphddp") after graphddp.backend(model, ...)
