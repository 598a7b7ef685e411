"""A compile-cache hit's record and the variants the cache does not hold, derived on first use.

The ``no_sync`` variant and the rewritten FX graph (``record.graph``) are not in the cache: the
first time a step or a user needs them, :class:`Derivation` compiles the Dynamo graph once more,
cold, in the saved tracing context (inductor's compiles hit its FX-graph cache), and checks that
the forward, the backward and the plan are exactly the cached ones.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from graphddp.compiler.cache import _autocast, _autocast_state, count
from graphddp.compiler.record import GraphRecord
from graphddp.runtime.disk import ENV

if TYPE_CHECKING:
    from graphddp.compiler.cache import Entry

log = logging.getLogger("graphddp")


class CachedRecord(GraphRecord):
    """A record from the compile cache: the plan and the code now, the graph on first read."""

    def __init__(self, schedule: Any, generated_code: str | None, phase: str, derivation: "Derivation") -> None:
        self._phase, self._derivation = phase, derivation
        self._graph = None
        super().__init__(schedule=schedule, graph=None, generated_code=generated_code)

    @property  # type: ignore[override]
    def graph(self) -> torch.fx.GraphModule:
        if self._graph is None:
            self._graph = self._derivation.get().records[self._phase].graph
        return self._graph

    @graph.setter
    def graph(self, value: Any) -> None:
        self._graph = value

    def __repr__(self) -> str:  # the dataclass repr would derive the graph
        return f"CachedRecord(graph_index={self.schedule.graph_index}, phase={self._phase!r}, fingerprint={self.schedule.fingerprint()})"


@dataclasses.dataclass
class Derived:
    """What a cold compile of the graph gives, for a hit's graph and ``no_sync`` variant."""

    records: dict[str, Any]  # phase -> GraphRecord
    plain: Callable[[], Any]  # compiles the variant without communication
    fw_key: str | None
    bw_key: str | None
    carry: Callable[[], Any] | None = None  # compiles the carrying variant, where the graph has one


class Derivation:
    """A hit's graphs and variants that are not in the cache, compiled once when first needed by
    ``compile_cold(inputs)``, as a miss compiles, in the hit's tracing and compile context and
    autocast state, with grad mode on (the ``no_sync`` variant is first needed inside a backward)."""

    def __init__(
        self, graph_index: int, entry: Entry, schedule: Any, compile_cold: Callable[[Sequence[Any]], Derived],
        example_inputs: Sequence[Any],
    ) -> None:
        from torch._guards import CompileContext, TracingContext

        self.graph_index, self.entry, self.schedule, self._compile_cold = graph_index, entry, schedule, compile_cold
        self._tracing, self._compile_context = TracingContext.try_get(), CompileContext.try_get()
        self._autocast = _autocast_state()
        self._inputs = _fake_inputs(example_inputs, self._tracing)
        self._derived: Derived | None = None

    def get(self) -> Derived:
        if self._derived is None:
            self._derived = self._derive()
        return self._derived

    def _derive(self) -> Derived:
        from torch._dynamo.convert_frame import compile_lock
        from torch._guards import compile_context, tracing

        count("derive")
        log.info("graphddp compile cache: compiling graph %d once more for what the cache does not hold", self.graph_index)
        with compile_lock, tracing(self._tracing), compile_context(self._compile_context), torch.enable_grad(), _autocast(self._autocast):
            derived = self._compile_cold(self._inputs)
        entry = self.entry
        mismatch = []
        if (derived.fw_key, derived.bw_key) != (entry.fw_key, entry.bw_key):
            mismatch.append(f"code (FX-graph keys {derived.fw_key}/{derived.bw_key}, cached {entry.fw_key}/{entry.bw_key})")
        if derived.records[entry.phase].schedule != self.schedule:
            mismatch.append("the plan")
        if mismatch:
            raise RuntimeError(
                f"graphddp: backward graph {self.graph_index} from the compile cache differs from a fresh compile of it in "
                f"{' and '.join(mismatch)}; the cached graph cannot be combined with variants compiled now. Remove the "
                f"inductor cache directory (TORCHINDUCTOR_CACHE_DIR) or set {ENV}=0, and please report this."
            )
        return derived


def _fake_inputs(example_inputs: Sequence[Any], tracing_context: Any) -> list[Any]:
    """The example inputs as the tracing context's fake tensors: no real memory kept alive."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = getattr(tracing_context, "fake_mode", None)

    def fake(x: Any) -> Any:
        if fake_mode is None or not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        try:
            return fake_mode.from_tensor(x)  # Dynamo's own fake of it (memoised)
        except Exception:  # noqa: BLE001 - keep the real tensor: correct, only holds its memory
            return x

    return [fake(x) for x in example_inputs]
