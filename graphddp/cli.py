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
import sys
from typing import Sequence

FORMATS = ("table", "json", "trace", "dot", "png", "svg")


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


def main(argv: Sequence[str] | None = None) -> int:
    from graphddp.config import DDPConfig
    from graphddp import render
    from graphddp.cost import CostModel
    from graphddp.explain import explain

    parser = argparse.ArgumentParser(prog="python -m graphddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="plan a model for N ranks in one process and render the schedule")
    p.add_argument("factory", help="PATH.py:FACTORY returning (model, example_inputs)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket cap in MB, the first bucket's too (default: DDP's, 25 after a 1 MB first bucket)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=None,
                   help="smaller first bucket (graphddp's extension; clamped to --bucket-cap-mb)")
    p.add_argument("--bucket-cap-mb-list", type=_cap_list, default=None, metavar="MB,MB,...",
                   help="one cap per bucket in ready order, the last repeating (DDP's bucket_cap_mb_list)")
    p.add_argument("--last-bucket-cap-mb", type=float, default=None,
                   help="cap of the bucket of the gradients produced last (default: off)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--bandwidth-gbps", type=float, default=CostModel.bandwidth_gbps)
    p.add_argument("--latency-us", type=float, default=CostModel.latency_us)
    p.add_argument("--compute-tflops", type=float, default=CostModel.compute_tflops)
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--out", help="file to write (default: stdout; required for png/svg)")
    args = parser.parse_args(argv)
    try:  # a bad cap is a usage error: say so before loading and tracing the model
        DDPConfig(bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb,
                  bucket_cap_mb_list=args.bucket_cap_mb_list, last_bucket_cap_mb=args.last_bucket_cap_mb)
    except ValueError as e:
        p.error(str(e))

    model, example_inputs = _load_factory(args.factory)()
    cost = CostModel(bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us, compute_tflops=args.compute_tflops)
    schedules = explain(model, *example_inputs, world_size=args.world_size, bucket_cap_mb=args.bucket_cap_mb,
                        first_bucket_cap_mb=args.first_bucket_cap_mb, bucket_cap_mb_list=args.bucket_cap_mb_list,
                        last_bucket_cap_mb=args.last_bucket_cap_mb, backend=args.backend)
    if args.format in ("png", "svg"):
        if not args.out:
            raise SystemExit(f"--format {args.format} needs --out FILE")
        root, ext = os.path.splitext(args.out)
        for s in schedules:
            render.plot(s, args.out if len(schedules) == 1 else f"{root}.{s.graph_index}{ext}", cost)
        return 0
    if args.format == "table":
        text = "\n\n".join(f"fingerprint {s.fingerprint()}\n{render.table(s, cost)}" for s in schedules)
    elif args.format == "json":
        text = json.dumps([s.to_dict() for s in schedules], indent=2, sort_keys=True)
    elif args.format == "trace":
        events = [e for s in schedules for e in render.chrome_trace(s, cost)["traceEvents"]]
        text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    else:
        text = "\n".join(render.dot(s) for s in schedules)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0
