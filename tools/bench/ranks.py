"""One rank's side of the benchmark: build every mode, run the interleaved timed rounds."""
from __future__ import annotations

import copy
import functools
import inspect
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.plan.cost import simulate
from graphddp.values.part_schedule import FullSchedule
from tools.bench import powersgd
from tools.bench.modes import (
    CommOnlyMode,
    CountingBackend,
    TrainMode,
    UnboundComm,
    _ddp_buckets,
    _now,
    _profile_step,
    _ready_fractions,
    check_averaged_once,
    check_update_in_backward,
    ddp_compiled_autograd,
    flat_allreduce,
)
from tools.bench.predict import cost_record, ddp_config, predictions
from tools.bench.sharded import SHARDED_MODES, param_bytes, state_bytes
from tools.bench.sharded import build as build_sharded
from tools.bench.workload import (
    CA_FUSE_PASSES,
    DDP_CAPS,
    MAX_GRAD_NORM,
    MB,
    MODES,
    OPTIMIZER,
    POWERSGD_MODES,
    POWERSGD_SETTINGS,
    SWEEP_CAPS,
    BenchConfig,
    graphddp_cap_mb,
    loss_fn,
    make_batch,
    make_model,
    make_optimizer,
    swept_options,
)


def rank_main(rank: int, world: int, cfg: BenchConfig, result_path: str) -> None:
    """Build every mode from one seeded model, time them interleaved, gather to rank 0's file.

    graphddp is built first: its schedule gives comm_only / ideal_overlap their bucket list and
    ddp_same_buckets its caps. ddp_compiled_autograd is built last (its DDP touches
    process-wide settings). Each mode's first step (compile included) is timed apart. After
    the timed rounds, the two modes of issue 11 are checked (their gradients averaged once;
    the in-backward step equal to torch's), then every mode runs one profiled step. The
    PowerSGD modes are stepped into their compressed phase right after their first step, and
    checked to compress every timed step (``powersgd.py``).
    """
    import graphddp

    info: dict[str, Any] = {}
    torch._dynamo.config.optimize_ddp = True  # DDPOptimizer for ddp_compiled (the default)
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    # Issue 12: the cost model bucket_cap_mb="auto" plans with, calibrated on this group once,
    # here, on every rank (a collective; cached per group, so graphddp_auto's planner gets these
    # very numbers); every graphddp* mode's backward is predicted with it (``predict.py``).
    from graphddp.runtime.calibrate import calibrate

    dist.barrier()
    t = _now()
    cost = calibrate(dist.group.WORLD, torch.device("cpu"))
    info["cost_model"] = {**cost_record(cost), "calibrate_s": _now() - t}
    torch.manual_seed(cfg.seed)
    base = make_model(cfg)
    batch = make_batch(cfg, rank)
    loss = loss_fn(cfg)
    modes: dict[str, Any] = {}
    first: dict[str, float] = {}

    def first_step(name: str, mode: Any) -> None:
        dist.barrier()
        t = _now()
        mode.step()
        first[name] = _now() - t
        dist.barrier()
        modes[name] = mode
        if rank == 0:
            print(f"[bench] {name}: first step {first[name]:.2f} s", flush=True)

    # graphddp first: its schedule gives comm_only's buckets and ddp_same_buckets' caps.
    m = graphddp.compile(copy.deepcopy(base), **cfg.graphddp.as_options())
    first_step("graphddp", TrainMode("graphddp", m, m.parameters(), batch, loss))
    schedules = m.schedules
    buckets = [b for s in schedules for b in s.buckets]
    info["graphddp"] = {
        "schedules": [s.to_table() for s in schedules],
        "fingerprints": [s.fingerprint() for s in schedules],
        "buckets": [{"index": b.index, "nbytes": b.nbytes, "dtype": b.dtype, "params": list(b.param_names)} for b in buckets],
        "estimate": [simulate(s).to_dict() for s in schedules],
        # The plans without their backward nodes: the release-time bound simulates the buckets.
        "schedule_dicts": [{**s.to_dict(), "nodes": []} for s in schedules],
    }
    if len(buckets) < 2:
        raise RuntimeError(f"graphddp made {len(buckets)} bucket(s); the benchmark needs several")

    if "graphddp_tail_off" in cfg.modes and cfg.graphddp.last_bucket_cap_mb is not None:
        # The same caps without last_bucket_cap_mb: what the small tail bucket buys, in this run.
        m = graphddp.compile(copy.deepcopy(base), **{**cfg.graphddp.as_options(), "last_bucket_cap_mb": None})
        first_step("graphddp_tail_off", TrainMode("graphddp_tail_off", m, m.parameters(), batch, loss))

    if "graphddp_optim" in cfg.modes:
        # The optimizer first, over the module's parameters, then attached: its update runs
        # inside the backward and TrainMode's step()/zero_grad() on it are no-ops.
        model = copy.deepcopy(base)
        opt = make_optimizer(model.parameters())
        m = graphddp.compile(model, optimizer=opt, **cfg.graphddp.as_options())
        first_step("graphddp_optim", TrainMode("graphddp_optim", m, None, batch, loss, opt=opt))
        info["graphddp_optim"] = {"optimizer": OPTIMIZER, "buckets": sum(len(s.buckets) for s in m.schedules)}

    if "graphddp_optim_clip" in cfg.modes:  # --modes clip: graphddp_optim, clipped inside the backward
        model = copy.deepcopy(base)
        opt = make_optimizer(model.parameters())
        m = graphddp.compile(model, optimizer=opt, **{**cfg.graphddp.as_options(), "max_grad_norm": MAX_GRAD_NORM})
        first_step("graphddp_optim_clip", TrainMode("graphddp_optim_clip", m, None, batch, loss, opt=opt))
    if "graphddp_clip" in cfg.modes:  # ... and what a loop without optimizer= does: clip_grad_norm_, then step
        m = graphddp.compile(copy.deepcopy(base), **cfg.graphddp.as_options())
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(m.parameters()), MAX_GRAD_NORM)
        first_step("graphddp_clip", TrainMode("graphddp_clip", m, m.parameters(), batch, loss, after_backward=clip))

    for name in SHARDED_MODES:  # --modes sharded: the optimizer state on a shard, three ways
        if name in cfg.modes:
            mode, _ = build_sharded(name, base, batch, loss, cfg.graphddp.as_options())
            first_step(name, mode)

    # Issue 12: bucket_cap_mb="auto" (graphddp's planner minimises the predicted backward under
    # the calibrated cost model) and graphddp at each swept cap, DDP's semantics for a set cap.
    if "graphddp_auto" in cfg.modes:
        m = graphddp.compile(copy.deepcopy(base), **swept_options(cfg.graphddp, "auto"))
        first_step("graphddp_auto", TrainMode("graphddp_auto", m, m.parameters(), batch, loss))
        models = [s.cost_model for s in m.schedules]
        info["graphddp_auto"] = {
            "schedules": [s.to_table(simulate(s, cost)) for s in m.schedules],
            "bucket_mb": [b.nbytes / MB for s in m.schedules for b in s.buckets],
            "cost_model": cost_record(models[0]) if models else None,
            # The planner's own calibration is the cached one this rank made above.
            "same_cost_model_as_calibrated": all(c == cost for c in models),
        }
    for c in SWEEP_CAPS:
        name = f"graphddp_cap{c}"
        if name in cfg.modes:
            m = graphddp.compile(copy.deepcopy(base), **swept_options(cfg.graphddp, c))
            first_step(name, TrainMode(name, m, m.parameters(), batch, loss))

    # Issue 13: PowerSGD. Each mode is stepped past its plain all-reduce steps (and its first
    # compressed one: graphddp compiles that variant on first use) before the timed rounds.
    psgd: dict[str, tuple[powersgd.PowerSGDMode, Any]] = {}

    def powersgd_mode(built: tuple[powersgd.PowerSGDMode, Any]) -> None:
        mode, _ = built
        first_step(mode.name, mode.train)
        if mode.name == "ddp_powersgd":
            powersgd.check_one_bucket(mode)  # before a compressed step: more than one would hang
        mode.step_to_compressed()
        psgd[mode.name] = built
        if rank == 0:
            print(f"[bench] {mode.name}: first compressed step {mode.first_compressed_s:.2f} s", flush=True)

    if "graphddp_powersgd" in cfg.modes:
        powersgd_mode(powersgd.build_graphddp(cfg, base, batch, loss))

    counting = CountingBackend(cfg.graphddp.backend)
    if "compute_only" in cfg.modes:
        m = torch.compile(copy.deepcopy(base), backend=counting)
        first_step("compute_only", TrainMode("compute_only", m, m.parameters(), batch, loss))
    if "compute_eager" in cfg.modes:  # what eager DDP computes, without its communication
        m = copy.deepcopy(base)
        first_step("compute_eager", TrainMode("compute_eager", m, m.parameters(), batch, loss))
    if "no_overlap" in cfg.modes:
        m = torch.compile(copy.deepcopy(base), backend=CountingBackend(cfg.graphddp.backend))
        first_step("no_overlap", TrainMode("no_overlap", m, m.parameters(), batch, loss, flat_allreduce(m, world)))
    bucket_specs = [(b.numel, getattr(torch, b.dtype)) for b in buckets]
    if "comm_only" in cfg.modes:
        first_step("comm_only", CommOnlyMode(bucket_specs))
    if "ideal_overlap" in cfg.modes:
        m = torch.compile(copy.deepcopy(base), backend=CountingBackend(cfg.graphddp.backend))
        comm = UnboundComm(bucket_specs)
        first_step("ideal_overlap", TrainMode("ideal_overlap", m, m.parameters(), batch, loss,
                                              after_backward=comm.wait, before_backward=comm.issue))

    DDP = nn.parallel.DistributedDataParallel
    ddp_variants: dict[str, dict] = {"ddp_default": {}}
    same_caps = [b.nbytes / MB for b in buckets]
    same_cap = graphddp_cap_mb(cfg.graphddp, [b.nbytes for b in buckets])

    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        ddp_variants["ddp_same_buckets"] = {"bucket_cap_mb_list": same_caps}
        info["ddp_same_buckets"] = {"method": "bucket_cap_mb_list", "caps_mb": same_caps}
    else:  # older torch: uniform cap only
        ddp_variants["ddp_same_buckets"] = {"bucket_cap_mb": same_cap}
        info["ddp_same_buckets"] = {"method": "bucket_cap_mb (no bucket_cap_mb_list in this torch)",
                                    "caps_mb": [same_cap]}
    for c in DDP_CAPS:
        ddp_variants[f"ddp_cap{c}"] = {"bucket_cap_mb": c}
    for name, kwargs in ddp_variants.items():
        if name not in cfg.modes:
            continue
        m = DDP(copy.deepcopy(base), **kwargs)
        first_step(name, TrainMode(name, m, m.parameters(), batch, loss))
    for name in ("ddp_powersgd", "ddp_powersgd_serial"):
        if name in cfg.modes:
            powersgd_mode(powersgd.build_ddp(cfg, base, batch, loss, serial=name.endswith("_serial")))

    # ddp_compiled is DDP(torch.compile(model)) as users write it (DDP's default caps);
    # ddp_compiled_samecap gives DDPOptimizer graphddp's cap, for a like-for-like split.
    compiled_variants = {"ddp_compiled": {}, "ddp_compiled_samecap": {"bucket_cap_mb": same_cap}}
    for name, kwargs in compiled_variants.items():
        if name not in cfg.modes:
            continue
        dc = CountingBackend(cfg.graphddp.backend)
        m = DDP(torch.compile(copy.deepcopy(base), backend=dc), **kwargs)
        first_step(name, TrainMode(name, m, m.parameters(), batch, loss))
        plain_graphs = counting.graphs if "compute_only" in cfg.modes else 1
        info[name] = {"graphs": dc.graphs, "graphs_without_ddp": plain_graphs,
                      "bucket_cap_mb": kwargs.get("bucket_cap_mb", "default (25, DDPOptimizer first bucket 1)")}
        if dc.graphs <= max(1, plain_graphs):
            raise RuntimeError(
                f"{name}: Dynamo compiled {dc.graphs} graph(s), the model alone compiles to "
                f"{plain_graphs}: DDPOptimizer did not split the graph (optimize_ddp="
                f"{torch._dynamo.config.optimize_ddp!r}); the baseline would not be DDP+compile as users run it"
            )

    if "ddp_compiled_autograd" in cfg.modes:
        # Last of the compiled modes: its DDP construction touches process-wide settings
        # (restored by ddp_compiled_autograd(); see there).
        m, ca_backward = ddp_compiled_autograd(copy.deepcopy(base), cfg.graphddp.backend)
        first_step("ddp_compiled_autograd", TrainMode("ddp_compiled_autograd", m, m.parameters(), batch, loss,
                                                      backward_ctx=ca_backward))
        info["ddp_compiled_autograd"] = {"fuse_passes": list(CA_FUSE_PASSES),
                                         "fuse_bucket_mb": ca_backward.bucket_size_mb}

    info["ready"] = _ready_fractions(cfg, base, batch, loss, [list(b.param_names) for b in buckets])

    # The timed rounds: every mode once per round, order rotated each round.
    order = [n for n in MODES if n in modes]
    records: dict[str, list] = {n: [] for n in order}
    rounds = cfg.warmup + cfg.steps
    for mode, _ in psgd.values():
        mode.check_compressed()  # fails loudly unless every round below is a compressed step
    for r in range(rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            dist.barrier()
            carries = getattr(modes[name], "carries_gathers", None)
            if carries is not None:
                modes[name].step()  # untimed: leaves its all-gathers for the timed step's forward
            rec = modes[name].step()
            if carries is not None:
                carries()  # the next training step's forward would wait for these: not this step's
            dist.barrier()
            if r >= cfg.warmup:
                records[name].append(rec)
        if rank == 0 and (r + 1) % 5 == 0:
            print(f"[bench] round {r + 1}/{rounds}", flush=True)

    # DDP rebuilds its buckets in gradient-ready order at the second forward; read them now.
    # Their buffers live as long as the model: the memory figures add them to DDP's peak.
    # torch.compile(DDP(...)) (ddp_compiled_autograd) too: its C++ reducer, unused by the
    # Python reducer, still allocates its bucket buffers.
    for name in order:
        ddp = _as_ddp(getattr(modes[name], "model", None))
        if ddp is not None:
            local = {id(p): n for n, p in ddp.module.named_parameters()}
            try:
                info.setdefault("ddp_buckets", {})[name] = _ddp_buckets(ddp, local)
            except (RuntimeError, AttributeError) as e:  # a reducer without readable buckets
                info.setdefault("ddp_buckets_unreadable", {})[name] = repr(e)
    if "ddp_same_buckets" in info.get("ddp_buckets", {}):
        got = info["ddp_buckets"]["ddp_same_buckets"]
        info["ddp_same_buckets"]["ddp_bucket_mb"] = [b["nbytes"] / MB for b in got]
        info["ddp_same_buckets"]["same_sizes"] = [b["nbytes"] for b in got] == [b.nbytes for b in buckets]
        info["ddp_same_buckets"]["same_params"] = [sorted(b["params"]) for b in got] == [sorted(b.param_names) for b in buckets]

    info["wire"] = _wire(modes, order, info, base)
    # Issue 12: each mode's backward by the calibrated cost model (predict.py), next to the measured.
    # full sharding's schedules are read back from its graphs: no predicted timeline (its bytes: _wire)
    scheduled = {n: [s for s in modes[n].model.schedules if not isinstance(s, FullSchedule)] for n in order if n.startswith("graphddp")}
    facts = "graphddp_auto" if "graphddp_auto" in scheduled else "graphddp"
    info["predicted"] = predictions(cost, scheduled, [n for n in order if ddp_config(n) is not None],
                                    (facts, scheduled[facts]), info.get("ddp_buckets", {}))
    if psgd:
        info["powersgd"] = {"settings": {"matrix_approximation_rank": cfg.powersgd_rank, **POWERSGD_SETTINGS},
                            "modes": {}}
    for name, (mode, hook_or_state) in psgd.items():
        checked = mode.check_all_compressed(rounds)
        if name == "graphddp_powersgd":
            wire = powersgd.graphddp_wire(mode.train.model, hook_or_state)
        else:
            wire = powersgd.ddp_wire(mode.train.model, hook_or_state)
        info["wire"][name] = wire
        info["powersgd"]["modes"][name] = {
            **checked, "start_powerSGD_iter": mode.start, "first_compressed_step_s": mode.first_compressed_s,
            "timed_steps_compressed": True, **({"ddp_kwargs": mode.ddp_kwargs} if mode.ddp_kwargs is not None else {}),
        }

    if "ddp_compiled_autograd" in modes:
        _check_compiled_autograd(modes["ddp_compiled_autograd"], world, info["ddp_compiled_autograd"])
    if "graphddp_optim" in modes:
        mode = modes["graphddp_optim"]
        info["graphddp_optim"]["step_vs_torch"] = check_update_in_backward(mode, mode.model.module, world)

    # What each mode keeps between steps on this rank: its optimizer state and its parameters,
    # read right after its profiled steps (gather="forward" then holds the all-gathers its last
    # step left for the next forward; the timed rounds finished them).
    info["state_mb"] = {name: state_bytes(modes[name].opt) / MB for name in order if hasattr(modes[name], "opt")}
    info["param_mb"], profiles = {}, {}
    for name in order:
        profiles[name] = _profile_step(modes[name])
        if hasattr(modes[name], "model"):
            info["param_mb"][name] = param_bytes(modes[name].model) / MB
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"records": records, "first": first, "profiles": profiles, "info": info})
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f)


