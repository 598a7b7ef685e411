"""``python -m graphddp explain PATH.py:FACTORY``: print or write a model's schedule.

FACTORY is a function in PATH.py returning ``(model, example_inputs)``, where example_inputs is
a tuple of positional arguments. Formats: table (default), json, trace (Chrome/Perfetto), dot,
png/svg (needs matplotlib).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from typing import Any, Sequence

FORMATS = ("table", "json", "trace", "dot", "png", "svg")
_COST_FLAGS = ("bandwidth_gbps", "latency_us", "compute_tflops", "collective_overhead_us")  # CostModel's fields, as flags


def _load_factory(spec: str):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"expected PATH.py:FACTORY, got {spec!r}")
    if not os.path.exists(path):
        raise SystemExit(f"no such file: {path}")
    module_spec = importlib.util.spec_from_file_location("graphddp_user_factory", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["graphddp_user_factory"] = module
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{path} has no function {name!r}")
    return getattr(module, name)


def _cap_list(text: str) -> list[float]:
    """``--bucket-cap-mb-list 1,25``: comma-separated megabytes (DDPConfig checks the values)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated megabytes, got {text!r}") from None


def _cap(text: str) -> float | str:
    """``--bucket-cap-mb 4`` or ``--bucket-cap-mb auto`` (DDPConfig checks the value)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected megabytes or 'auto', got {text!r}") from None


def _json_dict(text: str) -> dict:
    """``--options '{"max_autotune": true}'``: inductor settings as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _optimizer_class(name: str) -> Any:
    import torch

    made = getattr(torch.optim, name, None)
    if not (isinstance(made, type) and issubclass(made, torch.optim.Optimizer)):
        raise argparse.ArgumentTypeError(f"--optimizer: {name!r} is not a class of torch.optim (AdamW, Adam, SGD, ...)")
    return made


def _budget(text: str) -> int | float:
    """``--memory-budget``: bytes as an integer, or a fraction of the device's memory."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _optional_bool(text: str) -> bool | None:
    choices = {"none": None, "true": True, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true, false or none, got {text!r}")
    return choices[text.lower()]


# Each option's argparse kind, where it is not a float (or, for a boolean default, a --flag/--no-flag pair).
_KINDS: dict[str, dict] = {
    "bucket_cap_mb": {"type": _cap, "metavar": "MB|auto"},
    "bucket_cap_mb_list": {"type": _cap_list, "metavar": "MB,MB,..."},
    **{name: {"type": str} for name in ("backend", "comm_hook", "mode", "sharding", "gather")},
    "options": {"type": _json_dict, "metavar": "JSON"},
    "dynamic": {"type": _optional_bool, "metavar": "true|false|none"},
    "memory_budget": {"type": _budget, "metavar": "BYTES|FRACTION"},
    "reshard_after_forward": {"type": _optional_bool, "metavar": "true|false"},
}


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``DDPConfig`` option (``bucket_cap_mb`` -> ``--bucket-cap-mb``), its help text
    from the field, its default None: "not given", so ``options_from_args`` passes only what the
    user set and graphddp's own defaults apply."""
    from graphddp.config import DDPConfig

    for field in DDPConfig.option_fields():
        # cost: explain builds it from --bandwidth-gbps and the like, or names it with --cost; mp_policy: an object
        # (FSDP2's MixedPrecisionPolicy) that graphddp.explain(mp_policy=...) takes; DDP's keywords change no plan.
        if field.name in ("cost", "mp_policy") or field.name in DDPConfig.ddp_keywords():
            continue
        otherwise = {"action": argparse.BooleanOptionalAction} if isinstance(field.default, bool) else {"type": float}
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, dest=field.name, default=None, help=_help(field), **_KINDS.get(field.name, otherwise))


def _help(field: Any) -> str:
    text = plain_text(field.metadata["help"])
    return text if field.default is None or "default" in text else f"{text} (default: {field.default})"


# :role:`~a.b.name` or :role:`a.b.name` (Sphinx cross-references), then ``literal``, then `text`.
_RST_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^`>]*>)?`")
_RST_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_RST_TEXT = re.compile(r"`([^`]+)`")


