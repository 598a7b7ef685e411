"""Issue 35's prototype question, answered by running it: can Dynamo and AOTAutograd trace
parameters kept as 1/N parts, gathered where they are read, into the compiled graphs?

No graphddp pass runs here; this is the frontend step of docs/design-full-sharding.md on its
own. Each parameter of the model is replaced by this rank's part (the cut of
``graphddp.values.shards``: ``chunk(numel, world)`` elements, the last ranks zero-padded), and
its module's class gets a property of the same name whose getter all-gathers the parts
(``_functional_collectives.all_gather_single``, which has an autograd formula: its backward is a
reduce-scatter of the gradient) and views the result as the full parameter, SimpleFSDP's
parametrization with plain tensors instead of DTensor. Tied weights share one part, so both
modules' getters gather it and autograd sums the two reduce-scattered gradients on it.

Then ``torch.compile`` (AOTAutograd with recording compilers, or a backend named by
``--backend``) trains it next to ``DistributedDataParallel`` on the same batches, SGD on both:
each step every part's gradient, divided by the world size, must equal DDP's averaged gradient's
part. Rank 0 reports the compiled graphs, the collectives in each, graph breaks, and which
forward outputs the backward saves (a gathered parameter among them means the full parameter
lives from the forward to the backward: ``reshard_after_forward=False`` by default).

    python -m tools.full_sharding_probe                    # MLP and HF GPT-2 from config, 2 ranks
    python -m tools.full_sharding_probe --world 3          # uneven parts
    python -m tools.full_sharding_probe --model gpt2 --backend inductor
"""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import os
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from graphddp.values.shards import chunk


def padded_part(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``t``'s flat view as the wire holds it (``values.shards``): ``chunk``
    elements, zeros past the end of ``t``."""
    c = chunk(t.numel(), world)
    flat = torch.zeros(world * c, dtype=t.dtype)
    flat[: t.numel()] = t.detach().reshape(-1)
    return flat[rank * c:(rank + 1) * c].clone()


def _gathered(part: torch.Tensor, shape: tuple[int, ...], numel: int, group: Any) -> torch.Tensor:
    """The full parameter from every rank's part: all-gather, drop the padding, view."""
    return funcol.all_gather_single(part, 0, group)[:numel].view(shape)


def shard_parameters(model: nn.Module, group: Any) -> dict[str, nn.Parameter]:
    """Replace every parameter by this rank's part and every read of it by a gather.

    Returns the parts by the first name each parameter has (``named_parameters`` order). Each
    module with parameters gets a subclass of its class whose properties shadow the parameter
    names; ``module._parameters`` holds the parts, so ``parameters()`` and optimizers see parts.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts: dict[int, nn.Parameter] = {}
    named: dict[str, nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        props = {}
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in parts:
                q = nn.Parameter(padded_part(p, world, rank), requires_grad=p.requires_grad)
                q.full_shape, q.full_numel = tuple(p.shape), p.numel()  # type: ignore[attr-defined]
                parts[id(p)] = q
                named[f"{mod_name}.{name}" if mod_name else name] = q
            mod._parameters[name] = parts[id(p)]

            def getter(self: nn.Module, _name: str = name) -> torch.Tensor:
                q = self._parameters[_name]
                return _gathered(q, q.full_shape, q.full_numel, group)

            props[name] = property(getter)
        if props:
            mod.__class__ = type(f"Sharded{type(mod).__name__}", (type(mod),), props)
    return named


def regather_in_backward(module: nn.Module) -> None:
    """Run ``module``'s forward under a selective activation checkpoint that recomputes every
    gather (and every view, which may alias a gathered buffer) and saves everything else: the
    partitioner then re-gathers in the backward instead of keeping the full parameters from
    the forward (``reshard_after_forward=True``, SimpleFSDP's policy). A checkpointed region
    cannot contain a graph break, so it goes around blocks, not around a whole HF model."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    gathers = {torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default}

    def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op in gathers:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE if getattr(op, "is_view", False) else CheckpointPolicy.PREFER_SAVE

    context = functools.partial(create_selective_checkpoint_contexts, policy)  # Dynamo traces a partial, not a lambda

    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    module.forward = run


def _models(name: str) -> tuple[Callable[[], nn.Module], Callable[[int, int], tuple[tuple, dict]], Callable[[Any], torch.Tensor]]:
    if name == "gpt2":
        from graphddp.testing import tiny_hf_gpt2, tiny_hf_gpt2_batch

        return tiny_hf_gpt2, lambda r, s: ((), tiny_hf_gpt2_batch(r, s)), lambda out: out.loss

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5))

    def batch(r: int, s: int) -> tuple[tuple, dict]:
        return (torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * r + s)),), {}

    return mlp, batch, lambda out: out.square().mean()


