"""Warm restarts: graphddp's compiled graphs from torch's compile caches, its plans beside them.

Plain ``torch.compile`` restarts fast because AOTAutograd caches its whole result (the forward
and backward code, by their inductor FX-graph cache keys, and the metadata to rebuild the
runtime wrappers) keyed by the Dynamo graph, its inputs and the configs: a hit skips tracing
the joint graph, the joint-graph passes, the partitioner and every inductor compile. graphddp
switched that cache off, since a hit would hand AOTAutograd's backward straight to autograd,
skipping graphddp's rewrite and its runtime wrapper (:class:`graphddp.runtime.dispatch.BackwardDispatch`:
sync or ``no_sync`` variant, the in-band agreement). On a warm restart every graph was traced,
partitioned and rewritten again; only inductor's own compiles hit the FX-graph cache.

This module lets graphddp's graphs use the AOTAutograd cache too:

* **The key covers the plan's inputs.** :func:`plan_key` hashes what the rewrite reads besides
  the backward graph: the options (``DDPConfig``), world size, group name, the graph's index,
  its parameters' names by input position, the parameters other graphs hold, the phase, grad
  mode, the autocast state, the Dynamo graph's code and input metadata, and graphddp's own
  source. The key is set on the Dynamo graph module (``gm._graphddp_cache_key``), whose
  attributes AOTAutograd hashes into its own key, so a compile with other plan inputs never reaches another's entry; and it
  names graphddp's entry (:class:`Entry`, a small pickle under ``<inductor cache dir>/graphddp``):
  the cold compile's Schedule, its backward graph's facts (what the planner reads), and the
  FX-graph keys of the forward and of the rewritten backward that AOTAutograd's entry points to.
  The key holds the autocast state (enabled and dtype, per device): AOTAutograd's own key held
  only whether autocast was on before torch 2.12 (the upstream fix: docs/gpu.md), so under torch 2.11 a graph
  compiled under bf16 autocast was served to a run under fp16 from a shared cache directory (the
  likely cause of the GPU lane's fp16 case failing on DDP(torch.compile)'s side, docs/gpu.md).
* **The cost model is checked, not keyed.** ``bucket_cap_mb="auto"`` plans with a cost model
  calibrated on the link when the model is wrapped, so a restart measures other numbers. They
  are left out of the key; before the cache is read, this run's plan is made from the entry's
  facts (the planner is pure, and replanning them gave the cold plan back when it was stored),
  and the cache is used only if its buckets are the cached ones (else: compiled cold,
  ``compile_cache_replanned``). The hit's Schedule is this run's plan, its cost model included:
  what a cold compile in this run would record.
* **A hit gives the cold graph.** On a miss the rewritten backward is what AOTAutograd caches
  (:func:`mark_cacheable` gives the dispatcher the FX-graph key of the code it runs), after
  graphddp's entry is written. On a hit, the hit catcher (inductor's post-compile hook,
  ``config.cudagraph_policy``, which sees every output AOTAutograd loads from its cache) checks
  that exactly the forward and backward graphddp's entry names were loaded, and hands
  AOTAutograd a :class:`CachedBackward` in place of the backward; graphddp then builds the same
  dispatcher as cold around the loaded code. An AOTAutograd hit without a matching graphddp
  entry (deleted, written by an interrupted run) is compiled cold (``compile_cache_stale``).
* **What the cache does not hold is derived on first use.** The ``no_sync`` variant and the
  rewritten FX graph, by one more cold compile that must match the cached one
  (:mod:`graphddp.compiler.cache_derivation`, with the record of a hit).
* **Ranks cannot disagree because one hit.** Every rank has the same options and cost model
  (calibration agrees across ranks), a hit reproduces the plan a miss makes from them,
  compiling still never runs a collective (this is file I/O only), and every synchronising
  backward still agrees on the wire layout in band (:mod:`graphddp.runtime.step`).

Not cached (compiled as before, AOTAutograd cache off): a traced comm hook (the user's hook code
is not something a key can cover; PowerSGD's phases), an attached optimizer, the
``aot_eager``/``eager`` backends, torch's caches switched off
(``torch.compiler.config.force_disable_caches``, ``torch._functorch.config.enable_autograd_cache``),
``GRAPHDDP_COMPILE_CACHE=0``. ``torch._dynamo.utils.counters["graphddp"]`` counts
``compile_cache_hit``/``_miss``/``_bypass``/``_replanned``/``_stale``/``_derive``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from graphddp.runtime.disk import enabled, write_atomically

log = logging.getLogger("graphddp")

FORMAT = 3  # of Entry and of the key; bump when either changes meaning
GM_ATTRIBUTE = "_graphddp_cache_key"


def count(what: str) -> None:
    from torch._dynamo.utils import counters

    counters["graphddp"][f"compile_cache_{what}"] += 1


@functools.cache
def _source_digest() -> str:
    """graphddp's own code, the whole package: a plan made by other code is another plan."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _input_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        try:
            stride = tuple(map(str, x.stride()))
        except RuntimeError:  # a layout without strides
            stride = (str(x.layout),)
        return ("tensor", str(x.dtype), x.device.type, tuple(map(str, x.shape)), stride, x.requires_grad)
    if isinstance(x, (int, float, bool, str, type(None))):
        return (type(x).__name__,)
    return (type(x).__qualname__,)


