"""The replicated compiler's passes (and ``sharding="optimizer"``'s) through :func:`compile_aot`:
the rewrite of each backward, inductor's pinned settings, variants compiled on first use, and warm
restarts from the compile cache.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphddp.compiler import cache as compile_cache
from graphddp.compiler import cache_derivation
from graphddp.compiler.aot import Compiler, Passes, compile_aot
from graphddp.compiler.record import CARRY, GraphRecord
from graphddp.config.inductor_settings import INDUCTOR_FX_ORDER_CONFIG, INDUCTOR_PINNED_CONFIG
from graphddp.runtime.dispatch import BackwardDispatch
from graphddp.optim.insert_gather import GATHER_INPUT
from graphddp.values.collectives import ALL_GATHER, REDUCE_SCATTER
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_wait


class ReplicatedCompile:
    """One Dynamo graph of the replicated compiler: each forward recorded (``record_forward``;
    ``gather="forward"``: its code replaced by ``wrap_forward(graph, code, compile_graph)``), each
    backward rewritten into a record per variant (``rewrite``) and run through ``dispatch``; the
    variant of the phase in use now compiled now, the others at first use; with a ``cache`` key,
    the AOTAutograd cache on."""

    def __init__(
        self, backend: str, gm: fx.GraphModule, record_forward: Callable[[fx.GraphModule], None],
        rewrite: Callable[[fx.GraphModule], dict[str, GraphRecord]], dispatch: Callable[..., BackwardDispatch],
        patches: dict[str, Any], phase_now: str, graph_index: int, cache: compile_cache.Key | None,
        wrap_forward: Callable[..., Any] | None = None,
    ) -> None:
        self.backend, self.gm = backend, gm
        self.record_forward, self.rewrite, self.dispatch = record_forward, rewrite, dispatch
        self.patches, self.phase_now, self.graph_index, self.cache = patches, phase_now, graph_index, cache
        self.wrap_forward = wrap_forward

    def compile(self, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # The example inputs are passed down, never kept: they are the real tensors of Dynamo's first
        # call (a graph after a break gets the previous graph's outputs: a GPT's logits), which this
        # object would hold for as long as the compiled code lives; a later compile (a cache hit's
        # derivation) fakes them.
        return self.cold(example_inputs) if self.cache is None else self.through_cache(self.cache, example_inputs)

    # -- the compile, with or without the AOTAutograd cache ---------------------------------------
    def passes(self, finish: Callable[..., Any], on_forward: Callable[[Any, bool], None]) -> Passes:
        """The forward recorded (and under ``gather="forward"`` wrapped), the backward rewritten:
        ``finish(records, synced, grads, plain, compiled, facts)`` makes what AOTAutograd runs as
        the backward; ``on_forward(code, inference)`` hears of each forward's code."""

        def forward(graph: fx.GraphModule, compiler: Compiler, inference: bool) -> Any:
            self.record_forward(graph)
            # Without inductor AOTAutograd's inference compiler is its forward compiler: it wraps those too.
            wrap = None if inference and self.backend == "inductor" else self.wrap_forward
            with unset_fake_temporarily():  # real constants are copied as they are
                source = copy.deepcopy(graph) if wrap is not None else None
            code = compiler.now(graph, settings=INDUCTOR_PINNED_CONFIG)
            on_forward(code, inference)
            return code if wrap is None else wrap(source, code, compiler.later)

        def backward(graph: fx.GraphModule, compiler: Compiler) -> Any:
            plain = copy.deepcopy(graph)
            # Outside the fake mode, as a backward compiled lazily: the planner computes with
            # real tensors (dynamic shapes and a cache hit's derivation compile it at once).
            with unset_fake_temporarily():
                facts = self.cache.facts(plain) if self.cache is not None else None
                records = self.rewrite(graph)
            now = records[self.phase_now]
            # Inductor rewrites what it compiles in place (on an FX-graph cache miss only):
            # the record keeps graphddp's graph, the same whether inductor compiled or loaded.
            compiled = compiler.now(compiler.copy(now.graph), now.extra_inputs())
            now.generated_code = getattr(compiled, "source_code", None)

            def synced(record: GraphRecord) -> Callable[[], Any]:
                compile_later = compiler.later(record.graph, record.extra_inputs())

                def compile_and_record() -> Any:
                    code = compile_later()
                    record.generated_code = getattr(code, "source_code", None)
                    return code

                return compile_and_record

            def grads(record: GraphRecord) -> Callable[[], Any] | None:
                return None if record.without_update is None else compiler.later(record.without_update, record.hook_inputs())

            return finish(records, synced, grads, compiler.later(plain), compiled, facts)

        def run(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
            """``aot_eager``: the graph's FX code; ``eager``: node by node through :class:`fx.Interpreter`."""
            return make_boxed_func(graph if self.backend != "eager" else lambda *args: fx.Interpreter(graph).run(*args))

        return Passes(forward, backward, pinned_config, run)

    def run_compile_fx(
        self, inputs: Sequence[Any], finish: Callable[..., Any], on_forward: Callable[[Any, bool], None] = lambda code, inference: None,
        catcher: Any = None, eager_backward: bool = False,
    ) -> Callable[..., Any]:
        """compile_fx with the AOTAutograd cache on (with a ``catcher``) or off; ``eager_backward``
        compiles the backward now instead of at the first backward."""
        functorch_patches: dict[str, Any] = {"enable_autograd_cache": catcher is not None}
        this_compile: dict[str, Any] = {}
        if catcher is not None:
            functorch_patches["bundled_autograd_cache"] = False
            this_compile["cudagraph_policy"] = catcher
            setattr(self.gm, compile_cache.GM_ATTRIBUTE, self.cache.key)  # type: ignore[union-attr] # AOTAutograd hashes it
        if eager_backward:
            functorch_patches["force_non_lazy_backward_lowering"] = True
        return compile_aot(self.backend, self.gm, inputs, self.passes(finish, on_forward), self.patches, functorch_patches, this_compile)

    def finish_cold(self, records: dict[str, GraphRecord], synced: Any, grads: Any, plain: Any, compiled: Any, facts: Any) -> BackwardDispatch:
        return self.dispatch(records, synced, grads, plain, {self.phase_now: compiled})

    def cold(self, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Without the AOTAutograd cache."""
        return self.run_compile_fx(example_inputs, self.finish_cold)

    # -- through the cache: a miss stores, a hit dispatches the cached code -------------------------
    def through_cache(self, cache: compile_cache.Key, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor import config as inductor_config

        entry = compile_cache.load(cache.key)
        plan_now = None  # this run's plan of the cached backward graph
        if entry is not None and entry.bw_key is not None:
            plan_now = cache.replan(entry)
            if plan_now is None or plan_now.fingerprint() != entry.schedule.fingerprint():
                # Another plan than the cached code's (bucket_cap_mb="auto" under a cost model
                # calibrated anew): compile cold, and leave both entries to the plan they hold.
                compile_cache.count("replanned")
                return self.cold(example_inputs)
        catcher = compile_cache.hit_catcher(entry, inductor_config.cudagraph_policy)
        forward: dict[str, Any] = {}
        on_forward, finish_and_store = self._storing(cache, catcher, forward)
        compiled_fn = self.run_compile_fx(example_inputs, finish_and_store, on_forward, catcher)
        if "key" in forward:  # a miss: compiled cold; the backward and both entries at the first backward
            compile_cache.count("miss")
            return compiled_fn
        if catcher.hit and entry is not None and entry.bw_key is None:  # an inference graph: nothing to rewrite
            compile_cache.count("hit")
            return compiled_fn
        if not catcher.hit or catcher.proxy is None or entry is None or plan_now is None:
            # AOTAutograd hit an entry that graphddp's does not name (none, or another plan's):
            # compile cold, and write graphddp's entry for the next run.
            compile_cache.count("stale")
            return self.run_compile_fx(example_inputs, finish_and_store, on_forward)
        return self._hit(entry, plan_now, catcher, compiled_fn, example_inputs)

    def _storing(self, cache: compile_cache.Key, catcher: Any, forward: dict[str, Any]) -> tuple[Callable[..., None], Callable[..., BackwardDispatch]]:
        """The forward and backward callbacks of a compile whose entries go to the cache."""
        phase_now = self.phase_now

        def on_forward(code: Any, is_inference: bool) -> None:
            """This compile runs cold; an inference graph (no backward) has its entry now."""
            catcher.armed = False
            forward["key"] = compile_cache.fx_key(code)
            if is_inference and forward["key"] is not None:
                compile_cache.store(cache.key, compile_cache.Entry(forward["key"], None, phase_now))

        def finish_and_store(records: dict[str, GraphRecord], synced: Any, grads: Any, plain: Any, compiled: Any, facts: Any) -> BackwardDispatch:
            """The cold dispatcher; graphddp's entry is written before AOTAutograd's, if
            replanning the facts gives the plan back."""
            backward = self.finish_cold(records, synced, grads, plain, compiled, facts)
            fw_key, bw_key, schedule = forward.get("key"), compile_cache.fx_key(compiled), records[phase_now].schedule
            if (
                fw_key is not None and bw_key is not None and len([k for k in records if k != CARRY]) == 1
                and cache.cacheable(facts, schedule)
                and compile_cache.store(cache.key, compile_cache.Entry(fw_key, bw_key, phase_now, schedule, facts))
            ):
                compile_cache.mark_cacheable(backward, compiled)
            return backward

        return on_forward, finish_and_store

    def _hit(
        self, entry: Any, plan_now: Any, catcher: Any, compiled_fn: Callable[..., Any], example_inputs: Sequence[Any],
    ) -> Callable[..., Any]:
        """A hit: this run's plan around the cached backward code; the local variant is derived by
        one cold compile if a step ever needs it."""
        phase_now = self.phase_now

        def compile_cold(inputs: Sequence[Any]) -> cache_derivation.Derived:
            """What a miss compiles (inductor's compiles hit its FX-graph cache), backward included."""
            got: dict[str, Any] = {}

            def finish_derived(records: dict[str, GraphRecord], synced: Any, grads: Any, plain: Any, compiled: Any, facts: Any) -> Any:
                carry = synced(records[CARRY]) if CARRY in records else None
                got.update(records=records, plain=plain, bw_key=compile_cache.fx_key(compiled), carry=carry)
                return compiled

            def on_derived_forward(code: Any, is_inference: bool) -> None:
                got["fw_key"] = compile_cache.fx_key(code)

            self.run_compile_fx(inputs, finish_derived, on_derived_forward, eager_backward=True)
            return cache_derivation.Derived(got["records"], got["plain"], got.get("fw_key"), got.get("bw_key"), got.get("carry"))

        derivation = cache_derivation.Derivation(self.graph_index, entry, plan_now, compile_cold, example_inputs)
        record = cache_derivation.CachedRecord(plan_now, getattr(catcher.bw_code, "source_code", None), phase_now, derivation)
        compile_cache.log_hit(self.graph_index, plan_now)
        backward = self.dispatch(  # one phase (no traced hook), no update (no optimizer): see plan_key
            {phase_now: record}, lambda record: (lambda: catcher.bw_code), lambda record: None,
            lambda: derivation.get().plain(), {phase_now: catcher.bw_code},
            derive_carry=lambda: derivation.get().carry,
        )
        catcher.proxy.target = backward
        return compiled_fn


def pinned_config(graph: fx.GraphModule) -> dict[str, Any]:
    """graphddp's inductor settings for ``graph``: in graphddp's own FX order where the graph waits
    for a sharded bucket's collective itself (a backward with reduce-scatters, a forward that
    completes all-gathers before each bucket's first read; ``INDUCTOR_FX_ORDER_CONFIG`` says why)."""
    for node in graph.graph.nodes:
        if node.meta.get(BUCKET_KEY) is None:
            continue
        if node.target in REDUCE_SCATTER.ops or node.meta.get(ROLE_KEY) == GATHER_INPUT or (
            node.target in ALL_GATHER.ops and any(is_wait(u) for u in node.users)
        ):
            return INDUCTOR_FX_ORDER_CONFIG
    return INDUCTOR_PINNED_CONFIG

