"""Random small models, graphddp next to DDP, drawn with Hypothesis.

Each drawn configuration is an MLP-like stack: an input layer, ``depth`` hidden layers, an
output layer, with a drawn width, activation and bias; optionally a hidden weight tied to
another (one ``nn.Parameter`` in two modules, like a tied embedding), frozen layers, a layer no
forward path uses, a Dynamo graph break between two hidden layers, a dtype (float32, float64,
bfloat16: all three all-reduce on gloo CPU) and bucket caps (``bucket_cap_mb``, optionally
``last_bucket_cap_mb``). graphddp (``aot_eager``) and ``DistributedDataParallel``
(``find_unused_parameters`` where a layer is unused) train 2 SGD steps on rank-dependent data;
every ``p.grad`` is compared each step (``None`` in both for frozen and unused parameters), the
parameters after the steps, and frozen or unused parameters must be in no bucket.

Spawning ranks costs seconds, so the configurations are drawn in the parent (Hypothesis'
generation phase, deterministic: ``derandomize``) and ALL of them run in ONE spawn per world
size; a configuration's checks are collected, never raised mid-step (a rank that raised while
its peers went on to the next collective would hang them), and the test lists every failing
configuration with a line that reproduces it alone. No shrinking (each try would be a spawn).
``GRAPHDDP_HYPOTHESIS_SEED=<int>`` draws another set; ``GRAPHDDP_RANDOM_MODELS=<n>`` another count.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.testing import spawn

D_IN, D_OUT, BATCH = 8, 3, 6
TOL = {
    "float32": {"atol": 1e-5, "rtol": 1e-4},
    "float64": {"atol": 1e-10, "rtol": 1e-9},
    # bf16 keeps 8 significant bits: allow a couple of ulps of rounding difference.
    "bfloat16": {"atol": 1e-2, "rtol": 1.6e-2},
}


# -- the drawn configuration --------------------------------------------------------------------------


@st.composite
def model_configs(draw: Any) -> dict[str, Any]:
    depth = draw(st.integers(1, 4))
    hidden = [f"h{i}" for i in range(depth)]
    tie = None
    if depth >= 2 and draw(st.booleans()):
        i, j = sorted(draw(st.lists(st.integers(0, depth - 1), min_size=2, max_size=2, unique=True)))
        tie = (i, j)  # h{j}.weight is h{i}.weight
    return {
        "depth": depth,
        "width": draw(st.integers(4, 24)),
        "bias": draw(st.booleans()),
        "act": draw(st.sampled_from(["relu", "tanh", "gelu"])),
        "tie": tie,
        # The output layer stays trainable, so there is always something to average.
        "frozen": sorted(draw(st.sets(st.sampled_from(["inp", *hidden]), min_size=1, max_size=2)))
        if draw(st.booleans()) else [],
        "unused": draw(st.booleans()),
        # Break after this many hidden layers (0: right after the input layer), or none.
        "graph_break": draw(st.integers(0, depth)) if draw(st.booleans()) else None,
        "dtype": draw(st.sampled_from(["float32", "float64", "bfloat16"])),
        "bucket_cap_mb": draw(st.sampled_from([0.0005, 0.002, 0.01, 25.0])),
        "last_bucket_cap_mb": draw(st.none() | st.sampled_from([0.0005, 0.002])),
    }


def draw_configs(n: int) -> list[dict[str, Any]]:
    """``n`` configurations from Hypothesis' generation phase, the same every run by default."""
    drawn: list[dict[str, Any]] = []
    seed_env = os.environ.get("GRAPHDDP_HYPOTHESIS_SEED")

    @settings(max_examples=n, derandomize=seed_env is None, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(model_configs())
    def collect(cfg: dict[str, Any]) -> None:
        if cfg not in drawn:
            drawn.append(cfg)

    if seed_env is not None:
        collect = seed(int(seed_env))(collect)
    collect()
    return drawn


class RandomNet(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        w, bias = cfg["width"], cfg["bias"]
        self.act = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[cfg["act"]]
        self.inp = nn.Linear(D_IN, w, bias=bias)
        self.hidden = nn.ModuleList(nn.Linear(w, w, bias=bias) for _ in range(cfg["depth"]))
        self.out = nn.Linear(w, D_OUT, bias=bias)
        if cfg["tie"] is not None:
            i, j = cfg["tie"]
            self.hidden[j].weight = self.hidden[i].weight
        if cfg["unused"]:
            self.unused = nn.Linear(w, w)  # registered, never called
        self.graph_break = cfg["graph_break"]
        self.to(getattr(torch, cfg["dtype"]))
        for name in cfg["frozen"]:
            for p in self.get_submodule(name if name == "inp" else f"hidden.{name[1:]}").parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        # The break sits between two loops, not inside one: a break inside a loop makes Dynamo
        # run the whole frame eagerly (graphddp then raises; see test_ddp_scenarios).
        split = len(self.hidden) if self.graph_break is None else self.graph_break
        for layer in self.hidden[:split]:
            h = self.act(layer(h))
        if self.graph_break is not None:
            torch._dynamo.graph_break()
        for layer in self.hidden[split:]:
            h = self.act(layer(h))
        return self.out(h)


# -- on the ranks ----------------------------------------------------------------------------------------


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, cond: bool, msg: str) -> None:
        if not cond:
            self.failures.append(msg)

    def close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, tol: dict) -> None:
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as e:
            self.failures.append(f"{what}: {e}")


