"""Train Hugging Face models built from config in every graphddp mode beside DDP, on gloo CPU ranks.

Each (model, mode) pair: the same initial weights and per-rank batches, a loop shaped like
nanoGPT's (``--accum`` micro-steps under ``no_sync`` but the last, then ``--clip`` by the global
norm: ``clip_grad_norm_`` on DDP's side, ``max_grad_norm=`` where graphddp holds the optimizer;
AdamW, what users train with, or SGD with momentum, whose steps show a gradient's scale),
the losses compared each step and every parameter (a fully sharded model's through its
``state_dict()``) and buffer after the steps. A pair prints ``OK`` with its largest parameter
difference, or ``FAIL`` with the ranks' error. The models are the architectures users train
today that the suite's own (GPT-2, BERT, BART) do not cover: Llama (RoPE, RMSNorm, grouped-query
attention; untied and tied embeddings), Qwen2 (biases on q, k, v only), T5 (encoder-decoder,
relative position bias, tied embeddings) and ViT (a class token and position embeddings held as
bare parameters). Results: docs/real-models.md.

Usage: ``python -m tools.model_sweep [--models llama,t5] [--modes full,auto] [--backend inductor]
[--world 2] [--steps 3] [--accum 2] [--clip 1.0] [--optimizer sgd]``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.testing import spawn

VOCAB = 128


def _llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    ))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ))


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    ))


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


def _generator(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + step)


def _tokens(rank: int, step: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(1, VOCAB, (4, 16), generator=_generator(rank, step))
    return {"input_ids": idx, "labels": idx}


def _seq2seq(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = _generator(rank, step)
    return {"input_ids": torch.randint(1, VOCAB, (4, 12), generator=g), "labels": torch.randint(1, VOCAB, (4, 8), generator=g)}


def _images(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = _generator(rank, step)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 10, (4,), generator=g)}


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int, int], dict[str, torch.Tensor]]]] = {
    "llama": (lambda: _llama(False), _tokens),
    "llama_tied": (lambda: _llama(True), _tokens),
    "qwen2": (_qwen2, _tokens),
    "t5": (_t5, _seq2seq),
    "vit": (_vit, _images),
}
# graphddp.compile's options per mode; "optimizer": the optimizer goes to graphddp (inside the backward)
MODES: dict[str, dict[str, Any]] = {
    "replicated": {},
    "inside": {"optimizer": True},
    "optimizer": {"optimizer": True, "sharding": "optimizer"},
    "full": {"optimizer": True, "sharding": "full"},
    "auto": {"optimizer": True, "sharding": "auto"},
}
LOSS_TOL = 1e-4
# Per optimizer: its constructor and how far a parameter may be from DDP's after the steps. AdamW
# divides each gradient by its own size, so a gradient that is rounding noise (a key bias's, whose
# true value is zero) steps by up to a few hundredths of lr either way, and a gradient's scale
# (an average taken twice, or not at all) shows only through eps; SGD's steps are the gradients.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], float]] = {
    "adamw": (lambda params: torch.optim.AdamW(params, lr=1e-2), 5e-4),
    "sgd": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1e-6),
}


def train_pair(
    rank: int, world: int, model: str, mode: str, backend: str, steps: int, accum: int, clip: float | None,
    optimizer: str = "adamw",
) -> None:
    """One pair on this rank (module docstring); raises on the first difference."""
    torch.manual_seed(0)
    make, batch = MODELS[model]
    make_optimizer, param_tol = OPTIMIZERS[optimizer]
    base = make()
    ref, ours_module = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    ref_opt, opt = make_optimizer(ref.parameters()), make_optimizer(ours_module.parameters())
    options = dict(MODES[mode])
    inside = options.pop("optimizer", False)
    if inside:
        options.update(optimizer=opt, max_grad_norm=clip)
    if options.get("sharding") == "auto":
        options["example"] = batch(0, 0)
    ours = graphddp.compile(ours_module, backend=backend, bucket_cap_mb=0.01, **options)
    for step in range(steps):
        losses = []
        for module, stepper, clips in ((ref, ref_opt, True), (ours, opt, not inside)):
            stepper.zero_grad(set_to_none=True)
            for micro in range(accum):
                last = micro == accum - 1
                with contextlib.nullcontext() if last else module.no_sync():
                    loss = module(**batch(rank, step * accum + micro)).loss / accum
                    loss.backward()
            if clip is not None and clips:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            stepper.step()
            losses.append(loss.item())
        if abs(losses[0] - losses[1]) > LOSS_TOL:
            raise AssertionError(f"step {step}: loss {losses[1]} against DDP's {losses[0]}")
    theirs = dict(ref.module.named_parameters())
    mine = ours.state_dict() if mode in ("full", "auto") else dict(ours.module.named_parameters())
    missing = sorted(set(theirs) - set(mine))
    if missing:  # a tied parameter is one name in DDP's, two keys in a state dict: never fewer
        raise AssertionError(f"not compared, not found in graphddp's model: {missing}")
    worst, where = 0.0, ""
    for name, value in mine.items():
        if name in theirs:
            diff = (value.detach().float() - theirs[name].detach().float()).abs().max().item()
            if diff > param_tol:
                raise AssertionError(f"{name} after {steps} steps: {diff:.2e} from DDP's")
            if diff > worst:
                worst, where = diff, name
    buffers = dict(ours.module.named_buffers())
    for name, a in ref.module.named_buffers():
        if not torch.equal(a, buffers[name]):
            raise AssertionError(f"buffer {name} differs from DDP's")
    if rank == 0:
        chosen = ""
        if mode == "auto":  # how close the choice was: the chosen's predicted step and the fastest's
            choice = ours.placement_choice
            fastest = min(choice.candidates, key=lambda c: c.step_seconds)
            chosen = (f"; chose {choice.chosen}, predicted {choice.winner.step_seconds * 1e3:.2f} ms"
                      f" (the fastest: {fastest.name}, {fastest.step_seconds * 1e3:.2f} ms)")
        print(f"OK {model} {mode}: largest parameter difference {worst:.2e} ({where or 'none'}){chosen}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accum", type=int, default=1, help="micro-steps per step, all but the last under no_sync")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradients' global L2 norm to this")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    args = parser.parse_args(argv)
    failed = 0
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            start = time.perf_counter()
            try:
                spawn(train_pair, args.world, model, mode, args.backend, args.steps, args.accum, args.clip, args.optimizer, timeout=1200)
            except Exception as e:  # noqa: BLE001 - one pair's failure is reported, the rest still run
                failed += 1
                print(f"FAIL {model} {mode}: {str(e)[-2000:]}", flush=True)
            print(f"  {model} {mode}: {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
