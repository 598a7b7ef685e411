"""A divergent step: ranks whose graphs produced different gradients average their union.

A graph's compiled buckets pair with the same buckets on every other rank only while ranks run the
same graphs: LayerDrop (BART's ``encoder_layerdrop``), a head per task, one more graph on one rank,
or a joined rank that runs nothing break it, and the step's agreement makes the step divergent on
every rank at once. At the end of the backward, like DDP with ``find_unused_parameters=True``,
every rank gathers what every rank produced. Where every rank still training ran the same buckets,
those are averaged, through the traced hook with its state (a joined rank shadows them with zeros,
as DDP's join hook does); otherwise the union of the parameters, in production order, is averaged
in buckets of at most ``bucket_cap_mb``, zeros where a rank had no gradient (a traced hook is
refused by name: its buckets and state would differ between ranks). Gradients eager code produced
are part of the union. A parameter used nowhere keeps its ``grad`` as it was. Cost: this
communication does not overlap the backward; the static case pays none of it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from graphddp.runtime.agree import ScheduleMismatchError, any_rank, gather
from graphddp.runtime.sync import flat_views
from graphddp.values.schedule import Bucket, Schedule


@dataclasses.dataclass(frozen=True)
class Produced:
    """What one rank hands to the union: small and picklable (it is gathered)."""

    joined: bool
    buckets: tuple[tuple, ...]  # Bucket.wire() of the buckets of the graphs it ran, in order
    used: tuple[str, ...]  # parameters it got a gradient for from a used output
    options: tuple  # what its options put on the wire: the compression dtype, the hook, the bucket cap
    eager: tuple[tuple[str, tuple[int, ...]], ...] = ()  # parameters eager code gave a gradient


def union_order(produced: Sequence[Produced]) -> tuple[bool, list[tuple]]:
    """``(same, buckets)``: the buckets every rank still training ran, when they all ran the same
    ones; else the union of their parameters as ``(name, shape)``, in production order."""
    active = [p for p in produced if not p.joined]
    layouts = {p.buckets for p in active}
    if len(layouts) == 1 and active[0].buckets and not any(p.eager for p in active):
        return True, list(active[0].buckets)
    seen: dict[str, tuple] = {}
    for p in active:
        for bucket in p.buckets:
            for name, shape in bucket[5]:
                seen.setdefault(name, (name, shape))
    for p in active:
        for name, shape in p.eager:
            seen.setdefault(name, (name, shape))
    return False, list(seen.values())


def split(names: Sequence[str], params: Mapping[str, nn.Parameter], cap_bytes: float) -> list[list[str]]:
    """``names`` in buckets of one dtype and device, each at most ``cap_bytes`` (one parameter
    larger than the cap is a bucket of its own), in order."""
    buckets: list[list[str]] = []
    open_: dict[tuple, tuple[list[str], int]] = {}
    for name in names:
        p = params[name]
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        members, size = open_.get(key, ([], 0))
        if members and size + nbytes > cap_bytes:
            members, size = [], 0
        if not members:
            buckets.append(members)
        members.append(name)
        open_[key] = (members, size + nbytes)
    return buckets


class UnionAverage:
    """The end of a divergent step (module docstring), for one model replica."""

    def __init__(
        self, group: Any, params: Mapping[str, nn.Parameter], cap_bytes: float, comm_dtype: str | None,
        hook: Any = None, hook_state: Any = None, hook_context: Any = None,
        schedules: Any = lambda: [],
    ) -> None:
        self.group = group
        self.params = params
        self.cap_bytes = cap_bytes
        self.comm_dtype = comm_dtype
        self.hook = hook
        self.hook_state = hook_state
        self.hook_context = hook_context
        self.schedules = schedules  # every compiled graph's schedule of the phase in use
        self.divide_by_initial_world_size = True  # join(divide_by_initial_world_size=...)
        self.steps = 0  # divergent steps averaged here without a joined rank

    def _check_options(self, everyone: Sequence[Produced]) -> None:
        """Ranks whose options differ would put different dtypes or hooks on the wire."""
        other = next((r for r, p in enumerate(everyone) if p.options != everyone[0].options), None)
        if other is not None:
            raise ScheduleMismatchError(
                f"graphddp: ranks run with different options: rank 0 has (wire dtype, comm_hook, bucket cap in bytes) "
                f"{everyone[0].options}, rank {other} has {everyone[other].options}; compile the model with the same "
                "options on every rank"
            )

    def run(self, step: Any, hook_now: bool) -> None:
        """Average what ``step`` holds (nothing on a joined rank) with every other rank."""
        eager = self._take_eager(step)
        mine = Produced(
            step.joined, tuple(b.wire() for s in step.local_schedules for b in s.buckets),
            tuple(sorted(step.local_used)), (self.comm_dtype, getattr(self.hook, "name", None), self.cap_bytes),
            tuple((n, tuple(self.params[n].shape)) for n in eager),
        )
        everyone = gather(mine, self.group)
        self._check_options(everyone)
        if not any(p.joined for p in everyone):
            self.steps += 1
            if self.steps == 1:
                warnings.warn(
                    "graphddp: ranks ran different backward graphs in one step (their control flow used different "
                    "parameters, or one ran more graphs); that step is averaged over the union of their gradients at "
                    "the end of the backward, as DDP with find_unused_parameters=True averages, without overlap. "
                    "graphddp.runtime.union says what it costs.",
                    stacklevel=2,
                )
        world = dist.get_world_size(self.group)
        active = sum(not p.joined for p in everyone)
        # DDP's reducer divides by the ranks still training only on its default path; a comm
        # hook (fp16/bf16 compression included) divides by the world size itself.
        initial = self.divide_by_initial_world_size or self.comm_dtype is not None
        divisor = world if initial else max(active, 1)
        used = {n for p in everyone for n in p.used}
        same, order = union_order(everyone)
        if self.hook is not None and hook_now:
            self._through_hook(step, same, order, used)
            return
        names = [b for bucket in order for b, _ in bucket[5]] if same else [n for n, _ in order]
        for members in split(names, self.params, self.cap_bytes):
            done = self._all_reduce(self._flat(step, members), divisor)
            if not step.joined:
                self._write(members, done, used)

    @torch.no_grad()
    def _take_eager(self, step: Any) -> list[str]:
        """Gradients eager code added this step join this rank's local gradients, and each
        ``grad`` goes back to what it was before the backward (the average is added to it)."""
        taken = []
        for name, before in step.eager.items():
            p = self.params[name]
            if p.grad is None:
                continue
            added = p.grad if before is None else p.grad - before
            p.grad = before
            held = step.local_grads.get(name)
            step.local_grads[name] = added if held is None else held + added
            step.local_used.add(name)
            taken.append(name)
        return taken

    def _flat(self, step: Any, names: Sequence[str]) -> torch.Tensor:
        parts = []
        for name in names:
            p = self.params[name]
            g = step.local_grads.get(name)
            parts.append((g if g is not None else torch.zeros_like(p)).reshape(-1))
        return torch.cat(parts)

    @torch.no_grad()
    def _all_reduce(self, flat: torch.Tensor, divisor: int) -> torch.Tensor:
        """DDP's default hook (or its fp16/bf16 compression): compress, divide, sum, decompress."""
        sent = flat.to(getattr(torch, self.comm_dtype)) if self.comm_dtype else flat
        sent.div_(divisor)
        dist.all_reduce(sent, group=self.group)
        return sent.to(flat.dtype)

    @torch.no_grad()
    def _write(self, names: Sequence[str], done: torch.Tensor, used: set[str]) -> None:
        for name, (p, piece) in zip(names, flat_views(done, [self.params[n] for n in names])):
            if name not in used:
                continue
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.add_(piece)

    def _through_hook(self, step: Any, same: bool, order: list[tuple], used: set[str]) -> None:
        """Every rank ran the same buckets: each goes through the traced hook with its state."""
        from graphddp.graph.bucket_function import hook_bucket_eagerly

        name = self.hook.name
        found = self._find(step, order) if same else None  # not same: some rank has eager gradients, or other buckets
        missing = any_rank([found is None], self.group)[0]
        if missing:
            why = (
                "ranks ran different buckets in this step (their control flow used different parameters), or eager "
                "code outside the compiled graphs produced gradients" if not same
                else "a joined rank never compiled a graph the others run now"
            )
            raise RuntimeError(
                f"graphddp: comm_hook {name!r}: {why}; a traced hook needs the same buckets, with their state, on every "
                "rank, so this step cannot be averaged through it. Use a built-in comm_hook (fp16_compress, bf16_compress) "
                "or none for such a model."
            )
        assert found is not None
        for schedule in dict.fromkeys(s for s, _ in found):
            self.hook.before_step(self.hook_state, schedule.graph_index, schedule)
        for schedule, bucket in found:
            done = hook_bucket_eagerly(
                self.hook, schedule, bucket, self._flat(step, bucket.param_names), self.hook_context, self.hook_state
            )
            if not step.joined:
                self._write([s.param_name for s in bucket.slots], done, used)

    def _find(self, step: Any, order: list[tuple]) -> list[tuple[Schedule, Bucket]] | None:
        """This rank's (schedule, bucket) for each bucket of ``order``: the graphs it ran in
        this step first, then any it compiled (a joined rank's)."""
        by_wire: dict[tuple, tuple[Schedule, Bucket]] = {}
        for schedule in list(self.schedules()) + list(step.local_schedules):
            for bucket in schedule.buckets:
                by_wire[bucket.wire()] = (schedule, bucket)
        found = [by_wire.get(key) for key in order]
        return None if any(f is None for f in found) else found  # type: ignore[return-value]
