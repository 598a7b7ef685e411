"""PyTorch's own DDP test scenarios, in our words, against DDP on 2 gloo ranks.

The matrix: scenarios where ranks' steps differ (rows) x graphddp features (columns). Each
cell trains DDP with ``find_unused_parameters=True`` (what those models need in DDP) and
graphddp (no flag) side by side from the same start and compares, after every step, every
parameter, and, where gradients are kept, every gradient *and whether it is None*; with
``optimizer=`` also that no gradient is kept and that exactly the parameters torch's AdamW
stepped have state. One rank pair per row (the rank pool), the features looped inside it.

Rows (after ``distributed_test.py``: ``_test_output_unused_in_loss``,
``_test_different_graph_across_ranks``; and issue reports):
* ``head_per_rank``: a multi-task model runs another head on each rank, and they swap;
* ``extra_layer_on_one_rank``: one rank runs a layer the other skips (PyTorch's ToyModel);
* ``unused_output``: the model returns two outputs and the loss leaves one out: on every rank
  (its parameters keep ``grad`` None), on one rank (they get the average), under ``no_sync``;
  with a dict output too;
* ``bart_layerdrop``: Hugging Face BART from config with ``encoder_layerdrop`` and
  ``decoder_layerdrop``, each rank drawing its own layers to skip (a graph break in a loop:
  Dynamo runs the encoder's and decoder's frames eagerly and compiles each layer alone).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from matrix_models import CAP_MB, _token_xent, _tokens
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.models import TinyGPT
from graphddp.testing import assert_matches_ddp, spawn

FEATURES = ("sgd", "adamw_inside", "fp16")


# -- the rows: a model, and one training step of it on a rank ----------------------------------------


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.a(h) if task == "a" else self.b(h)


def _heads_step(m: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * rank + step))
    m(x, "a" if (rank + step) % 2 == 0 else "b").square().mean().backward()


class ExtraLayer(nn.Module):
    """PyTorch's ToyModel: rank 1 runs ``lin2`` too, rank 0 does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        x = self.lin1(x)
        return self.lin2(x) if extra else x


def _extra_step(m: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(10 * rank + step))
    m(x, rank == 1).sum().backward()


class TwoOutputs(nn.Module):
    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        a, b = self.a(x), self.b(x)
        return {"predictions": (a, b)} if self.as_dict else (a, b)


def _unused_step(m: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        out = m(x)
        return out["predictions"] if isinstance(out, dict) else out

    if step == 0 or step == 4:  # "a" left out on every rank: its grads stay None
        outputs()[1].sum().backward()
    elif step == 1:  # both used
        a, b = outputs()
        (a @ b.T).sum().backward()
    elif step == 2:  # rank 0 uses only "a", rank 1 only "b": each gets the other's average
        a, b = outputs()
        (a if rank == 0 else b).sum().backward()
    else:  # a no_sync micro-batch that leaves "a" out, then a step that uses both
        with m.no_sync():
            outputs()[1].sum().backward()
        a, b = outputs()
        (a * b).sum().backward()


def _bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    ))


def _bart_step(m: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step)
    ids, labels = torch.randint(4, 64, (2, 8), generator=g), torch.randint(4, 64, (2, 8), generator=g)
    torch.manual_seed(1000 * rank + step)  # the layers to skip: drawn per rank, the same for both models
    m(input_ids=ids, labels=labels).loss.backward()


ROWS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, int, int], None], int]] = {
    "head_per_rank": (Heads, _heads_step, 4),
    "extra_layer_on_one_rank": (ExtraLayer, _extra_step, 3),
    "unused_output": (TwoOutputs, _unused_step, 5),
    "unused_output_dict": (lambda: TwoOutputs(as_dict=True), _unused_step, 5),
    "bart_layerdrop": (_bart, _bart_step, 4),
}


# -- one cell ------------------------------------------------------------------------------------------


