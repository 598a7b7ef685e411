"""Warm restarts: graphddp's compiled graphs from torch's compile caches, its plans beside them.

A hit in AOTAutograd's cache would hand its backward straight to autograd, skipping graphddp's
rewrite and its dispatcher; so graphddp sets its own key on the Dynamo graph module
(``GM_ATTRIBUTE``, which AOTAutograd hashes into its key) and writes an :class:`Entry` beside
AOTAutograd's (docs/compile-cache.md):

* the key (:func:`plan_key`) covers every input of the plan but the cost model, the autocast
  state (bf16 or fp16, not only on or off) included;
* the cost model is checked, not keyed: ``bucket_cap_mb="auto"`` calibrates anew in every run,
  so this run's plan is made from the entry's facts (the planner is pure) and the cache is used
  only if its buckets are the cached ones (else ``compile_cache_replanned``);
* a hit gives the cold graph: the hit catcher (inductor's post-compile hook) checks that exactly
  the code the entry names was loaded and hands AOTAutograd a :class:`CachedBackward`, which the
  same dispatcher as cold is bound to; without a matching entry it compiles cold
  (``compile_cache_stale``); what the cache does not hold is derived on first use;
* ranks cannot disagree because one hit: a hit reproduces the plan a miss makes from the same
  options and cost model, the cache is file I/O only, and every synchronising backward still
  agrees on the wire layout in band.

Not cached: a traced comm hook (its code is nothing a key can cover), an attached optimizer, the
``aot_eager``/``eager`` backends, torch's caches off, ``GRAPHDDP_COMPILE_CACHE=0``.
"""

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from graphddp.runtime.disk import enabled, graphddp_path, write_atomically

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
    facts: Callable[[torch.fx.GraphModule], Any]  # what the planner reads of the (untouched) backward graph
    _plan: Callable[[Any, tuple[str, ...]], Any]

    def plan(self, facts: Any, unreduced: tuple[str, ...]) -> Any:
        """The Schedule this run plans for a backward graph of these facts, never inside a fake mode."""
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
    """graphddp's cache key of one Dynamo graph compiled by ``backend`` (a GraphCompiler), or None
    where it is not cached."""
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
    return graphddp_path(key[:2], f"{key}.pkl")


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
    """Inductor's post-compile hook for one compile; ``previous`` is the user's
    ``cudagraph_policy``, which still decides everything it decided."""
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
            if key is not None and key == entry.bw_key:
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
    def put(values: list[tuple[str, bool, torch.dtype]]) -> None:
        for device, on, dtype in values:
            torch.set_autocast_enabled(device, on)
            torch.set_autocast_dtype(device, dtype)
    saved = _autocast_state()
    try:
        put(state)
        yield
    finally:
        put(saved)


def log_hit(graph_index: int, schedule: Any) -> None:
    count("hit")
    log.info(
        "graphddp plan for backward graph %d (fingerprint %s), from the compile cache:\n%s",
        graph_index, schedule.fingerprint(), schedule.to_table(),
    )