@dataclasses.dataclass
class Key:
    """graphddp's cache key of one Dynamo graph, and what checks a cached plan against this run."""

    key: str
    _facts: Callable[[torch.fx.GraphModule], Any]
    _plan: Callable[[Any, tuple[str, ...]], Any]

    def facts(self, backward: torch.fx.GraphModule) -> Any:
        """What the planner reads of the (untouched) backward graph."""
        return self._facts(backward)

    def plan(self, facts: Any, unreduced: tuple[str, ...]) -> Any:
        """The Schedule this run plans for a backward graph of these facts (the planner is pure;
        it computes with real tensors, so never inside a fake mode)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return self._plan(facts, unreduced)

    def replan(self, entry: "Entry") -> Any:
        """This run's plan of the entry's backward graph, or None if the planner fails on it."""
        try:
            return self.plan(entry.facts, entry.schedule.unreduced)
        except Exception:  # noqa: BLE001 - compiled cold instead
            log.warning("graphddp compile cache: could not replan graph %d from its entry", entry.schedule.graph_index, exc_info=True)
            return None

    def cacheable(self, facts: Any, schedule: Any) -> bool:
        """Replanning the facts gives ``schedule`` back: the plan is the planner's alone, and a
        later run can tell from the facts whether its own plan is this one."""
        try:
            return self.plan(facts, schedule.unreduced) == schedule
        except Exception:  # noqa: BLE001 - not cached; the compile goes on
            log.warning("graphddp compile cache: could not replan graph %d, not caching it", schedule.graph_index, exc_info=True)
            return False


def plan_key(
    backend: Any, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], param_inputs: Mapping[int, str],
    graph_index: int, phase: str,
) -> Key | None:
    """graphddp's cache key of one Dynamo graph, or None where it is not cached (module docstring).

    ``backend`` is the :class:`~graphddp.compiler.graph_compiler.GraphCompiler` compiling it. The cost
    model is left out of the key: ``bucket_cap_mb="auto"`` calibrates it anew in every run, and
    what counts is whether its plan changes, which :meth:`Key.plan` tells from the entry's facts.
    """
    reason = None
    config = backend.config
    if not enabled():
        reason = "disabled"
    elif config.backend != "inductor":
        reason = "backend"
    elif backend.hook is not None:
        reason = "traced comm hook"
    elif backend.optimizer is not None:
        reason = "optimizer"
    options = repr(tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "cost"))
    if reason is None and " at 0x" in options:  # an object without a stable repr
        reason = "options without a stable repr"
    if reason is not None:
        log.debug("graphddp compile cache not used for graph %d: %s", graph_index, reason)
        count("bypass")
        return None
    parts = (
        FORMAT, _source_digest(), torch.__version__, options, backend.world_size, backend.group_name, graph_index,
        phase, torch.is_grad_enabled(), _autocast_state(), sorted(param_inputs.items()), backend.frame_plans(graph_index),
        gm.code, [_input_meta(x) for x in example_inputs],
    )

    def facts(backward: torch.fx.GraphModule) -> Any:
        from graphddp.graph.capture import extract_facts

        return extract_facts(backward, param_inputs)

    def plan(facts: Any, unreduced: tuple[str, ...]) -> Any:
        return backend.plan_graph(facts, graph_index, unreduced)

    return Key(hashlib.sha256(repr(parts).encode()).hexdigest(), facts, plan)


# -- graphddp's entry beside AOTAutograd's -----------------------------------------------------------


@dataclasses.dataclass
class Entry:
    """What a hit needs besides AOTAutograd's entry: the plan, its graph's facts, and the code
    it goes with. An inference graph (no backward) has only ``fw_key``."""

    fw_key: str  # FX-graph cache key of the forward
    bw_key: str | None  # ... of the rewritten backward, the one AOTAutograd's entry runs
    phase: str
    schedule: Any = None  # the Schedule of the cold compile
    facts: Any = None  # GraphFacts of its backward graph: this run's plan is Key.plan(facts, ...)
    format: int = FORMAT


def _path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "graphddp", key[:2], f"{key}.pkl")


def load(key: str) -> Entry | None:
    try:
        with open(_path(key), "rb") as f:
            entry = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a damaged entry is a miss
        log.warning("graphddp compile cache: unreadable entry %s, compiling", _path(key), exc_info=True)
        return None
    return entry if isinstance(entry, Entry) and entry.format == FORMAT else None


def store(key: str, entry: Entry) -> bool:
    """Write graphddp's entry; False on failure (AOTAutograd's is not written either)."""
    return write_atomically(_path(key), pickle.dumps(entry))


def fx_key(code: Any) -> str | None:
    return getattr(code, "_fx_graph_cache_key", None)


def mark_cacheable(dispatch: Any, compiled: Any) -> None:
    """Let AOTAutograd cache the backward ``dispatch`` runs: ``compiled``'s FX-graph key and guards."""
    for name in ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines", "guards_expr", "_time_taken_ns"):
        if hasattr(compiled, name):
            setattr(dispatch, name, getattr(compiled, name))


