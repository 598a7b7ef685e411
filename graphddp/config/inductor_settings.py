"""Inductor's settings under graphddp: the ones it pins around its compiles, and the user's
(``mode``, ``options``) checked before any compile, refused by name where they would cost graphddp
a promise (:func:`check_inductor_settings`).
"""
from __future__ import annotations

from typing import Any

# torch.compile's modes (torch._inductor.list_mode_options); those with CUDA graphs are refused
# on CUDA by check_inductor_settings.
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Inductor settings graphddp's correctness or overlap depends on, patched around each of its
# compiles only (the user's process-wide config is left as it is), on top of the user's mode
# and options (which may not name them):
# * comm reordering: raise each all-reduce to where its bucket is ready, sink each wait to its
#   first reader (with default settings inductor waits right after issuing: no overlap);
# * ``_fuse_ddp_communication`` off: DDP(..., python_reducer) turns it on process-wide, and its
#   passes would re-fuse graphddp's buckets (and crash on them).
INDUCTOR_PINNED_CONFIG: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["raise_comms", "sink_waits"],
    "_fuse_ddp_communication": False,
}
# A backward with sharded buckets (each bucket's wait and update, with gather="backward" its
# all-gather too, placed after the next bucket's reduce-scatter), and a forward that completes
# their all-gathers before each bucket's first read (gather="forward"), are compiled in
# graphddp's order: inductor's comm passes would sink each wait below all the compute that does
# not read it, and they keep collectives in issue order, so every later reduce-scatter would
# queue behind the first update, after the whole backward (docs/sharding.md); its locality and
# peak-memory reorders would pull each wait up next to its issue.
#
# Fusion can still undo that order: two kernels that share no tensor (a bucket's update, after
# its reduce-scatter's wait, and the copy of other parameters' parts into the next gather's
# buffer, needed before that gather's issue) fuse as one loop nest when their loops have one
# size, and the fused kernel runs after the wait: the wait moves up to its issue and the gather
# behind it (docs/full-sharding.md). A fusion of kernels that share less than
# FUSION_MIN_SHARED_BYTES of reads (an optimizer's scalar hyperparameters are about 40) saves
# only a loop's launch; inductor's score_fusion_memory_threshold allows 10 bytes by default.
FUSION_MIN_SHARED_BYTES = 1024
INDUCTOR_FX_ORDER_CONFIG: dict[str, Any] = {
    **INDUCTOR_PINNED_CONFIG,
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "score_fusion_memory_threshold": FUSION_MIN_SHARED_BYTES,
}


def normalise_options(value: Any) -> tuple[tuple[str, Any], ...] | None:
    """``options`` as sorted (key, value) pairs: hashable, and equal for equal dicts."""
    if value is None:
        return None
    pairs = tuple(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ValueError(f"options must be a dict of inductor config settings (string keys), got {value!r}")
    return tuple(sorted(pairs)) or None


def check_request(backend: str, mode: str | None, options: dict[str, Any]) -> None:
    """``mode`` is one of torch.compile's, and ``mode``/``options`` come with inductor only:
    checked for the config's own and for those a torch.compile call passes."""
    if mode is not None and mode not in INDUCTOR_MODES:
        raise ValueError(f"mode must be None or one of {INDUCTOR_MODES}, got {mode!r}")
    if (mode is not None or options) and backend != "inductor":
        raise ValueError(
            f"mode and options configure inductor; backend={backend!r} does not use them "
            f"(got mode={mode!r}, options={options})"
        )


def check_inductor_settings(
    where: str, backend: str, device: Any, mode: str | None, given: dict[str, Any], sharded: bool = False
) -> dict[str, Any]:
    """``mode``'s settings, then ``given``'s (graphddp's pinned ones go on top at compile time),
    refused where graphddp cannot keep its promises: a pinned key (the overlap, or the buckets
    re-fused; with ``sharded``, the FX-order keys too), a key inductor does not know (it would
    fail inside the first backward), CUDA graphs on a CUDA model (the backward's collectives and
    the in-band check between them are not replayed safely; on CPU inductor uses none)."""
    from torch._inductor import list_mode_options, list_options

    check_request(backend, mode, given)
    patches = {**list_mode_options(mode or "default"), **given}
    pinned = sorted(set(given) & set(INDUCTOR_PINNED_CONFIG))
    if pinned:
        raise ValueError(
            f"{where}: options {pinned} are set by graphddp (its overlap and bucket correctness depend on "
            f"them: {INDUCTOR_PINNED_CONFIG}); leave them out"
        )
    ordered = sorted(set(given) & (set(INDUCTOR_FX_ORDER_CONFIG) - set(INDUCTOR_PINNED_CONFIG))) if sharded else []
    if ordered:
        raise ValueError(
            f"{where}: options {ordered} are set by graphddp for a model with sharding= (its graphs run in "
            f"graphddp's order of collectives and updates: {INDUCTOR_FX_ORDER_CONFIG}); leave them out"
        )
    unknown = sorted(set(given) - set(list_options()))
    if unknown:
        raise ValueError(f"{where}: options {unknown} are not inductor config settings (torch._inductor.list_options())")
    if getattr(device, "type", None) == "cuda" and patches.get("triton.cudagraphs"):
        refuse_cuda_graphs(where, mode, given)
    return patches


def refuse_cuda_graphs(where: str, mode: str | None, given: dict[str, Any]) -> None:
    """CUDA graphs on a CUDA model: refused, in a function of its own so that the CUDA-graph probe
    (``tools/bench/cudagraphs.py``) can lift the refusal."""
    why = f"mode={mode!r}" if not given.get("triton.cudagraphs") else "options['triton.cudagraphs']"
    raise ValueError(
        f"{where}: {why} turns on CUDA graphs, which graphddp does not support: its backward "
        "graphs carry collectives and an in-band check that CUDA graph replay would not run "
        "safely. Use mode='max-autotune-no-cudagraphs' or the default mode."
    )
