"""Measure the cost model that ``bucket_cap_mb="auto"`` plans with, once per process group.

It runs when a model is wrapped, where DDP's constructor talks to every rank too, never while
compiling. Every rank times blocking all-reduces of ``SIZES`` (their alpha-beta line fitted
unweighted, so that the large sizes buckets have count most: a fit by relative error underprices
the bandwidth), the compute lane's cost of a collective and, on the CPU, its share of a
collective's link time, and a matmul, a copy and a one-element add on the model's device.

Each time is the fastest of its repeats, not their median (what disturbs a microbenchmark only
adds time), then the largest over ranks, so that every rank plans the same buckets. Figures are
rounded to two significant figures so that reruns plan alike and hit the compile cache, and a
restart keeps stored numbers it measures close to (:mod:`graphddp.runtime.calibration_store`). A
link fit that is noise is measured again, then its latency floored; the model's ``source`` says
which. Under a fake process group nothing is timed: ``CostModel()``'s defaults.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from graphddp.config import DDPConfig
from graphddp.plan.cost import CostModel, fit_link, floor_latency, link_noise
from graphddp.runtime.agree import gather, max_over_ranks
from graphddp.runtime.calibration_store import settle
from graphddp.values.comm import group_name_of

SIZES = (1 << 16, 1 << 20, 1 << 22)  # bytes per all-reduce: the range buckets span
# Per all-reduce size: enough that a loopback's fit stays within the band a restart keeps
# (KEEP_WITHIN), few enough that a slow link calibrates in seconds.
REPEATS = 15
COMPUTE_REPEATS = 15  # a few ms each; a busy machine's cores can run a matmul at two speeds by turns


# The process's calibrated cost models, per (group name, backend, ranks, device type): a calibration
# measures the group's link, not a model, and costs every rank seconds on a slow link, so only the
# first wrap on a group pays.
CALIBRATIONS: dict[tuple[str, str, int, str], CostModel] = {}


def resolve_cost(config: DDPConfig, group: Any, device: torch.device | None) -> DDPConfig:
    """``config`` with the cost model its plan needs: the user's ``cost``, else a calibrated one
    (``bucket_cap_mb="auto"`` only). A collective: every rank of ``group`` calls it at once."""
    if not config.auto or config.cost is not None:
        return config
    return dataclasses.replace(config, cost=calibrate(group, device))


def calibrate(group: Any, device: torch.device | None = None) -> CostModel:
    """The cost model of ``group``'s link and this device; a collective, measured once per group."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    world = dist.get_world_size(group)
    key = (group_name_of(group) if world > 1 else "", str(dist.get_backend(group)), world, device.type)
    known = CALIBRATIONS.get(key)
    if known is not None:
        return known
    if key[1] == "fake":  # graphddp.explain's pretend ranks: nothing to time
        return CostModel(source=f"default: a fake process group of {world} ranks has no link to measure")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = _compute_times(device, sync) + (_link_times(group, device, sync) if world > 1 else [])
    matmul_s, copy_s, op_s, *link = max_over_ranks(times, group, torch.float64)
    rates = {
        "compute_tflops": _round2(2 * _MATMUL_N[device.type] ** 3 / matmul_s / 1e12),
        "memory_gbps": _round2(2 * _COPY_BYTES / copy_s / 1e9),
        "op_overhead_us": _round2(op_s * 1e6),
    }
    source = f"calibrated on process group {key[0] or 'of one rank'} ({world} ranks, {device.type})"
    if world == 1:
        model = CostModel(**rates, source=source)
    else:
        issue_s, *allreduce = link
        fitted, noise = _fit_link(allreduce, world, group, device, sync)
        share = _host_share(group, sync, allreduce[len(SIZES) - 1]) if device.type == "cpu" else 0.0
        model = CostModel(
            bandwidth_gbps=_round2(fitted.bandwidth_gbps), latency_us=_round2(fitted.latency_us),
            collective_overhead_us=_round2(issue_s * 1e6), collective_host_share=share, **rates, source=source + noise,
        )
    model = settle(model, key, group)
    CALIBRATIONS[key] = model
    return model


_MATMUL_N = {"cpu": 512, "cuda": 4096}  # large enough to run at the device's matmul rate
_COPY_BYTES = 32 << 20


