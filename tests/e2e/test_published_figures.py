"""The figures quoted on docs/benchmark.md, docs/sharding.md and in the README's headline are the
published runs' (docs/bench_gpt.json, docs/bench_gpt_adamw.json, docs/bench_*_sharded.json), and
docs/optimizer.md's cost of clipping is docs/bench_gpt_clip.json's, docs/sharding.md's with
sharding="optimizer" docs/bench_gpt_sharded_clip.json's; and
those runs still render."""
from __future__ import annotations

import json
import os

from tools.bench.report import render_table

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")


def test_readme_quotes_the_published_gpt_run():
    # The GPT table (SGD run) lives on the benchmark page; the README's headline is the AdamW run.
    with open(os.path.join(DOCS, "bench_gpt.json")) as f:
        summary = json.load(f)
    with open(os.path.join(DOCS, "benchmark.md")) as f:
        page = f.read()
    modes = summary["modes"]
    assert summary["network"]["emulated"], "the published figures come from the emulated link"
    assert f"| **graphddp** | **{modes['graphddp']['step_ms']:.0f}** |" in page
    assert f"| ideal_overlap (measured floor) | {modes['ideal_overlap']['step_ms']:.0f} |" in page
    assert f"**{summary['ratios']['best_eager_ddp']:.3f}**" in page
    render_table(summary)  # the published summary still renders

    with open(os.path.join(DOCS, "bench_gpt_adamw.json")) as f:
        adamw = json.load(f)
    with open(os.path.join(os.path.dirname(DOCS), "README.md")) as f:
        readme = f.read()
    modes = adamw["modes"]
    assert adamw["network"]["emulated"], "the headline figures come from the emulated link"
    assert f"| graphddp, AdamW inside the backward (`graphddp_optim`) | **{modes['graphddp_optim']['step_ms']:.1f}** |" in readme
    assert f"| graphddp, AdamW after the backward | {modes['graphddp']['step_ms']:.1f} |" in readme
    assert f"| eager DDP, best cap | {modes['ddp_best']['step_ms']:.1f} |" in readme
    assert f"| PyTorch's compiled-autograd DDP (`ddp_compiled_autograd`) | {modes['ddp_compiled_autograd']['step_ms']:.1f} |" in readme
    assert f"| compute_only (no communication) | {modes['compute_only']['step_ms']:.1f} |" in readme
    assert f"graphddp_optim / best eager DDP: **{adamw['optim_ratios']['best_eager_ddp']:.3f}**" in readme
    assert f"graphddp_optim / compiled-autograd DDP: **{adamw['optim_ratios']['ddp_compiled_autograd']:.3f}**" in readme
    render_table(adamw)


def test_sharding_page_quotes_the_published_sharded_runs():
    with open(os.path.join(DOCS, "sharding.md")) as f:
        page = f.read()
    for model in ("gpt", "mlp"):
        with open(os.path.join(DOCS, f"bench_{model}_sharded.json")) as f:
            summary = json.load(f)
        assert summary["network"]["emulated"] and summary["config"]["backend"] == "inductor"
        modes = summary["modes"]
        sharded, optim = modes["graphddp_sharded"], modes["graphddp_optim"]
        assert f"| **{sharded['step_ms']:.1f}** | {sharded['state_mb']:.1f} |" in page, model
        assert f"| {optim['step_ms']:.1f} | {optim['state_mb']:.1f} |" in page, model
        for t in summary["targets"]:
            if "sharded" in t["target"]:
                assert f"- {t['target']}: {t['ratio']:.3f}" in page, (model, t["target"])
        render_table(summary)


def _step_rows_quoted(run: str, page_name: str, names: tuple[str, ...]) -> tuple[dict, str]:
    """The published ``run`` (docs/) and the page that quotes it, after checking the page's
    rows ``| `name`: ... | step ms | bwd ms |`` for ``names``; the run came from the emulated link."""
    with open(os.path.join(DOCS, run)) as f:
        summary = json.load(f)
    with open(os.path.join(DOCS, page_name)) as f:
        page = f.read()
    modes = summary["modes"]
    assert summary["network"]["emulated"], "the published figures come from the emulated link"
    for name in names:
        assert f"| `{name}`: " in page and f" | {modes[name]['step_ms']:.1f} | {modes[name]['bwd_ms']:.1f} |" in page, name
    return summary, page


def test_optimizer_page_quotes_the_published_clip_run():
    """docs/optimizer.md's cost of max_grad_norm is docs/bench_gpt_clip.json's."""
    summary, page = _step_rows_quoted("bench_gpt_clip.json", "optimizer.md", ("graphddp_optim", "graphddp_optim_clip", "graphddp_clip"))
    modes = summary["modes"]
    ratio = modes["graphddp_optim_clip"]["step_ms"] / modes["graphddp_optim"]["step_ms"]
    assert f"{ratio:.3f}x the unclipped in-graph step" in page
    render_table(summary)


def test_sharding_page_quotes_the_published_sharded_clip_run():
    """docs/sharding.md's cost of max_grad_norm with sharding="optimizer" is docs/bench_gpt_sharded_clip.json's."""
    names = ("graphddp_sharded", "graphddp_sharded_clip", "graphddp_sharded_fwd_clip", "fsdp2", "fsdp2_clip")
    summary, page = _step_rows_quoted("bench_gpt_sharded_clip.json", "sharding.md", names)
    assert summary["config"]["backend"] == "inductor"
    step = {n: m["step_ms"] for n, m in summary["modes"].items()}
    assert f"costs the default placement {step['graphddp_sharded_clip'] / step['graphddp_sharded']:.3f}x" in page
    assert f"the clipped step is {step['graphddp_sharded_fwd_clip'] / step['graphddp_sharded']:.3f}x" in page
    assert (f"{step['graphddp_sharded_clip'] / step['fsdp2_clip']:.3f}x and "
            f"{step['graphddp_sharded_fwd_clip'] / step['fsdp2_clip']:.3f}x") in page
    render_table(summary)
