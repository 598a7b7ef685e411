"""The compile cache in one process (a fake group): an auto plan hits only when the plan this run
makes is the cached one. Restarts on real ranks: ranks/test_warm_restart.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphddp
from graphddp import CostModel
from graphddp.models import MLP
from graphddp.testing import graph_caches_in, missing_torch_feature

pytestmark = pytest.mark.skipif(bool(missing_torch_feature("caches")), reason=str(missing_torch_feature("caches")))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


SLOW_LINK = CostModel(bandwidth_gbps=0.1, latency_us=1, compute_tflops=0.001)  # three buckets on the MLP


SLOW_LINK_AGAIN = CostModel(bandwidth_gbps=0.11, latency_us=1, compute_tflops=0.001)  # measured anew: same plan


HIGH_LATENCY = CostModel(bandwidth_gbps=100, latency_us=10000, compute_tflops=0.01)  # one bucket


@pytest.fixture
def empty_graph_caches(tmp_path):
    """Empty FX-graph, AOTAutograd and graphddp caches, so that a first compile misses, over the
    suite's shared C++ kernels (``graph_caches_in``): an empty ``TORCHINDUCTOR_CACHE_DIR`` made
    these tests build every kernel again."""
    with graph_caches_in(str(tmp_path)):
        yield


def _auto_step(cost: CostModel) -> tuple[object, dict[str, int]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = graphddp.compile(MLP(), bucket_cap_mb="auto", cost=cost)
    x, y = _batch(0, 0)
    nn.functional.mse_loss(model(x), y).backward()
    (record,) = model.records
    return record, dict(counters["graphddp"])


def test_auto_plan_hits_when_this_runs_plan_is_the_cached_one(fake_world, empty_graph_caches):
    """A restart calibrates the link anew: a hit needs the same buckets, not the same numbers.
    The entry keeps the backward graph's facts, and the plan of this run's cost model is made
    from them before the cache is read (in process: the caches read are on disk)."""
    fake_world(8)
    cold, counts = _auto_step(SLOW_LINK)
    assert counts.get("compile_cache_miss") == 1, counts
    warm, counts = _auto_step(SLOW_LINK_AGAIN)
    assert counts.get("compile_cache_hit") == 1, counts
    assert warm.schedule.fingerprint() == cold.schedule.fingerprint() and warm.schedule.num_buckets == 3
    assert warm.schedule.cost_model == SLOW_LINK_AGAIN  # this run's plan: its own cost model
    assert warm.generated_code == cold.generated_code
    other, counts = _auto_step(HIGH_LATENCY)  # another plan: compiled, never the cached code
    assert counts.get("compile_cache_replanned") == 1 and "compile_cache_hit" not in counts, counts
    assert other.schedule.num_buckets == 1 and other.schedule.cost_model == HIGH_LATENCY
    assert other.generated_code != cold.generated_code


def test_a_graph_compiled_under_one_autocast_dtype_is_not_served_under_another(fake_world, empty_graph_caches, monkeypatch):
    """torch before 2.12 keyed AOTAutograd's cache on whether autocast was on, not on its dtype
    (pytorch#181564): from a shared cache a graph compiled under bf16 was served under fp16 (the
    GPU lane, torch 2.11). graphddp's key holds the dtype, so its entries never cross."""
    from graphddp.compiler import cache as compile_cache
    from torch._dynamo.utils import counters

    fake_world(8)
    keys = []
    real = compile_cache.plan_key

    def recording(*args, **kwargs):
        key = real(*args, **kwargs)
        keys.append(key.key if key is not None else None)
        return key

    monkeypatch.setattr(compile_cache, "plan_key", recording)
    codes = {}
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = graphddp.compile(MLP(), bucket_cap_mb=25)
        x, y = _batch(0, 0)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        (record,) = model.records
        codes.setdefault(dtype, record.generated_code)
        assert record.generated_code == codes[dtype], dtype
        counts = dict(counters["graphddp"])
    assert None not in keys and keys[0] != keys[1] and keys[0] == keys[2], keys
    assert counts.get("compile_cache_hit") == 1, counts  # the third step: bf16's own entry
    assert codes[torch.bfloat16] != codes[torch.float16]
