"""The command line end to end: python -m graphddp explain on an example factory, JSON and table output, the auto plan, a bad factory.

One run goes through a process of its own (``python -m graphddp``, with the log level read from
the environment at import); the others call the same ``main`` in this process, which is what
the entry point runs, without paying a new interpreter and torch import for each."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphddp.frontend.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphddp", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


def _main(*args: str) -> None:
    """``main(args)`` run from the repository (the factories' paths are relative to it)."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(list(args)) == 0
    finally:
        os.chdir(here)


def _usage_error(capsys, *args: str) -> str:
    """What ``main(args)`` says on stderr, exiting with a usage error (code 2)."""
    with pytest.raises(SystemExit) as bad:
        _main(*args)
    assert bad.value.code == 2
    return capsys.readouterr().err


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    run = _cli("explain", "examples/factories.py:mlp", "--world-size", "16", "--bucket-cap-mb", "0.1",
               "--backend", "aot_eager", "--format", "json", "--out", str(out), env={"GRAPHDDP_LOG": "info"})
    assert run.returncode == 0, run.stderr
    (data,) = json.loads(out.read_text())
    assert data["world_size"] == 16 and len(data["buckets"]) > 1
    assert "[graphddp INFO] graphddp plan for backward graph 0" in run.stderr
    _main("explain", "examples/factories.py:mlp", "--backend", "aot_eager", "--bandwidth-gbps", "1")
    table = capsys.readouterr().out
    assert "predicted (1 Gbit/s" in table and "fingerprint" in table
    _main("explain", "examples/factories.py:mlp", "--backend", "aot_eager", "--bucket-cap-mb", "auto",
          "--bandwidth-gbps", "0.5", "--latency-us", "3000")
    assert "auto buckets, minimising the predicted backward under 0.5 Gbit/s, 3e+03 us" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no function 'nope'"):
        _main("explain", "examples/factories.py:nope")


def test_cli_explains_full_sharding(tmp_path, capsys):
    """--sharding full (a string flag, and --reshard-after-forward a true/false one): the gathers and
    reduce-scatters read back from the compiled graphs, AdamW's state counted; its predicted
    timeline as a trace, forward and backward."""
    out = tmp_path / "full.json"
    _main("explain", "examples/factories.py:mlp", "--world-size", "64", "--sharding", "full", "--reshard-after-forward",
          "false", "--optimizer", "AdamW", "--backend", "aot_eager", "--format", "json", "--out", str(out))
    (data,) = json.loads(out.read_text())
    assert data["sharding"] == "full" and data["world_size"] == 64 and not data["reshard_after_forward"]
    assert [b["kind"] for b in data["forward"]["buckets"]] and all(b["kind"] == "gather" for b in data["forward"]["buckets"])
    assert {b["kind"] for b in data["backward"]["buckets"]} == {"reduce_scatter"}  # kept to the backward: no re-gather
    assert data["memory"]["optimizer_state"] >= 2 * data["memory"]["parameters"]
    trace = tmp_path / "full.trace.json"
    _main("explain", "examples/factories.py:mlp", "--world-size", "64", "--sharding", "full", "--optimizer", "AdamW",
          "--backend", "aot_eager", "--format", "trace", "--out", str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert lanes == {"graphddp forward graph 0", "graphddp backward graph 0"}
    assert {e["cat"] for e in events if e.get("tid") == 1 and e["ph"] == "X"} == {"gather", "reduce_scatter"}


def test_help_reads_as_plain_text(capsys):
    """--help prints the module docstring and the options' docs, written for Sphinx: no markup left."""
    from graphddp.frontend.cli import plain_text

    assert plain_text("``a`` :func:`~graphddp.plan.cost.fit_link`, :mod:`graphddp.runtime`, `x`") == "a fit_link, graphddp.runtime, x"
    for args in (("--help",), ("explain", "--help")):
        with pytest.raises(SystemExit) as done:
            main(list(args))
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "`" not in text and ":func:" not in text and ":mod:" not in text, text
        if args == ("--help",):
            assert "python -m graphddp explain PATH.py:FACTORY: print" in text


def test_cli_explains_hybrid_sharding(capsys):
    """--device-mesh RxS: hybrid sharding's plan, both levels in the table; a malformed shape is a usage error."""
    _main("explain", "examples/factories.py:mlp", "--device-mesh", "2x4", "--sharding", "optimizer", "--optimizer", "AdamW",
          "--backend", "aot_eager", "--bucket-cap-mb", "0.1")
    text = capsys.readouterr().out
    assert "world_size=8" in text and "sharded over 4 ranks, replicated over 2" in text, text
    err = _usage_error(capsys, "explain", "examples/factories.py:mlp", "--device-mesh", "2by4", "--sharding", "optimizer")
    assert "--device-mesh is REPLICATExSHARD" in err  # before the model is loaded
