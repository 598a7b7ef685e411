"""Warm restarts: graphddp's graphs come from torch's compile caches.

Each run is a fresh pair of gloo ranks (new processes: nothing in memory can fake a hit) with
the caches set per rank. Run 1 compiles cold into one directory. Run 2 is the restart, and a
mixed one: rank 0 reads that directory (a hit), rank 1 an empty one for every cache a hit is
made of (FX graphs, AOTAutograd's and graphddp's entries: a miss), its C++ kernels loaded from
the first directory (``graphddp.testing.graph_caches_in``: building them again tests nothing).
A hit must give exactly the cold compile's plan and code, the two ranks must agree (the in-band
layout check runs every synchronising step) and train like DDP, ``no_sync`` included (the
variant the cache does not hold is derived on first use); and a changed option must not hit
the entry of the old one. The same runs train a frame that recompiles (the recompile matrix's
cached cells), whose every graph must come from the cache on the restart.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphddp
from graphddp.models import MLP
from graphddp.testing import graph_caches_in, missing_torch_feature, paired_grads, spawn

pytestmark = pytest.mark.skipif(bool(missing_torch_feature("caches")), reason=str(missing_torch_feature("caches")))

# Caps given, so the plan's inputs are the same run to run: bucket_cap_mb="auto" plans with a
# cost model calibrated on the link at wrap time, which a restart measures anew (and the key
# covers it: ranks must never mix plans made with different measurements).
CAP = 25.0  # MB: one bucket on the MLP


TINY_CAP = 0.001  # MB: four buckets


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {k: dict(counters[k]) for k in ("graphddp", "aot_autograd", "inductor")}


def _train_like_ddp(steps: int = 3, no_sync_step: int = 1) -> graphddp.GraphDDP:
    """graphddp against DDP, SGD on both; the step ``no_sync_step`` accumulates under no_sync."""
    torch.manual_seed(0)
    model = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = graphddp.compile(model, bucket_cap_mb=CAP)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    rank = dist.get_rank()
    for step in range(steps):
        x, y = _batch(rank, step)
        for m in (ref, ours):
            if step == no_sync_step:
                with m.no_sync():
                    nn.functional.mse_loss(m(x), y).backward()
            else:
                nn.functional.mse_loss(m(x), y).backward()
        if step == no_sync_step:
            continue  # gradients accumulate into the next step
        for name, p, q in paired_grads(ours.module, ref.module, step):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"step {step} grad {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return ours


def _rank(rank: int, world: int, cache_dir: str, graph_dirs: list[str], out: str, other_cap: bool) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    with graph_caches_in(graph_dirs[rank]):
        _report(rank, out, other_cap)


def _report(rank: int, out: str, other_cap: bool) -> None:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    ours = _train_like_ddp()
    (record,) = ours.records
    report = {
        "counters": _counters(), "fingerprint": record.schedule.fingerprint(), "code": record.generated_code,
        "graph": record.graph.code, "record_type": type(record).__name__,
    }
    if other_cap:
        report["other"] = _compile_other_cap(rank)
    report["recompiled"] = _recompiled_frames(rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(report, f)


def _compile_other_cap(rank: int) -> dict:
    """The same model with another cap, on the same cache: a miss (never the old plan's entry)."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    other = graphddp.compile(MLP(), bucket_cap_mb=TINY_CAP)
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(other(x), y).backward()
    (schedule,) = other.schedules
    return {"counters": _counters(), "fingerprint": schedule.fingerprint(), "buckets": [list(b.param_names) for b in schedule.buckets]}


def _recompiled_frames(rank: int) -> dict:
    """The recompile matrix's cached cells (``test_recompile.CACHED``: a frame compiled again
    after ``requires_grad`` changes, so a recompile's graphs too), each trained next to DDP
    (``train_cell`` compares every step): how many graphs they compiled, and the cache's answers."""
    from test_recompile import CACHED, FEATURES, TRIGGERS, train_cell
    from torch._dynamo.utils import counters

    counters.clear()
    graphs = 0
    for trigger, name in CACHED:
        ours = train_cell(TRIGGERS[trigger], FEATURES[name], rank, "inductor", what=f"restart {trigger} x {name}")
        graphs += len(ours._state.backend.step.graphs)
    return {"counters": dict(counters["graphddp"]), "graphs": graphs}


def _run(tmp_path, name: str, graph_dirs: list[str], other_cap: bool = False) -> list[dict]:
    """Both ranks' kernels in one directory, each rank's graph caches in its ``graph_dirs`` entry."""
    out = str(tmp_path / name)
    spawn(_rank, 2, graph_dirs[0], graph_dirs, out, other_cap, fresh=True)
    return [json.load(open(f"{out}.{r}")) for r in range(2)]


def test_warm_restart_hits_the_cache_and_gives_the_cold_plan_and_code(tmp_path):
    warm, empty = str(tmp_path / "cache"), str(tmp_path / "empty")
    cold = _run(tmp_path, "cold", [warm, warm])
    for report in cold:
        assert report["counters"]["graphddp"].get("compile_cache_miss") == 1, report["counters"]
        assert report["counters"]["aot_autograd"].get("autograd_cache_saved") == 1, report["counters"]
    assert cold[0]["fingerprint"] == cold[1]["fingerprint"]

    hit, miss = _run(tmp_path, "restart", [warm, empty], other_cap=True)
    # Rank 0 restarted from the cache: AOTAutograd's entry and graphddp's, no inductor compile.
    assert hit["counters"]["graphddp"].get("compile_cache_hit") == 1, hit["counters"]
    assert hit["counters"]["aot_autograd"].get("autograd_cache_hit") == 1, hit["counters"]
    assert "fxgraph_cache_miss" not in hit["counters"]["inductor"], hit["counters"]
    assert hit["record_type"] == "CachedRecord"
    # ... and the no_sync step derived the variant the cache does not hold, once.
    assert hit["counters"]["graphddp"].get("compile_cache_derive") == 1, hit["counters"]
    # Exactly the cold compile's plan, generated code and rewritten graph.
    assert hit["fingerprint"] == cold[0]["fingerprint"]
    assert hit["code"] == cold[0]["code"] and "all_reduce" in hit["code"]
    assert hit["graph"] == cold[0]["graph"]
    # Rank 1 compiled cold at the same time; the ranks agreed (the in-band check ran every
    # synchronising step) and both trained like DDP (checked on each rank).
    assert miss["counters"]["graphddp"].get("compile_cache_miss") == 1, miss["counters"]
    assert miss["fingerprint"] == hit["fingerprint"] and miss["code"] == hit["code"]

    # Another bucket cap on the warm cache (and on rank 1's): a miss, not AOTAutograd's entry
    # of the old plan; the buckets are the cap's, as a cold compile plans them (rank 1's).
    for report in (hit, miss):
        other = report["other"]
        assert other["counters"]["graphddp"].get("compile_cache_miss") == 1, other["counters"]
        assert other["counters"]["aot_autograd"].get("autograd_cache_miss") == 1, other["counters"]
        assert "compile_cache_stale" not in other["counters"]["graphddp"], other["counters"]
        assert other["fingerprint"] != hit["fingerprint"]
        assert len(other["buckets"]) > 1, other["buckets"]  # CAP: one bucket
    assert hit["other"]["buckets"] == miss["other"]["buckets"]
    assert hit["other"]["fingerprint"] == miss["other"]["fingerprint"]

    # A frame that recompiled (each rank trained it next to DDP in both runs): every one of its
    # graphs comes from the cache on the restart; rank 1's empty cache compiles them all again.
    for report in cold:
        assert report["recompiled"]["counters"].get("compile_cache_miss", 0) >= 2, report["recompiled"]
    warm_frames, cold_frames = hit["recompiled"], miss["recompiled"]
    assert warm_frames["counters"].get("compile_cache_hit") == warm_frames["graphs"] >= 2, warm_frames
    assert not {"compile_cache_miss", "compile_cache_stale", "compile_cache_replanned"} & set(warm_frames["counters"]), warm_frames
    assert cold_frames["counters"].get("compile_cache_miss") == cold_frames["graphs"], cold_frames
