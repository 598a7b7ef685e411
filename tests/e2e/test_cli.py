"""The command line end to end: python -m graphddp explain on an example factory, JSON and table output, the auto plan, a bad factory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphddp", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "plan.json"
    run = _cli("explain", "examples/factories.py:mlp", "--world-size", "16", "--bucket-cap-mb", "0.1",
               "--backend", "aot_eager", "--format", "json", "--out", str(out))
    assert run.returncode == 0, run.stderr
    (data,) = json.loads(out.read_text())
    assert data["world_size"] == 16 and len(data["buckets"]) > 1
    table = _cli("explain", "examples/factories.py:mlp", "--backend", "aot_eager", "--bandwidth-gbps", "1",
                 env={"GRAPHDDP_LOG": "info"})
    assert table.returncode == 0, table.stderr
    assert "predicted (1 Gbit/s" in table.stdout and "fingerprint" in table.stdout
    assert "[graphddp INFO] graphddp plan for backward graph 0" in table.stderr
    auto = _cli("explain", "examples/factories.py:mlp", "--backend", "aot_eager", "--bucket-cap-mb", "auto",
                "--bandwidth-gbps", "0.5", "--latency-us", "3000")
    assert auto.returncode == 0, auto.stderr
    assert "auto buckets, minimising the predicted backward under 0.5 Gbit/s, 3e+03 us" in auto.stdout
    bad = _cli("explain", "examples/factories.py:nope")
    assert bad.returncode != 0 and "no function 'nope'" in bad.stderr


def test_cli_explains_full_sharding(tmp_path):
    """--sharding full (a string flag, and --reshard-after-forward a true/false one): the gathers and
    reduce-scatters read back from the compiled graphs, AdamW's state counted; formats it has not
    (a predicted timeline) are refused by name."""
    out = tmp_path / "full.json"
    run = _cli("explain", "examples/factories.py:mlp", "--world-size", "64", "--sharding", "full", "--reshard-after-forward",
               "false", "--optimizer", "AdamW", "--backend", "aot_eager", "--format", "json", "--out", str(out))
    assert run.returncode == 0, run.stderr
    (data,) = json.loads(out.read_text())
    assert data["sharding"] == "full" and data["world_size"] == 64 and not data["reshard_after_forward"]
    assert [b["kind"] for b in data["forward"]["buckets"]] and all(b["kind"] == "gather" for b in data["forward"]["buckets"])
    assert {b["kind"] for b in data["backward"]["buckets"]} == {"reduce_scatter"}  # kept to the backward: no re-gather
    assert data["memory"]["optimizer_state"] >= 2 * data["memory"]["parameters"]
    png = _cli("explain", "examples/factories.py:mlp", "--sharding", "full", "--backend", "aot_eager", "--format", "png", "--out", "x.png")
    assert png.returncode != 0 and "sharding='full' has a table or json" in png.stderr


def test_help_reads_as_plain_text():
    """--help prints the module docstring and the options' docs, written for Sphinx: no markup left."""
    from graphddp.frontend.cli import plain_text

    assert plain_text("``a`` :func:`~graphddp.plan.cost.fit_link`, :mod:`graphddp.runtime`, `x`") == "a fit_link, graphddp.runtime, x"
    for args in (("--help",), ("explain", "--help")):
        run = _cli(*args)
        assert run.returncode == 0, run.stderr
        assert "`" not in run.stdout and ":func:" not in run.stdout and ":mod:" not in run.stdout, run.stdout
        if args == ("--help",):
            assert "python -m graphddp explain PATH.py:FACTORY: print" in run.stdout


def test_cli_explains_hybrid_sharding(capsys):
    """--device-mesh RxS: hybrid sharding's plan, both levels in the table; a malformed shape is a usage error."""
    run = _cli("explain", "examples/factories.py:mlp", "--device-mesh", "2x4", "--sharding", "optimizer", "--optimizer", "AdamW",
               "--backend", "aot_eager", "--bucket-cap-mb", "0.1")
    assert run.returncode == 0, run.stderr
    assert "world_size=8" in run.stdout and "sharded over 4 ranks, replicated over 2" in run.stdout, run.stdout
    from graphddp.frontend.cli import main

    with pytest.raises(SystemExit) as bad:  # a usage error, before the model is loaded
        main(["explain", "examples/factories.py:mlp", "--device-mesh", "2by4", "--sharding", "optimizer"])
    assert bad.value.code == 2 and "--device-mesh is REPLICATExSHARD" in capsys.readouterr().err
