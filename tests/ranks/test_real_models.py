"""Architectures users train today, built from Hugging Face configs, in a loop shaped like
nanoGPT's, against DDP on 2 gloo ranks (:mod:`tools.model_sweep`, which runs every model in every
mode: docs/real-models.md).

Here the pair the suite's own models cover least: Llama with tied embeddings (rotary position
buffers, RMSNorm, grouped-query attention, the embedding and the head one parameter) fully
sharded with SGD inside the backward (with momentum: its steps show a gradient's scale, which
AdamW's do not), two micro-steps a step (the first under ``no_sync``,
its gradient carried into the second's update inside the backward): the losses each step and
every parameter after three steps as DDP's. (Clipped by ``max_grad_norm`` the parts step in
``opt.step()`` instead; ``python -m tools.model_sweep --clip 1.0`` runs that.)"""
from __future__ import annotations

from graphddp.testing import spawn
from tools.model_sweep import train_pair


def test_hf_llama_with_tied_embeddings_fully_sharded_with_accumulation_trains_like_ddp() -> None:
    spawn(train_pair, 2, "llama_tied", "full", "aot_eager", 3, 2, None, "sgd")