def fastest_seconds(
    run: Callable[[], Any], sync: Callable[[], None], repeats: int, before: Callable[[], Any] = lambda: None
) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up, ``before`` each (untimed): a barrier."""
    run()  # warm-up: first-call allocation and dispatch
    sync()
    samples = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return min(samples)


def _compute_times(device: torch.device, sync: Callable[[], None]) -> list[float]:
    n = _MATMUL_N.get(device.type, 256)
    # A private generator: the global ones are the user's (a draw from them here would shift
    # every batch a training loop samples after wrapping, and its run would no longer equal DDP's).
    a = torch.randn(n, n, device=device, generator=torch.Generator(device).manual_seed(0))
    big = torch.empty(_COPY_BYTES // 4, device=device)
    into = torch.empty_like(big)  # preallocated: a fresh clone would time the page faults
    one = torch.zeros(1, device=device)
    return [
        fastest_seconds(lambda: a @ a, sync, COMPUTE_REPEATS),
        fastest_seconds(lambda: into.copy_(big), sync, COMPUTE_REPEATS),
        fastest_seconds(lambda: one + 1, sync, COMPUTE_REPEATS),
    ]


def _link_times(group: Any, device: torch.device, sync: Callable[[], None]) -> list[float]:
    allreduce = _allreduce_times(group, device, sync)
    return [_collective_overhead_seconds(group, device, sync, allreduce[0])] + allreduce


def _allreduce_times(group: Any, device: torch.device, sync: Callable[[], None]) -> list[float]:
    """A blocking all-reduce's time per size of ``SIZES``, then the smallest one's spread."""
    timed = [_collective_seconds(nbytes, group, device, sync) for nbytes in SIZES]
    return [fastest for fastest, _ in timed] + [timed[0][1]]


def _fit_link(link: list[float], world: int, group: Any, device: torch.device, sync: Callable[[], None]) -> tuple[CostModel, str]:
    """The link's figures fitted, and what was done about noise; every rank holds the same times,
    so every rank measures again, or none."""
    fitted = fit_link(SIZES, link[:-1], world)
    noise = link_noise(fitted, link[-1], world)
    if noise is None:
        return fitted, ""
    again = max_over_ranks(_allreduce_times(group, device, sync), group, torch.float64)
    fitted = fit_link(SIZES, again[:-1], world)
    second = link_noise(fitted, again[-1], world)
    if second is None:
        return fitted, f"; the link measured twice, the first fit being noise ({noise})"
    floored = floor_latency(fitted, device.type)
    return floored, f"; the link's fit noise twice ({noise}, then {second}): latency floored at {floored.latency_us:g} us"


# The compute that collectives are issued into (CPU): square matmuls of this size, as many as
# take at least LOADED_MIN_S and LOADED_PER_COLLECTIVE times a small all-reduce, so that every
# collective issued into it ends before it does, and what the block loses is cores, not waits.
_LOADED_N = 96
LOADED_MIN_S = 2e-3
LOADED_PER_COLLECTIVE = 8
LOADED_COLLECTIVES = 4  # issued into one block, one per quarter


def _collective_overhead_seconds(group: Any, device: torch.device, sync: Callable[[], None], small_allreduce_s: float) -> float:
    """The compute lane's cost of one collective: the time to issue an asynchronous all-reduce or,
    on the CPU, what a collective takes from the compute beside it (:func:`_compute_lost`), whichever
    is more. A gloo collective's threads run on the cores the ranks compute on: where the ranks take
    every core, a collective costs the compute far more than issuing it."""
    one = torch.zeros(1, device=device)

    def issue() -> float:
        start = time.perf_counter()
        work = dist.all_reduce(one, group=group, async_op=True)
        took = time.perf_counter() - start
        work.wait()
        sync()
        return took

    issue()
    issue_s = min(issue() for _ in range(REPEATS))
    if device.type != "cpu":
        return issue_s
    target = max(LOADED_MIN_S, LOADED_PER_COLLECTIVE * small_allreduce_s)
    small = torch.zeros(256)  # 1 KB: a collective's cost here, not its bytes
    lost = _compute_lost(group, sync, _LOADED_N, 1, target, small, LOADED_COLLECTIVES, REPEATS)
    return max(issue_s, lost / LOADED_COLLECTIVES)


def _loaded_block(
    group: Any, sync: Callable[[], None], n: int, seed: int, target_s: float, tensor: torch.Tensor, issues: int,
) -> Callable[[bool], None]:
    """A block of ``n x n`` matmuls at least ``target_s`` long; ``block(True)`` issues ``issues``
    asynchronous all-reduces of ``tensor`` into it, one at the start of each equal part, and waits
    for them at its end. Its operand comes from a private generator, as in :func:`_compute_times`."""
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    block_s = fastest_seconds(lambda: a @ a, sync, COMPUTE_REPEATS)
    part = max(1, math.ceil(target_s / max(block_s, 1e-7) / issues))

    def block(loaded: bool) -> None:
        works = []
        for _ in range(issues):
            if loaded:
                works.append(dist.all_reduce(tensor, group=group, async_op=True))
            for _ in range(part):
                a @ a
        for work in works:
            work.wait()

    return block


def _compute_lost(
    group: Any, sync: Callable[[], None], n: int, seed: int, target_s: float, tensor: torch.Tensor, issues: int, repeats: int,
) -> float:
    """What a :func:`_loaded_block`, run by every rank from a barrier, loses when loaded: the
    fastest of ``repeats`` loaded less the fastest alone."""
    block = _loaded_block(group, sync, n, seed, target_s, tensor, issues)

    def barrier() -> None:
        dist.barrier(group=group)

    alone = fastest_seconds(lambda: block(False), sync, repeats, barrier)
    return fastest_seconds(lambda: block(True), sync, repeats, barrier) - alone


HOST_SHARE_STEP = 0.05  # the host share's granularity: a rerun's noise rarely moves it a step
HOST_SHARE_PAIRS = 9  # blocks alone and loaded, interleaved
_SHARE_N = 256  # matmuls past the cache's size, as a model's are: a collective's copies slow them too


def _host_share(group: Any, sync: Callable[[], None], allreduce_s: float) -> float:
    """The share of a collective's link time its rank's compute loses on the CPU
    (``CostModel.collective_host_share``): a block of matmuls half again as long as the largest
    all-reduce (``allreduce_s``), run alone and loaded with it by turns, each from a barrier; the
    median of what each pair's loaded block took longer, over the all-reduce's time, averaged over
    ranks, in steps of ``HOST_SHARE_STEP`` (``collective_overhead_us`` is in it too: microseconds).

    Pairs and a median: where ranks share cores, one block's time moves with the scheduling of the
    others, so the difference of two separate fastest times, or its largest over ranks, measures
    that noise; each rank pays the share on average, so the mean over ranks is the figure."""
    block = _loaded_block(group, sync, _SHARE_N, 2, 1.5 * allreduce_s, torch.zeros(SIZES[-1] // 4), 1)
    block(False)
    block(True)
    sync()
    lost = []
    for _ in range(HOST_SHARE_PAIRS):
        took = []
        for loaded in (False, True):
            dist.barrier(group=group)
            start = time.perf_counter()
            block(loaded)
            sync()
            took.append(time.perf_counter() - start)
        lost.append(took[1] - took[0])
    shares = gather(statistics.median(lost) / allreduce_s, group)
    share = max(0.0, sum(shares) / len(shares))
    return round(round(share / HOST_SHARE_STEP) * HOST_SHARE_STEP, 2)


def _collective_seconds(nbytes: int, group: Any, device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    """A blocking all-reduce's time and its spread (median minus fastest, what tells a figure from
    noise): each repeat starts from a barrier and takes the slowest rank's time, since a rank that
    arrives late finds its peers' data sent and returns early."""
    buf = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(buf, group=group)  # warm-up: first-call allocation and connection setup
    sync()
    samples = []
    for _ in range(REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync()
        samples.append(time.perf_counter() - start)
    slowest = sorted(max_over_ranks(samples, group, torch.float64))
    return slowest[0], slowest[len(slowest) // 2] - slowest[0]


def _round2(x: float) -> float:
    """Two significant figures (0 stays 0, inf stays inf)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, 1 - int(math.floor(math.log10(abs(x)))))
