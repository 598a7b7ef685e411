"""graphddp inside compiled training pipelines, in one process (a fake process group): ``mode`` and
``options`` reach graphddp, generated code still overlaps, and bad settings are named. The forms
against DDP on ranks: ranks/test_pipeline_forms.py.
"""
from __future__ import annotations

import pytest
import torch

import graphddp
from graphddp.config import DDPConfig
from graphddp.graph.codeinspect import windows_in_generated_code
from graphddp.models import MLP
from graphddp.models import tiny_hf_gpt2, tiny_hf_gpt2_batch

pytest.importorskip("transformers")


_gpt2, _batch = tiny_hf_gpt2, tiny_hf_gpt2_batch


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


@pytest.mark.parametrize("sharding", [None, "full"])
def test_torch_compile_options_reach_graphddp(fake_world, sharding):
    """torch.compile(m, backend=graphddp.backend(m), options=...) hands them to graphddp, in every mode."""
    fake_world(2)
    m = MLP()
    b = graphddp.backend(m) if sharding is None else graphddp.backend(m, sharding=sharding, optimizer=torch.optim.AdamW(m.parameters()))
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


def test_backend_name_finds_the_parameters_model_else_the_most_recent(fake_world):
    """``backend="graphddp"``: a graph goes to the backend made for its parameters' model; one
    without parameters (a loss after a graph break) to the most recent attached backend."""
    fake_world(2)
    first_model, second_model = MLP(), MLP()
    first, second = graphddp.backend(first_model, backend="aot_eager"), graphddp.backend(second_model, backend="aot_eager")
    for made, name in ((first, "first"), (second, "second")):
        made._state.compile_graph = lambda gm, inputs, name=name, **_: name
    by_name = graphddp.frontend.backend._by_name
    assert by_name(None, [next(first_model.parameters())]) == "first"
    assert by_name(None, [torch.zeros(1)]) == "second"
    second.remove()
    assert by_name(None, [torch.zeros(1)]) == "first"


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


@pytest.mark.parametrize("sharding", ["optimizer", "full"])
def test_settings_of_graphddps_order_are_refused_by_name_with_sharding(fake_world, sharding):
    """A sharded model's graphs are compiled in graphddp's order (inductor_settings.
    INDUCTOR_FX_ORDER_CONFIG); a user's option of the same name would be overridden, so it is
    refused, naming it; without sharding= the same option is the user's."""
    fake_world(2)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"\['score_fusion_memory_threshold'\] are set by graphddp for a model with sharding="):
        ours = graphddp.compile(model, optimizer=opt, sharding=sharding, options={"score_fusion_memory_threshold": 10})
        ours(torch.randn(8, 16)).sum().backward()  # full sharding checks where it compiles
    plain = graphddp.compile(MLP(), options={"score_fusion_memory_threshold": 10}, bucket_cap_mb=0.01)
    plain(torch.randn(8, 16)).sum().backward()
