"""graphddp inside compiled training pipelines, in the ways pipelines call the compiler.

On 2 spawned gloo ranks, a Hugging Face GPT-2 built from config (tied embeddings, a graph
break) trains next to DDP in each form, every gradient and the parameters compared:

* ``torch.compile(graphddp.compile(m))`` and ``graphddp.compile(m).compile()``: a framework
  compiling whatever it is handed; the outer compile runs graphddp's module as it is;
* ``torch.compile(m, backend=graphddp.backend(m))``: the pipeline owns torch.compile;
* ``torch.compile(m, backend="graphddp")``: code that takes a backend name;
* regional compilation: every block ``.compile()``d first, then ``graphddp.compile(m)``;
* ``torch.autocast`` (float16) with ``torch.amp.GradScaler``, one step overflowing on one
  rank only: skipped on every rank alike, as with DDP.

Each form runs a ``no_sync`` micro-batch where it has ``no_sync``. One spawn runs every form
(spawning costs seconds); a form's failure is collected and reported by its own test.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.models import tiny_hf_gpt2, tiny_hf_gpt2_batch
from graphddp.testing import spawn

CAPS = {"backend": "aot_eager", "bucket_cap_mb": 0.02}


TOL = {"atol": 1e-5, "rtol": 1e-4}


_gpt2, _batch = tiny_hf_gpt2, tiny_hf_gpt2_batch


Form = Callable[[nn.Module], tuple[Callable[..., Any], Any, Callable[[], list]]]


def _outer_torch_compile(m: nn.Module):
    gd = graphddp.compile(m, **CAPS)
    return torch.compile(gd, backend="aot_eager"), gd.no_sync, lambda: gd.schedules


def _module_compile(m: nn.Module):
    gd = graphddp.compile(m, **CAPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gd.compile(backend="inductor", mode="max-autotune")
    assert any("compiles itself" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return gd, gd.no_sync, lambda: gd.schedules


def _backend_object(m: nn.Module):
    b = graphddp.backend(m, **CAPS)
    return torch.compile(m, backend=b), b.no_sync, lambda: b.schedules


def _backend_name(m: nn.Module):
    b = graphddp.backend(m, **CAPS)
    return torch.compile(m, backend="graphddp"), b.no_sync, lambda: b.schedules


def _regional(m: nn.Module):
    for block in m.transformer.h:
        block.compile(backend="aot_eager")
    gd = graphddp.compile(m, **CAPS)
    return gd, gd.no_sync, lambda: gd.schedules


FORMS: dict[str, Form] = {
    "torch_compile_of_graphddp": _outer_torch_compile,
    "module_compile_of_graphddp": _module_compile,
    "backend_object": _backend_object,
    "backend_name": _backend_name,
    "regional_blocks": _regional,
}


def _compare(ours: nn.Module, ref: nn.Module, what: str, grads: bool, equal_nan: bool = False) -> None:
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = named[name]
        a, b = (p.grad, q.grad) if grads else (p, q)
        if a is None or b is None:
            assert a is None and b is None, f"{what} {name}: None on one side only"
            continue
        torch.testing.assert_close(a, b, **TOL, equal_nan=equal_nan, msg=lambda m: f"{what} {name}: {m}")


def _train_form(rank: int, form: Form) -> None:
    base = _gpt2()
    ref = DDP(copy.deepcopy(base))
    mine = copy.deepcopy(base)
    if rank == 1:  # every form must broadcast rank 0's parameters when it wraps, as DDP does
        with torch.no_grad():
            for p in mine.parameters():
                p.add_(0.01)
    model, no_sync, schedules = form(mine)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
    for step in range(2):
        with ref.no_sync():
            ref(**_batch(rank, 10 + step)).loss.backward()
        with no_sync():
            model(**_batch(rank, 10 + step)).loss.backward()
        _compare(mine, ref.module, f"step {step} no_sync micro-batch, grad", grads=True)
        for m in (ref, model):
            m(**_batch(rank, step)).loss.backward()
        _compare(mine, ref.module, f"step {step} grad", grads=True)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    _compare(mine, ref.module, "after 2 steps, param", grads=False)
    assert len(schedules()) >= 2, "graphddp planned no graph: the gradients were not averaged by it"


CASES: dict[str, Callable[[int], None]] = {name: (lambda rank, f=f: _train_form(rank, f)) for name, f in FORMS.items()}


def _all_cases(rank: int, world: int, out_dir: str) -> None:
    results: dict[str, str] = {}
    for name, case in CASES.items():
        torch._dynamo.reset()
        try:
            case(rank)
            results[name] = ""
        except Exception:  # collected, not raised: the peer rank goes on to the next case
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        dist.barrier()  # a rank that failed mid-case must not pair its collectives with the next case's
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


_RESULTS: dict[str, str] = {}


def _result(name: str) -> str:
    if not _RESULTS:
        with tempfile.TemporaryDirectory() as out_dir:
            error = ""
            try:
                spawn(_all_cases, 2, out_dir, timeout=400)
            except Exception as e:  # noqa: BLE001 - reported with every case it did not finish
                error = f"spawn failed: {e}"
            for name_ in CASES:
                _RESULTS[name_] = ""
            for r in range(2):
                path = os.path.join(out_dir, f"rank{r}.json")
                got = json.load(open(path)) if os.path.exists(path) else {}
                for name_ in CASES:
                    _RESULTS[name_] += got.get(name_, error or "not run")
    return _RESULTS[name]


@pytest.mark.parametrize("name", list(CASES))
def test_form_matches_ddp_on_hf_gpt2(name):
    failure = _result(name)
    assert not failure, failure
