"""The benchmark's pure arithmetic: the release-time link model and the report of a saved run."""
from __future__ import annotations

import json
import os

import pytest

from graphddp.bench.report import render_table
from graphddp.bench.summary import _release_link

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _published(name: str) -> dict:
    """The summary of a published benchmark run (docs/bench_*.json)."""
    with open(os.path.join(DOCS, name)) as f:
        return json.load(f)


def test_release_link_starts_each_bucket_when_ready_if_the_link_is_free():
    link, timeline = _release_link([0.1, 0.5, 1.0], 100.0, [20.0, 30.0, 10.0])
    assert [(t["start_ms"], t["end_ms"]) for t in timeline] == [(10.0, 30.0), (50.0, 80.0), (100.0, 110.0)]
    assert link == 110.0  # the last bucket's transfer is the exposed tail


def test_release_link_queues_buckets_behind_a_busy_link():
    link, timeline = _release_link([0.1, 0.5, 1.0], 100.0, [50.0, 50.0, 10.0])
    assert [(t["start_ms"], t["end_ms"]) for t in timeline] == [(10.0, 60.0), (60.0, 110.0), (110.0, 120.0)]
    assert link == 120.0


def test_release_link_serves_buckets_in_ready_order_whatever_their_index():
    link, timeline = _release_link([1.0, 0.2], 100.0, [5.0, 5.0])
    assert [t["bucket"] for t in timeline] == [1, 0]
    assert link == 105.0


@pytest.mark.parametrize("name", ["bench_gpt.json", "bench_mlp.json"])
def test_published_results_render_and_hold_what_the_readme_quotes(name):
    summary = _published(name)
    table = render_table(summary)
    assert summary["network"]["emulated"], "the published figures come from the emulated link"
    for mode in ("graphddp", "ideal_overlap", "no_overlap", "ddp_best", "ddp_compiled"):
        assert f"\n{mode} " in table
    g = summary["modes"]["graphddp"]["step_ms"]
    for key, value in summary["ratios"].items():  # ratios are graphddp / that figure
        denominator = summary["modes"].get(key, {}).get("step_ms")
        if denominator:
            assert value == pytest.approx(g / denominator)
    assert summary["ddp_compiled"]["graphs"] > 1 and summary["ddp_compiled_samecap"]["graphs"] > 1


def test_a_run_of_some_modes_renders_without_the_bounds_it_did_not_measure():
    # --modes without comm_only: no max(compute, comm) or release-time bound to print.
    summary = _published("bench_gpt.json")
    summary["modes"].pop("comm_only")
    summary["bounds"] = {"ideal_overlap_ms": summary["bounds"]["ideal_overlap_ms"]}
    summary["ratios"] = {k: v for k, v in summary["ratios"].items() if "bound" not in k}
    table = render_table(summary)
    assert "\ngraphddp " in table and "\ncomm_only " not in table
    rows = [line.split(" ")[0] for line in table.splitlines()]
    assert "release-time" not in rows and "max(compute,comm)" not in rows


def test_readme_quotes_the_published_gpt_run():
    summary = _published("bench_gpt.json")
    with open(os.path.join(os.path.dirname(DOCS), "README.md")) as f:
        readme = f.read()
    modes = summary["modes"]
    assert f"| **graphddp** | **{modes['graphddp']['step_ms']:.0f}** |" in readme
    assert f"| ideal_overlap (measured floor) | {modes['ideal_overlap']['step_ms']:.0f} |" in readme
    assert f"**{summary['ratios']['best_eager_ddp']:.3f}**" in readme
