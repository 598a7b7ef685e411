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
Single-process tests (a fake process group) cover ``mode``/``options`` and their errors.
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
from graphddp.codeinspect import windows_in_generated_code
from graphddp.config import DDPConfig
from graphddp.models import MLP
from graphddp.testing import spawn

pytest.importorskip("transformers")

CAPS = {"backend": "aot_eager", "bucket_cap_mb": 0.02}
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    ))


def _batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 * rank + step))
    return {"input_ids": idx, "labels": idx}


# -- the forms: base model -> (model to call, its no_sync or None, its schedules) ------------------

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


def _train_amp(rank: int) -> None:
    """fp16 autocast + GradScaler; step 1 overflows on rank 1 only and is skipped on both."""
    base = _gpt2()
    ref = DDP(copy.deepcopy(base))
    ours = graphddp.compile(copy.deepcopy(base), **CAPS)
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=2.0**8))
             for m in (ref, ours)]
    scales = {id(ref): [], id(ours): []}
    for step in range(3):
        before = [p.detach().clone() for p in ours.parameters()]
        for m, opt, scaler in pairs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(**_batch(rank, step)).loss
            if step == 1 and rank == 1:
                loss = loss * float("inf")  # one rank overflows: its inf reaches every rank's average
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales[id(m)].append(scaler.get_scale())
        # the overflowing step's gradients are inf/nan on both sides (the scaler unscaled them)
        _compare(ours.module, ref.module, f"step {step} grad", grads=True, equal_nan=step == 1)
        _compare(ours.module, ref.module, f"step {step} param", grads=False)
        unchanged = all(torch.equal(a, p) for a, p in zip(before, ours.parameters()))
        assert unchanged == (step == 1), f"step {step}: skipped={unchanged}, expected a skip only at step 1"
        for _, opt, _ in pairs:
            opt.zero_grad(set_to_none=True)
    assert scales[id(ref)] == scales[id(ours)] and scales[id(ours)][1] < scales[id(ours)][0], scales


CASES: dict[str, Callable[[int], None]] = {name: (lambda rank, f=f: _train_form(rank, f)) for name, f in FORMS.items()}
CASES["autocast_fp16_grad_scaler"] = _train_amp


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


# -- mode and options, single process ----------------------------------------------------------------


def test_max_autotune_generated_code_still_overlaps(fake_world):
    """Hugging Face GPT-2 under mode="max-autotune-no-cudagraphs": in the code inductor
    generated, every bucket but the last has kernels running while its all-reduce is in flight."""
    fake_world(8)
    model = graphddp.compile(_gpt2(), mode="max-autotune-no-cudagraphs", bucket_cap_mb=0.02)
    model(**_batch(0, 0)).loss.backward()
    records = [r for r in model.records if r.schedule.num_buckets]
    assert records, "no backward graph with parameters was planned"
    for record in records:
        windows = windows_in_generated_code(record.generated_code)
        assert len(windows) == record.schedule.num_buckets >= 2
        assert all(w.kernels_in_flight > 0 for w in windows[:-1]), windows


def test_reduce_overhead_on_cpu_runs(fake_world):
    """CUDA graphs do not apply on CPU: the mode compiles and runs."""
    fake_world(2)
    model = graphddp.compile(MLP(), mode="reduce-overhead", bucket_cap_mb=0.01)
    model(torch.randn(8, 16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cuda_graphs_on_a_cuda_model_are_refused_naming_the_setting():
    config = DDPConfig(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"mode='reduce-overhead' turns on CUDA graphs.*max-autotune-no-cudagraphs"):
        config.check_inductor_settings("graphddp.compile", torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"options\['triton.cudagraphs'\] turns on CUDA graphs"):
        DDPConfig(options={"triton.cudagraphs": True}).check_inductor_settings("here", torch.device("cuda"))
    assert DDPConfig(mode="max-autotune").check_inductor_settings("here", torch.device("cpu"))["max_autotune"]


@pytest.mark.parametrize("options,match", [
    ({"reorder_for_compute_comm_overlap": False}, r"\['reorder_for_compute_comm_overlap'\] are set by graphddp"),
    ({"no_such_setting": 1}, r"\['no_such_setting'\] are not inductor config settings"),
])
def test_bad_options_name_the_setting(fake_world, options, match):
    fake_world(2)
    with pytest.raises(ValueError, match=match):
        graphddp.compile(MLP(), options=options)


def test_mode_needs_inductor():
    with pytest.raises(ValueError, match="mode and options configure inductor; backend='aot_eager'"):
        DDPConfig(backend="aot_eager", mode="max-autotune")
    with pytest.raises(ValueError, match="mode must be None or one of"):
        DDPConfig(mode="fastest")


def test_torch_compile_options_reach_graphddp(fake_world):
    """torch.compile(m, backend=graphddp.backend(m), options=...) hands them to graphddp."""
    fake_world(2)
    m = MLP()
    b = graphddp.backend(m)
    compiled = torch.compile(m, backend=b, options={"_fuse_ddp_communication": True})
    with pytest.raises(Exception, match=r"\['_fuse_ddp_communication'\] are set by graphddp"):
        compiled(torch.randn(8, 16))
    b.remove()


def test_outer_fullgraph_compile_says_what_to_do(fake_world):
    fake_world(2)
    gd = graphddp.compile(MLP(), backend="aot_eager")
    with pytest.raises(Exception, match="graphddp module compiles itself"):
        torch.compile(gd, backend="aot_eager", fullgraph=True)(torch.randn(8, 16))


def test_backend_name_without_prepare_is_a_clear_error(fake_world):
    fake_world(2)
    with pytest.raises(Exception, match=r"graphddp has not prepared; call graphddp.backend\(model"):
        torch.compile(MLP(), backend="graphddp")(torch.randn(8, 16))


def test_backend_form_does_the_wrap_time_checks(fake_world):
    fake_world(2)
    with pytest.raises(TypeError, match="graphddp.backend: module must be a torch.nn.Module"):
        graphddp.backend(lambda x: x)
    with pytest.raises(TypeError, match=r"graphddp.backend got unknown option\(s\) \['bucket_cap'\]"):
        graphddp.backend(MLP(), bucket_cap=1)


def test_backend_form_compiles_a_torch_nn_class_and_detaches(fake_world):
    """nn.Sequential: torch.compile traces its hooks instead of running them outside, so the
    per-forward work wraps forward; the graph is compiled by graphddp, and remove() undoes it."""
    fake_world(2)
    m = MLP()
    b = graphddp.backend(m, backend="aot_eager", bucket_cap_mb=0.01)
    torch.compile(m, backend=b)(torch.randn(8, 16)).sum().backward()
    assert len(b.schedules) == 1 and b.schedules[0].num_buckets >= 2
    assert "forward" in vars(m)
    b.remove()
    assert "forward" not in vars(m) and not b.attached