# -- the hit -------------------------------------------------------------------------------------------


class CachedBackward:
    """What AOTAutograd runs as the backward on a hit: graphddp's dispatcher, bound once built."""

    def __init__(self) -> None:
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable copies __dict__
        self.target: Callable[[list[Any]], Any] | None = None

    def __call__(self, args: list[Any]) -> Any:
        if self.target is None:
            raise RuntimeError("graphddp: a cached backward ran before graphddp bound its dispatcher; please report this")
        return self.target(args)


def hit_catcher(entry: Entry | None, previous: Any) -> Any:
    """Inductor's post-compile hook for one compile (module docstring); ``previous`` is the
    user's ``cudagraph_policy``, which still decides everything it decided."""
    return _catcher_class()(entry, previous)


@functools.cache
def _catcher_class() -> type:
    from torch._inductor.cudagraph_utils import CUDAGraphPolicy

    class HitCatcher(CUDAGraphPolicy):
        """Sees every output inductor's post-compile hands back during one compile: on an
        AOTAutograd hit, the forward and backward it loaded from the FX-graph cache."""

        def __init__(self, entry: Entry | None, previous: Any) -> None:
            self.entry, self.previous = entry, previous
            self.armed = entry is not None  # disarmed once this compile runs cold
            self.fw_code: Any = None
            self.bw_code: Any = None
            self.proxy: CachedBackward | None = None
            self.loaded: list[str | None] = []  # FX-graph keys of everything loaded while armed

        def cudagraphify(self, *args: Any, **kwargs: Any) -> Any:
            if self.previous is not None:
                return self.previous.cudagraphify(*args, **kwargs)
            return super().cudagraphify(*args, **kwargs)

        def should_wrap(self, compiled_graph: Any) -> bool:
            return self.previous.should_wrap(compiled_graph) if self.previous is not None else True

        def wrap_output(self, output_code: Any) -> Any:
            key = fx_key(output_code)
            if self.previous is not None:
                output_code = self.previous.wrap_output(output_code)
            entry = self.entry
            if not self.armed or entry is None:
                return output_code
            self.loaded.append(key)
            if key is not None and key == entry.fw_key:
                self.fw_code = output_code
            elif key is not None and key == entry.bw_key:
                self.bw_code = output_code
                self.proxy = CachedBackward()
                return self.proxy
            return output_code

        @property
        def hit(self) -> bool:
            """AOTAutograd loaded exactly the code graphddp's entry names: its forward, and its
            backward (``proxy``) unless it is an inference graph."""
            if not self.armed or self.entry is None:
                return False
            expected = [k for k in (self.entry.fw_key, self.entry.bw_key) if k is not None]
            return sorted(self.loaded, key=str) == sorted(expected)

    return HitCatcher


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    state = []
    for device in torch._C._autocast_supported_devices():
        with contextlib.suppress(Exception):  # a device type this build cannot query
            state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
    return state


@contextlib.contextmanager
def _autocast(state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    saved = _autocast_state()
    try:
        for device, on, dtype in state:
            torch.set_autocast_enabled(device, on)
            torch.set_autocast_dtype(device, dtype)
        yield
    finally:
        for device, on, dtype in saved:
            torch.set_autocast_enabled(device, on)
            torch.set_autocast_dtype(device, dtype)


def log_hit(graph_index: int, schedule: Any) -> None:
    count("hit")
    log.info(
        "graphddp plan for backward graph %d (fingerprint %s), from the compile cache:\n%s",
        graph_index, schedule.fingerprint(), schedule.to_table(),
    )