def _optimizer(feature: str, params: Any) -> torch.optim.Optimizer:
    if feature == "adamw_inside":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _cell(rank: int, row: str, feature: str) -> dict[str, Any]:
    make, train_step, steps = ROWS[row]
    torch.manual_seed(0)
    model = make()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    options: dict[str, Any] = {"backend": "aot_eager"}
    atol, rtol = 1e-5, 1e-4
    if feature == "fp16":
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
        options["comm_hook"] = "fp16_compress"
        # fp16 rounding: after no_sync graphddp averages the accumulated part in full precision
        # (DDP's hook compresses the sum), so the two round differently.
        atol, rtol = 2e-3, 1e-2
    mine = copy.deepcopy(model)
    opt_ref, opt_ours = _optimizer(feature, ref.parameters()), _optimizer(feature, mine.parameters())
    inside = feature == "adamw_inside"
    ours = graphddp.compile(mine, optimizer=opt_ours if inside else None, **options)
    refs = dict(ref.module.named_parameters())
    for step in range(steps):
        for m, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            train_step(m, rank, step)
        for name, p in ours.module.named_parameters():
            q = refs[name]
            if inside:
                assert p.grad is None, f"{row} step {step}: {name} kept a gradient"
                continue
            assert (p.grad is None) == (q.grad is None), f"{row} step {step}: {name} grad None {p.grad is None}, DDP's {q.grad is None}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"{row} step {step} grad {name}: {m}")
        opt_ref.step()
        opt_ours.step()
        for name, p in ours.module.named_parameters():
            q = refs[name]
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"{row}/{feature} step {step} {name}: {m}")
            if inside:  # torch's AdamW skips a None gradient: no state, no step count
                assert set(opt_ours.state[p]) == set(opt_ref.state[q]), f"{row} step {step}: {name} state"
                if "step" in opt_ref.state[q]:
                    assert float(opt_ours.state[p]["step"]) == float(opt_ref.state[q]["step"]), f"{row} step {step}: {name}"
    return {"divergent": ours._state.backend.union.steps, "graphs": len(ours.schedules)}


def _row(rank: int, world: int, row: str, out: str | None) -> None:
    results = {feature: _cell(rank, row, feature) for feature in FEATURES}
    if out is not None and rank == 0:
        torch.save(results, out)


def _run_row(row: str, tmp_path: Any) -> dict[str, Any]:
    out = str(tmp_path / "result.pt")
    spawn(_row, 2, row, out)
    return torch.load(out)


@pytest.mark.parametrize("row", ["head_per_rank", "extra_layer_on_one_rank"])
def test_ranks_that_use_different_parameters_train_like_ddp_with_find_unused(row: str, tmp_path: Any) -> None:
    results = _run_row(row, tmp_path)
    assert all(r["divergent"] > 0 for r in results.values()), results  # the row really diverged


@pytest.mark.parametrize("row", ["unused_output", "unused_output_dict"])
def test_an_output_left_out_of_the_loss_keeps_grad_none_as_in_ddp(row: str, tmp_path: Any) -> None:
    results = _run_row(row, tmp_path)
    # None vs zero is settled inside the compiled step (one graph, same buckets on both ranks).
    assert all(r["divergent"] == 0 and r["graphs"] == 1 for r in results.values()), results


def test_hf_bart_with_layerdrop_drawn_per_rank_trains_like_ddp(tmp_path: Any) -> None:
    results = _run_row("bart_layerdrop", tmp_path)
    assert all(r["divergent"] > 0 and r["graphs"] > 1 for r in results.values()), results


# -- options that really differ are still refused ---------------------------------------------------


def _options_differ(rank: int, world: int) -> None:
    model = graphddp.compile(ExtraLayer(), backend="aot_eager", comm_hook="fp16_compress" if rank == 1 else None)
    loss = model(torch.randn(4, 10), False).sum()
    with pytest.raises(graphddp.ScheduleMismatchError, match="different options"):
        loss.backward()
    dist.barrier()


def test_ranks_with_different_comm_hooks_get_a_schedule_mismatch_error() -> None:
    spawn(_options_differ, 2)


# -- gradients made by eager code: a graph break inside the layer loop --------------------------------


class LoopBreakGPT(TinyGPT):
    """A graph break inside a block called from the ``for block in self.blocks`` loop."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                torch._dynamo.graph_break()
        return self.head(self.ln(x))


def _loop_break(rank: int, world: int) -> None:
    ours = assert_matches_ddp(
        LoopBreakGPT, lambda r, s: (_tokens(r, s, None)[0], _tokens(r, s, None)[2]), _token_xent, steps=2,
        backend="aot_eager", bucket_cap_mb=CAP_MB,
    )
    assert ours._state.backend.union.steps == 2


def test_a_graph_break_inside_the_layer_loop_is_averaged_as_ddp_averages_it():
    """Dynamo cannot resume inside the loop, so it runs the whole outer forward eagerly: the
    embedding, final norm and tied head get gradients outside every compiled graph. The step
    takes them (the forward's output depends on them) and averages them with the blocks'
    gradients at its end (graphddp.runtime.union), as DDP does."""
    spawn(_loop_break, 2)