def _wire(modes: dict[str, Any], order: list[str], info: dict[str, Any], base: nn.Module) -> dict[str, dict]:
    """Bytes each rank puts on the wire per step, for the modes without a compression hook of
    their own (the PowerSGD modes are filled in apart): graphddp's from its schedules, every
    other all-reducing mode's the model's gradients (fp32, sent as they are)."""
    grads = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    graphddp_wire = sum(b.wire_nbytes for s in modes["graphddp"].model.schedules for b in s.buckets)
    out: dict[str, dict] = {}
    for name in order:
        if name in POWERSGD_MODES:
            continue
        full = [s for s in modes[name].model.schedules if isinstance(s, FullSchedule)] if name.startswith("graphddp") else []
        if full:
            nbytes = sum(b.whole_bytes for s in full for g in s.graphs for b in g.buckets)
            src = "sum(PartBucket.whole_bytes) of model.schedules: every gather and reduce-scatter, whole"
        elif name.startswith("graphddp"):
            nbytes = sum(b.wire_nbytes for s in modes[name].model.schedules for b in s.buckets)
            src = "sum(Bucket.wire_nbytes) of model.schedules"
        elif name in ("comm_only", "ideal_overlap"):
            nbytes, src = graphddp_wire, "graphddp's buckets"
        elif name.startswith("compute"):
            nbytes, src = 0, "no communication"
        else:
            nbytes, src = grads, "every gradient, fp32, all-reduced as it is"
        out[name] = {"bytes": nbytes, "uncompressed_bytes": grads, "source": src}
        if full:
            out[name]["buckets"] = sum(len(g.buckets) for s in full for g in s.graphs)
        elif name.startswith("graphddp"):
            out[name]["buckets"] = sum(len(s.buckets) for s in modes[name].model.schedules)
        elif name in info.get("ddp_buckets", {}) and name != "ddp_compiled_autograd":  # its C++ buckets go unused
            out[name]["buckets"] = len(info["ddp_buckets"][name])
    return out


