"""graphddp against DDP: one matrix of model x feature x backend, on spawned gloo ranks.

Models, written the way real code is written:

* small ones from ``graphddp.models``: an MLP, an MLP with frozen parameters, an MLP with a
  Dynamo graph break (also on 3 ranks), a CNN with BatchNorm;
* a TinyGPT with a graph break between its blocks (tied embedding used on both sides of the
  break), a 3-layer net with BatchNorm and a graph break that returns
  ``types.SimpleNamespace(loss=...)``;
* Hugging Face ``GPT2LMHeadModel`` (tied embeddings; a graph break: 2 graphs) and
  ``BertForMaskedLM`` (tied decoder, attention mask with padding; one graph) built from tiny
  configs, no download, dropout 0, loss computed by the model from ``labels=``.

Features, each checked against ``torch.nn.parallel.DistributedDataParallel`` on 2 spawned gloo
ranks with rank-dependent data, every ``p.grad`` each step and the parameters (and buffers)
after the steps:

* ``plain``: three ordinary steps; each trainable parameter in exactly one bucket per graph,
  frozen ones in none, several buckets under the small caps;
* ``no_sync``: two accumulated micro-batches under ``no_sync()``, then a synchronised one;
* ``toggle_requires_grad``: freeze a block, train, unfreeze (DDP with find_unused_parameters);
  graphddp must re-plan without the frozen parameters, their grads stay ``None`` in both;
* ``fp16_compress`` / ``bf16_compress``: ``comm_hook=`` against DDP + ``default_hooks``' hook
  of the same name; every bucket travels in half precision;
* ``buffers_on`` / ``buffers_off``: ``broadcast_buffers`` True / False on both sides; buffers
  compared with DDP each step, and after an eval forward the ranks' buffers are equal with the
  broadcast (it happens before that forward) and differ without it (models whose buffers
  change in forward); the Hugging Face models (constant bool / int64 buffers) run ``buffers_on``;
* ``buffers_off_rank_local`` (BatchNorm model): ``broadcast_buffers=False`` with buffers that
  differ between ranks before wrapping; DDP leaves them rank-local, at construction too;
* ``resume``: train 1 step, save model + optimizer state, load into a fresh graphddp model with
  other initial weights, continue: bitwise equal to the uninterrupted run;
* ``dynamic_shapes``: a different sequence length (or batch size) each step, different
  between the ranks at one step (``dynamic=None``: a static graph, then automatic dynamic).

Spawning costs seconds, so each (model, backend) runs all its features in ONE spawn; a feature's
checks never raise inside a step (a rank that raised while its peer went on to the next
collective would hang the pair), they are collected, and each (model, feature) is its own
pytest test that reports what its feature collected (selecting one such test still runs its
model's whole spawn, once per session). aot_eager for the whole matrix; inductor
for a representative subset (slow: it compiles C++). Features with their own reference or
setup have their own files beside this one: the optimizer inside the backward
(``test_optim_ranks``), on a shard (``test_sharded``), comm hooks and PowerSGD (``test_hooks_ranks``), ranks that differ
(``test_ddp_scenarios``), uneven inputs (``test_join``), dtypes, autocast, checkpointing and
process groups (``test_ddp_parity``, ``test_ddp_parity_groups``). The models are in
``matrix_models.py``, each feature's steps and checks in ``matrix_features.py``.
``GRAPHDDP_TEST_TIMES=1`` (with ``-s``) prints each feature's wall and CPU time per rank.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
from matrix_features import FEATURES, Check
from matrix_models import SPECS

from graphddp.testing import spawn


# -- one spawn per (model, backend) ------------------------------------------------------------------


def _matrix(rank: int, world: int, model: str, backend: str, features: tuple[str, ...], out_dir: str) -> None:
    spec = SPECS[model]
    results: dict[str, list[str]] = {}
    for feature in features:
        torch._dynamo.reset()  # a fresh recompile budget per feature
        check = Check(rank)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            FEATURES[feature](spec, rank, world, backend, check)
        except Exception:  # graphddp raised: same on every rank in practice; recorded, not fatal
            check.fail("raised:\n" + traceback.format_exc())
        if os.environ.get("GRAPHDDP_TEST_TIMES"):
            print(f"[rank {rank}] {model} {backend} {feature}: {time.perf_counter() - t0:.1f} s wall, "
                  f"{time.process_time() - c0:.1f} s cpu", file=sys.stderr, flush=True)
        results[feature] = check.failures
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after each: partial results survive
            json.dump(results, f)


_RESULTS: dict[tuple, dict[str, list[str]]] = {}


def _results(model: str, backend: str, features: tuple[str, ...], world: int = 2) -> dict[str, list[str]]:
    key = (model, backend, features, world)
    if key not in _RESULTS:
        merged: dict[str, list[str]] = {f: [] for f in features}
        with tempfile.TemporaryDirectory() as out_dir:
            error = None
            try:
                spawn(_matrix, world, model, backend, features, out_dir, timeout=400)
            except Exception as e:  # a rank died or hung: report it with every feature it did not finish
                error = f"spawn failed: {e}"
            done: set[str] = set(features)
            for r in range(world):
                path = os.path.join(out_dir, f"rank{r}.json")
                got = json.load(open(path)) if os.path.exists(path) else {}
                done &= set(got)
                for f, msgs in got.items():
                    merged[f] += msgs
            for f in features:
                if f not in done or (error and done == set(features)):  # not finished, or teardown failed
                    merged[f].append(error or "not run")
        _RESULTS[key] = merged
    return _RESULTS[key]


def _report(failures: list[str]) -> str:
    shown = failures[:8]
    more = f"\n... and {len(failures) - len(shown)} more" if len(failures) > len(shown) else ""
    return "\n".join(shown) + more


# The real-code models run every feature (plain is implied: each feature compares every step).
# Buffer features where they test something: BatchNorm gets them all. break_gpt has no buffers;
# the Hugging Face models' buffers (GPT-2's bool causal mask, BERT's position / token-type ids)
# never change, and every other feature runs with broadcast_buffers on (the default) and
# compares them with DDP's, so they survive the broadcast (bool and int64 included) there.
ALL = tuple(f for f in FEATURES if f not in ("plain", "bf16_compress"))
NO_BUFFERS = tuple(f for f in ALL if not f.startswith("buffers"))
FEATURES_OF = {
    "mlp": ("plain", "no_sync", "toggle_requires_grad", "bf16_compress"),
    "frozen_mlp": ("plain",),
    "break_mlp": ("plain",),
    "cnn_bn": ("plain", "buffers_on", "buffers_off"),
    "break_gpt": NO_BUFFERS,
    "namespace_bn": ALL,
    # HF GPT-2: the features whose graphs it changes (auto plan and toggles run on both GPTs
    # written here and on namespace_bn; a resumed checkpoint on BERT and both of them)
    "hf_gpt2": ("no_sync", "fp16_compress", "dynamic_shapes"),
    # BERT's own paths (token-type ids, a pooler): the features whose graphs it changes; the
    # auto plan, toggles and hooks run on both GPTs
    "hf_bert": ("no_sync", "resume", "dynamic_shapes"),
}
MATRIX = [(m, f) for m, fs in FEATURES_OF.items() for f in fs]


@pytest.mark.parametrize("model,feature", MATRIX, ids=[f"{m}-{f}" for m, f in MATRIX])
def test_feature_matches_ddp_aot_eager(model, feature):
    failures = _results(model, "aot_eager", FEATURES_OF[model])[feature]
    assert not failures, _report(failures)


# fp16_compress runs with broadcast_buffers on and compares BatchNorm's buffers with DDP's.
# no_sync across a graph break: two backward graphs carry the accumulated gradients into their
# buckets in inductor's code (an MLP: every C++ compile here is the suite's time; HF GPT-2 runs
# under inductor in tests/unit/test_pipelines.py).
INDUCTOR = {"break_mlp": ("no_sync",), "namespace_bn": ("fp16_compress", "bf16_compress")}
INDUCTOR_CASES = [(m, f) for m, fs in INDUCTOR.items() for f in fs]


def test_three_ranks_across_a_graph_break_match_ddp():
    failures = _results("break_mlp", "aot_eager", ("plain",), world=3)["plain"]
    assert not failures, _report(failures)


@pytest.mark.slow
@pytest.mark.parametrize("model,feature", INDUCTOR_CASES, ids=[f"{m}-{f}" for m, f in INDUCTOR_CASES])
def test_feature_matches_ddp_inductor(model, feature):
    failures = _results(model, "inductor", INDUCTOR[model])[feature]
    assert not failures, _report(failures)