def probe(rank: int, world: int, model_name: str, backend: str, steps: int, out_path: str, reshard: bool = False) -> None:
    """One rank: shard, compile, train next to DDP, compare; rank 0 writes the report."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())  # process-wide: a long-lived rank has counted others'
    make, batch, loss_of = _models(model_name)
    model = make()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    parts = shard_parameters(model, dist.group.WORLD)
    graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def record(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs.append((kind, gm))
            return gm
        return compiler

    chosen = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward")) if backend == "record" else backend
    if reshard:  # per transformer block (HF GPT-2), or the whole MLP
        for block in getattr(getattr(model, "transformer", None), "h", [model]):
            regather_in_backward(block)
    compiled = torch.compile(model, backend=chosen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        args, kwargs = batch(rank, step)
        loss_of(compiled(*args, **kwargs)).backward()
        loss_of(ref(*args, **kwargs)).backward()
        full = dict(ref.module.named_parameters())
        for name, q in parts.items():
            expect = padded_part(full[name].grad, world, rank)
            q.grad /= world  # the reduce-scatter summed; DDP averages
            torch.testing.assert_close(q.grad, expect, atol=1e-5, rtol=1e-4, msg=lambda m: f"step {step} {name}: {m}")
            worst = max(worst, float((q.grad - expect).abs().max()))
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    if rank != 0:
        return
    report: dict[str, Any] = {
        "model": model_name, "world": world, "backend": backend, "steps": steps, "reshard": reshard,
        "parts": len(parts), "max_abs_grad_difference": worst,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
        "graphs": [],
    }
    for kind, gm in graphs:
        ops = collections.Counter(str(n.target) for n in gm.graph.nodes
                                  if n.op == "call_function" and "c10d" in str(n.target))
        entry: dict[str, Any] = {"kind": kind, "collectives": dict(ops)}
        if kind == "forward":
            out = next(n for n in gm.graph.nodes if n.op == "output")
            entry["saved_from_a_gather"] = sum(_from_gather(a) for a in out.args[0] if isinstance(a, torch.fx.Node))
        report["graphs"].append(entry)
    with open(out_path, "w") as f:
        json.dump(report, f)


def _from_gather(node: torch.fx.Node, depth: int = 4) -> bool:
    """Is ``node`` a gathered parameter or a view of one (a few view steps back)?"""
    if "all_gather" in str(node.target) or "wait_tensor" in str(node.target):
        return True
    return depth > 0 and len(node.all_input_nodes) == 1 and _from_gather(node.all_input_nodes[0], depth - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mlp", "gpt2", "both"), default="both")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="record", help="'record' (AOTAutograd, graphs kept for the report) or a torch.compile backend")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reshard", action="store_true", help="recompute the gathers in the backward (selective activation checkpoint)")
    args = p.parse_args(argv)
    from graphddp.testing import spawn

    reports = []
    for name in ("mlp", "gpt2") if args.model == "both" else (args.model,):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report.json")
            spawn(probe, args.world, name, args.backend, args.steps, out, args.reshard)
            with open(out) as f:
                reports.append(json.load(f))
    for r in reports:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