def _batch(cfg: dict[str, Any], rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    dtype = getattr(torch, cfg["dtype"])
    return torch.randn(BATCH, D_IN, generator=g).to(dtype), torch.randn(BATCH, D_OUT, generator=g).to(dtype)


def _one(cfg: dict[str, Any], rank: int, check: Check, steps: int = 2) -> None:
    torch.manual_seed(1234)
    model = RandomNet(cfg)
    tol = TOL[cfg["dtype"]]
    ref = DDP(copy.deepcopy(model), find_unused_parameters=cfg["unused"])
    ours = graphddp.compile(copy.deepcopy(model), backend="aot_eager", bucket_cap_mb=cfg["bucket_cap_mb"],
                            last_bucket_cap_mb=cfg["last_bucket_cap_mb"])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    named_ref = dict(ref.module.named_parameters())
    for step in range(steps):
        x, y = _batch(cfg, rank, step)
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(m(x).float(), y.float()).backward()
        for name, p in ours.module.named_parameters():
            q = named_ref[name]
            if p.grad is None or q.grad is None:
                check.expect(p.grad is None and q.grad is None,
                             f"step {step} {name}: grad None in {'graphddp' if p.grad is None else 'DDP'} only")
                continue
            check.expect(p.grad.dtype == q.grad.dtype, f"step {step} {name}: grad dtype {p.grad.dtype} vs {q.grad.dtype}")
            check.close(p.grad, q.grad, f"step {step} grad {name}", tol)
        for name, p in ours.module.named_parameters():
            if not p.requires_grad or name.startswith("unused."):
                check.expect(p.grad is None, f"step {step} {name}: frozen or unused but has a grad")
        for opt in opts:
            opt.step()
    for name, p in ours.module.named_parameters():
        check.close(p.detach(), named_ref[name].detach(), f"param {name} after {steps} steps", tol)
    in_buckets = {n for s in ours.schedules for n in s.param_names}
    trainable_used = {n for n, p in ours.module.named_parameters() if p.requires_grad and not n.startswith("unused.")}
    check.expect(in_buckets == trainable_used,
                 f"bucketed {sorted(in_buckets)} != trainable and used {sorted(trainable_used)}")
    check.expect(len(ours.schedules) >= (2 if cfg["graph_break"] is not None else 1) or not trainable_used,
                 f"{len(ours.schedules)} backward schedule(s) for graph_break={cfg['graph_break']}")


def _run_configs(rank: int, world: int, configs: list[dict[str, Any]], out_dir: str) -> None:
    results = []
    for cfg in configs:
        torch._dynamo.reset()
        check = Check()
        try:
            _one(cfg, rank, check)
        except Exception:  # graphddp raised: recorded with this configuration
            check.failures.append("raised:\n" + traceback.format_exc())
        results.append(check.failures)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()


def _run_all(configs: list[dict[str, Any]], world: int) -> list[str]:
    """One spawn for every configuration; returns a report line per failing configuration."""
    with tempfile.TemporaryDirectory() as out_dir:
        error = None
        try:
            spawn(_run_configs, world, configs, out_dir, timeout=300)
        except Exception as e:
            error = f"spawn failed: {e}"
        per_rank = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else [])
    report = []
    for i, cfg in enumerate(configs):
        msgs = [f"rank {r}: {m}" for r, got in enumerate(per_rank) for m in (got[i] if i < len(got) else [])]
        if any(i >= len(got) for got in per_rank):
            msgs.append(error or "not run")
        if msgs:
            report.append(f"config {i} (world {world}): {cfg}\n  alone: tests/test_random_models.py::_run_all([{cfg!r}], {world})\n  "
                          + "\n  ".join(msgs[:4]) + (f"\n  ... and {len(msgs) - 4} more" if len(msgs) > 4 else ""))
    if error and not report:
        report.append(error)  # every configuration finished, the ranks failed after
    return report


N_CONFIGS = int(os.environ.get("GRAPHDDP_RANDOM_MODELS", "8"))


@pytest.mark.parametrize("world", [2, 3])
def test_random_models_match_ddp(world):
    configs = draw_configs(N_CONFIGS)
    if world == 3:  # fewer on 3 ranks (3 processes on 2 cores): every other drawn configuration
        configs = configs[::2]
    assert len(configs) >= 3, configs
    failures = _run_all(configs, world)
    assert not failures, "\n".join(failures)


def test_drawn_configurations_cover_the_features():
    """The default draw exercises what the module docstring promises, at least once each."""
    configs = draw_configs(N_CONFIGS)
    assert any(c["tie"] for c in configs)
    assert any(c["frozen"] for c in configs)
    assert any(c["unused"] for c in configs)
    assert any(c["graph_break"] is not None for c in configs)
    assert {c["dtype"] for c in configs} == {"float32", "float64", "bfloat16"}
    assert len({c["bucket_cap_mb"] for c in configs}) >= 2