def _check_compiled_autograd(mode: TrainMode, world: int, info: dict[str, Any]) -> None:
    """ddp_compiled_autograd must all-reduce, and average once: else it is no DDP baseline.

    Without compiled autograd around its backward, or with the hooks traced away, the
    gradients would stay local (or come out summed); both fail here, as DDPOptimizer's
    unsplit graph fails ddp_compiled's check.
    """
    ddp = mode.model._orig_mod  # torch.compile(DDP(module))
    errors = check_averaged_once(mode, ddp.module, world)
    info["grad_error_vs_averaged_eager"] = errors
    if not errors["averaged"] < 1e-3 < min(errors["summed"], errors["local"]):
        raise RuntimeError(
            f"ddp_compiled_autograd: its gradients are not the ranks' average of eager gradients "
            f"(relative max error vs averaged {errors['averaged']:.2g}, vs summed {errors['summed']:.2g}, "
            f"vs local {errors['local']:.2g}): compiled autograd or DDP's Python reducer did not all-reduce"
        )


def _as_ddp(model: nn.Module | None) -> nn.parallel.DistributedDataParallel | None:
    """The DDP instance a mode trains through: the model itself, or what torch.compile wraps."""
    for m in (model, getattr(model, "_orig_mod", None)):
        if isinstance(m, nn.parallel.DistributedDataParallel):
            return m
    return None