def plain_text(rst: str) -> str:
    """``rst`` as a terminal shows it: literals and cross-references lose their back-quotes and
    roles. Why: the help's texts are the docstrings and option docs written for Sphinx, and
    ``--help`` would otherwise print their markup."""
    def role(match: re.Match) -> str:
        short, target = match.group(1), match.group(2).strip()
        return target.rsplit(".", 1)[-1] if short else target

    return _RST_TEXT.sub(r"\1", _RST_LITERAL.sub(r"\1", _RST_ROLE.sub(role, rst)))


def options_from_args(args: argparse.Namespace) -> dict:
    """The options the user gave on the command line, as keywords for compile/explain."""
    from graphddp.config import DDPConfig

    return {f.name: getattr(args, f.name) for f in DDPConfig.option_fields() if getattr(args, f.name, None) is not None}


def _mesh_shape(text: str) -> tuple[int, int]:
    """``RxS`` -> ``(R, S)``, two positive ints."""
    try:
        r, s = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-mesh is REPLICATExSHARD, e.g. 2x4; got {text!r}") from None
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"--device-mesh sizes must be positive, got {text!r}")
    return r, s


def main(argv: Sequence[str] | None = None) -> int:
    from graphddp import render
    from graphddp.config import DDPConfig
    from graphddp.frontend.explain import explain
    from graphddp.plan.cost import CostModel
    from graphddp.values import links

    parser = argparse.ArgumentParser(prog="python -m graphddp", description=plain_text(__doc__ or ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="plan a model for N ranks in one process and render the schedule")
    p.add_argument("factory", help="PATH.py:FACTORY returning (model, example_inputs)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--device-mesh", type=_mesh_shape, metavar="RxS",
                   help="hybrid sharding's mesh, REPLICATE x SHARD ranks (2x4: 8 ranks, sharded within groups of 4); "
                        "with --sharding optimizer or full, instead of --world-size")
    p.add_argument("--optimizer", type=_optimizer_class, metavar="NAME",
                   help="a torch.optim class (AdamW, SGD, ...) with its defaults, as optimizer=: the optimizer inside the backward; "
                        "with --sharding full its state is counted")
    add_option_flags(p)
    costs = p.add_argument_group("cost model", "for the predicted times, and the plan of --bucket-cap-mb auto")
    for name in _COST_FLAGS:
        costs.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(CostModel, name))
    costs.add_argument("--cost", metavar="NAME", help="a link preset instead of the flags above: "
                       f"{', '.join(links.names()[:3])}, or GPU+NET[xNICS] (e.g. h100+ndr400x8, a100+eth100)")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--out", help="file to write (default: stdout; required for png/svg)")
    args = parser.parse_args(argv)
    options = options_from_args(args)
    try:  # a bad option is a usage error: say so before loading and tracing the model
        cost = links.preset(args.cost) if args.cost else CostModel(
            **{name: getattr(args, name) for name in _COST_FLAGS}, source="python -m graphddp explain's flags")
        planned = options.get("sharding") == "auto" or (args.cost and DDPConfig.from_options("python -m graphddp explain", options).auto)
        if options.get("bucket_cap_mb") == "auto" or planned:
            options["cost"] = cost
        DDPConfig.from_options("python -m graphddp explain", options)
    except ValueError as e:
        p.error(str(e))

    if args.format in ("png", "svg") and not args.out:
        p.error(f"--format {args.format} needs --out FILE")
    model, example_inputs = _load_factory(args.factory)()
    mesh = {"device_mesh": args.device_mesh} if args.device_mesh else {"world_size": args.world_size}
    schedules = explain(model, *example_inputs, optimizer=args.optimizer, **mesh, **options)
    if args.format in ("png", "svg"):
        root, ext = os.path.splitext(args.out)
        for s in schedules:
            render.plot(s, args.out if len(schedules) == 1 else f"{root}.{s.graph_index}{ext}", cost)
        return 0
    if args.format == "table":
        text = "\n\n".join(f"fingerprint {s.fingerprint()}\n{render.table(s, cost)}" for s in schedules)
        if schedules and schedules[0].choice is not None:
            text = f"{schedules[0].choice}\n\n{text}"
    elif args.format == "json":
        text = json.dumps([s.to_dict() for s in schedules], indent=2, sort_keys=True)
    elif args.format == "trace":
        events = [e for s in schedules for e in render.chrome_trace(s, cost)["traceEvents"]]
        text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    else:
        text = "\n".join(render.dot(s) for s in schedules)
    if not args.out:
        print(text)
        return 0
    with open(args.out, "w") as f:
        f.write(text + "\n")
    return 0
