"""The package's shape, checked: layers, one options definition, an explain that leaves nothing.

These are the properties issue 10 asks for, as tests so they stay true: ``schedule.py`` (with
``prediction.py``, the cost model's values it re-exports, and ``schedule_table.py``, its table,
below it) is the bottom layer and the
import graph has no cycle (function-level imports included); the product never imports its
test helpers or the benchmark; ``compile``, ``explain`` and the CLI accept
exactly ``DDPConfig``'s options; ``explain`` leaves no process group, no exception hook and no
recompile budget behind. And the package's comments state what is: no dates, no issue numbers.
"""
from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist

import graphddp
from graphddp.config import DDPConfig
from graphddp.frontend.cli import add_option_flags, options_from_args
from graphddp.models import MLP, GraphBreakMLP
from graphddp.testing import missing_torch_feature

PACKAGE = pathlib.Path(graphddp.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module -> the graphddp modules it imports anywhere in its body (lazy imports too); a
    copy the caller may change. Parsed once per session: the layer checks ask once per module."""
    return {module: set(deps) for module, deps in _parsed_imports().items()}


@functools.lru_cache(maxsize=1)
def _parsed_imports() -> dict[str, frozenset[str]]:
    graph: dict[str, frozenset[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("graphddp", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                # "from graphddp import render" imports the submodule graphddp.render
                deps.update(f"{base}.{a.name}" if base == "graphddp" else base for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = frozenset(d for d in deps if d.split(".")[0] in ("graphddp", "tools") and d != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == "graphddp":  # the package itself: its __init__ re-exports, nothing below imports it
                continue
            if state.get(dep) == 1:
                return path + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and module != "graphddp" and (found := visit(module, [module])):
            return found
    return None


def test_schedule_is_the_bottom_layer_and_imports_have_no_cycle():
    graph = _imports()
    assert graph["graphddp.values.prediction"] == set()
    assert graph["graphddp.values.schedule_table"] == {"graphddp.values.prediction"}  # Timeline, for annotations only
    # A schedule records where its sharded buckets live: the placement, built on the collective kinds.
    # ... and, with sharding="auto", the choice it was made by (a value of its own, importing only the tables' MB).
    assert graph["graphddp.values.choice"] == {"graphddp.values.schedule_table"}
    assert graph["graphddp.values.schedule"] == {
        "graphddp.values.prediction", "graphddp.values.schedule_table", "graphddp.values.placement", "graphddp.values.choice",
    }
    # ... and every bucket's collectives waited with the one wait (values.comm, under the kinds).
    assert graph["graphddp.values.placement"] == {"graphddp.values.prediction", "graphddp.values.collectives", "graphddp.values.comm"}
    assert graph["graphddp.values.collectives"] == {"graphddp.values.prediction", "graphddp.values.comm"}  # the kinds: under the value types
    assert graph["graphddp.graph.capture"] == {"graphddp.values.schedule"}
    # the cost model times every mode's schedule: a backward's Schedule, a FullSchedule's placed graphs over their placement
    assert graph["graphddp.plan.cost"] == {
        "graphddp.values.schedule", "graphddp.values.collectives", "graphddp.values.part_schedule", "graphddp.values.placement",
    }
    below_the_top = {m for m in graph if m not in ("graphddp", "graphddp.__main__", "graphddp.frontend.cli", "graphddp.testing")}
    assert not [m for m in below_the_top if "graphddp" in graph[m]], "only the top imports the package itself"
    assert _cycle(graph) is None, _cycle(graph)


def test_the_product_imports_neither_its_test_helpers_nor_the_benchmark():
    graph = _imports()
    for module, deps in graph.items():
        if module != "graphddp.testing":
            assert "graphddp.testing" not in deps, module
        assert not any(d.startswith("tools") for d in deps), module


def test_a_break_in_the_layering_is_caught():
    """The checker itself: a cycle planted in a copy of the graph is found."""
    graph = _imports()
    graph["graphddp.values.schedule"] = {"graphddp.render"}
    assert _cycle(graph) is not None


def test_compile_explain_and_the_cli_take_exactly_ddpconfigs_options(fake_world):
    names = [f.name for f in DDPConfig.option_fields()]
    assert set(names) >= {"bucket_cap_mb", "bucket_cap_mb_list", "comm_hook", "backend", "verify",
                          "broadcast_buffers", "fullgraph", "dynamic"}
    assert not {"world_size", "group_name"} & set(names), "facts of the job are not options"
    import argparse

    parser = argparse.ArgumentParser()
    add_option_flags(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    # cost: an object, explain's CLI builds it from its cost flags; mp_policy: an object (FSDP2's
    # MixedPrecisionPolicy), graphddp.explain takes it; DDP's constructor keywords plan nothing
    assert flags == set(names) - {"cost", "mp_policy"} - set(DDPConfig.ddp_keywords())
    assert set(DDPConfig.ddp_keywords()) == {"device_ids", "output_device", "find_unused_parameters", "static_graph",
                                             "gradient_as_bucket_view"}
    assert options_from_args(parser.parse_args(["--bucket-cap-mb", "auto"])) == {"bucket_cap_mb": "auto"}
    given = parser.parse_args(["--bucket-cap-mb", "2", "--no-verify", "--bucket-cap-mb-list", "1,3", "--dynamic", "false"])
    assert options_from_args(given) == {"bucket_cap_mb": 2.0, "verify": False, "bucket_cap_mb_list": [1.0, 3.0], "dynamic": False}

    with pytest.raises(TypeError, match=r"graphddp.explain got unknown option\(s\) \['bucket_cap'\]"):
        graphddp.explain(MLP(), torch.randn(2, 16), bucket_cap=1)
    fake_world(2)
    with pytest.raises(TypeError, match=r"graphddp.compile got unknown option\(s\) \['bucket_cap'\]"):
        graphddp.compile(MLP(), bucket_cap=1)
    model = graphddp.compile(MLP(), **DDPConfig(backend="aot_eager", bucket_cap_mb=0.001, verify=False).as_options())
    assert (model.config.bucket_cap_mb, model.config.verify, model.world_size) == (0.001, False, 2)


def test_explain_takes_every_option_compile_does():
    x = torch.randn(4, 16)
    (schedule,) = graphddp.explain(MLP(), x, world_size=4, backend="aot_eager", bucket_cap_mb=0.001,
                                   comm_hook="bf16_compress", broadcast_buffers=False, verify=True,
                                   fullgraph=True, dynamic=False)
    assert schedule.world_size == 4 and schedule.num_buckets > 1
    assert {b.comm_dtype for b in schedule.buckets} == {"bfloat16"}


@pytest.mark.skipif(bool(missing_torch_feature("isolated_recompiles")), reason=str(missing_torch_feature("isolated_recompiles")))
def test_explain_leaves_no_group_no_hook_and_no_recompile_budget_behind(fake_world):
    """Ten explains of a model with a graph break, then a real compile of it still compiles
    both of its graphs.

    Without per-wrapper recompile regions, each explain's compile of the model's frames (the
    forward and the frame resumed after the break) counted against the one shared recompile
    limit (8), and the wrapper then ran eagerly.
    """
    hook = sys.excepthook
    x = torch.randn(4, 16)
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        graphddp.explain(GraphBreakMLP(), x, world_size=8, backend="aot_eager")
    assert not dist.is_initialized()
    assert sys.excepthook is hook, "init_process_group's [rank0] hook was left installed"
    fake_world(2)
    model = graphddp.compile(GraphBreakMLP(), backend="aot_eager")
    model(x).sum().backward()
    assert len(model.schedules) == 2


def test_explain_plans_a_first_compile_whatever_this_process_compiled_before():
    """explain's plan is a fresh run's first compile: static, even where this process already
    compiled the same model code with other input shapes (Dynamo would make the next compile
    dynamic, and the plan, its fingerprint, would then differ from the run's); dynamic=True
    still plans dynamic shapes."""
    x, other = torch.randn(8, 16), torch.randn(5, 16)
    first = graphddp.explain(MLP(), x, world_size=2, backend="aot_eager")[0].fingerprint()
    graphddp.explain(MLP(), other, world_size=2, backend="aot_eager")
    assert graphddp.explain(MLP(), x, world_size=2, backend="aot_eager")[0].fingerprint() == first
    assert graphddp.explain(MLP(), x, world_size=2, backend="aot_eager", dynamic=True)[0].fingerprint() != first


# The layers of docs/architecture.md, bottom first: a folder (or a top-level module) may import
# graphddp only from its own layer and the layers before it.
LAYERS = ["values", "hooks", "config", "plan", "graph", "optim", "runtime", "compiler", "render", "frontend"]
OUTSIDE_THE_LAYERS = {"graphddp", "__main__", "models", "testing"}  # the package face, the CLI entry, test helpers


def _layer(module: str) -> str:
    """The layer of graphddp's module ``module`` (dotted, without the package): its folder."""
    return module.split(".")[0]


def _modules() -> set[str]:
    return {m.removeprefix("graphddp.") for m in _imports() if m != "graphddp"}


def _typing_only(tree: ast.AST) -> set[ast.AST]:
    """The import nodes under ``if TYPE_CHECKING:`` (annotations, not a dependency at run time)."""
    nodes: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            nodes.update(n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return nodes


def _all_imports(module: str) -> set[str]:
    """Every module ``graphddp.<module>`` imports anywhere in its body, torch's included."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():
        path = PACKAGE.joinpath(*module.split("."), "__init__.py")
    deps: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if node in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            deps.update(f"{node.module}.{a.name}" for a in node.names)
            deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
    return deps


def _ours(deps: set[str]) -> set[str]:
    """The graphddp modules among ``deps`` (``from graphddp.values.comm import X`` names comm, not X)."""
    modules = set(_imports())
    return {d.removeprefix("graphddp.") for d in deps if d in modules and d != "graphddp"}


def test_the_layers_import_only_downwards():
    modules = _modules() - OUTSIDE_THE_LAYERS
    assert {_layer(m) for m in modules} == set(LAYERS), "a folder docs/architecture.md does not place"
    for module in modules:
        below = set(LAYERS[: LAYERS.index(_layer(module)) + 1])
        upward = {d for d in _ours(_all_imports(module)) if _layer(d) not in below}
        assert not upward, f"graphddp.{module} imports a layer above its own: {sorted(upward)}"


def test_planning_is_pure_hooks_know_only_values_graph_talks_to_no_rank():
    """plan/ is a function of facts and options (no torch.fx, no process group); a comm hook is
    tensor functions over a Bucket (no graph, no plan, no rank); graph/ rewrites graphs and never
    talks to a process group itself (its collectives are functional ops traced into the graph)."""
    for module in (m for m in _modules() if _layer(m) == "plan"):
        deps = _all_imports(module)
        assert not {d for d in deps if d.startswith(("torch.fx", "torch.distributed"))}, f"{module}: planning is pure"
    for module in (m for m in _modules() if _layer(m) == "hooks"):
        assert {_layer(d) for d in _ours(_all_imports(module))} <= {"values", "hooks"}, module
    for module in (m for m in _modules() if _layer(m) == "graph"):
        talks = {d for d in _all_imports(module) if d.startswith("torch.distributed") and "_functional_collectives" not in d}
        assert not talks, f"{module} talks to a process group: {sorted(talks)}"


def test_the_optimizer_plugs_in_through_the_compilers_pass_list_only():
    """The optimizer inside the backward is a feature: the core (values, plan, graph, runtime)
    never imports it at run time; the compiler adds its pass to the backward list, and the
    frontend attaches it to a model."""
    importers = {m for m in _modules() if _layer(m) != "optim" and any(_layer(d) == "optim" for d in _ours(_all_imports(m)))}
    assert importers and {_layer(m) for m in importers} <= {"compiler", "frontend"}, sorted(importers)


# The package's comments and docstrings state what is: no dates, no issue numbers (ours or
# upstream's); a run's figures and history go in docs/. Measured times are too varied to grep
# reliably and are left to review.
HISTORY = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b[Ii]ssues? #?\d+|\b[A-Za-z][\w.-]*#\d+")


def _history(text: str) -> list[int]:
    """The 1-based lines of ``text`` that name a date, an issue number or an upstream one."""
    return [n for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


# Each shared invariant of graph/invariants.py: the modules whose verifiers call it, and what a
# failure of it says (only invariants.py may say it: another module saying it has its own copy).
SHARED_INVARIANTS = {
    "waited_once(": (("graph/verify/order.py", "graph/verify/parts.py", "optim/verify.py"), "must have exactly one user"),
    "written_last(": (("optim/verify.py", "graph/verify/updates.py"), "reads its memory after"),
    "not_returned(": (("optim/verify.py", "graph/verify/updates.py"), "still returned"),
    "from_average(": (("optim/verify.py", "graph/verify/updates.py"), "'s wait ({rule})"),
    "on_group(": (("graph/verify/order.py", "graph/verify/parts.py"), "runs on group"),  # and optimizer sharding through over_replicas
    "over_replicas(": (("optim/verify.py", "graph/verify/parts.py"), "not once by its bucket's all-reduce"),
    "carried_once(": (("graph/verify/layout.py", "optim/verify.py"), "carried gradient"),
    "clip_coefficient(": (("optim/verify.py",), "clip coefficients, expected"),
    "returned_clipped(": (("optim/verify.py",), "unclipped ("),
}
VERIFIERS = ("graph/verify/__init__.py", "graph/verify/order.py", "graph/verify/layout.py", "graph/verify/parts.py",
             "graph/verify/updates.py", "graph/verify_common.py", "optim/verify.py", "optim/insert_gather.py")


def test_each_shared_invariant_is_stated_once_and_every_mode_checks_it():
    """The invariants every mode shares (W, L, G, A, R, H, O, C) live in graph/invariants.py; every
    mode's verifier calls them instead of writing its own, and no verifier repeats one's message."""
    text = {m: PACKAGE.joinpath(m).read_text() for m in VERIFIERS}
    shared = PACKAGE.joinpath("graph/invariants.py").read_text()
    for call, (callers, says) in SHARED_INVARIANTS.items():
        assert f"def {call}" in shared and says in shared, call
        assert [m for m in callers if call not in text[m]] == [], f"a mode's verifier does not call {call}"
        assert [m for m in VERIFIERS if says in text[m]] == [], f"{call}: its failure is stated again"
    assert "check_writes(" in text["optim/insert_gather.py"], "the forward gather's writes are not S5's check"
    for m, body in text.items():
        assert "class _Memory" not in body and "def _root(" not in body, f"{m} defines its own memory map"


def test_the_package_names_no_dates_and_no_issue_numbers():
    hits = [
        f"graphddp/{rel}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for rel in [path.relative_to(PACKAGE).as_posix()]
        for n in _history(path.read_text())
    ]
    assert not hits, "a date or an issue number in the package (the figure or story goes in docs/): " + ", ".join(hits)


def test_a_date_or_an_issue_number_is_caught():
    text = "ok\n# since 2026-11-27\n(issue 37)\nsee pytorch#181564\nIssue #5\ncolour '#888888', 2.4 ms, 1e-3\n"
    assert _history(text) == [2, 3, 4, 5]


def test_a_torch_older_than_the_floor_is_refused_at_import_naming_both_versions(monkeypatch):
    """pyproject.toml's floor, for an environment pip did not check; a pre-release of the floor
    (an NGC build: 2.10.0a0+...) passes."""
    import importlib

    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(ImportError, match=r"torch 2\.10 or newer .*this is torch 2\.9\.1\+cu128"):
        importlib.reload(graphddp)
    monkeypatch.setattr(torch, "__version__", "2.10.0a0+ecf3bae")
    importlib.reload(graphddp)
