"""PowerSGD inside the compiled backward: DDP's ``powerSGD_hook``, traced per bucket.

The algorithm is torch's (``ddp_comm_hooks/powerSGD_hook.py``, Vogels et al. 2019) step for step,
so a run equals DDP + ``powerSGD_hook`` with the same settings (the tests compare them): a plain
all-reduce for the first ``start_powerSGD_iter`` steps (the ``"allreduce"`` phase, a graph variant
of its own); then per bucket the error feedback added, matrices worth compressing grouped by
shape (the rest all-reduced as they are), ``P = M Q`` all-reduced and orthogonalised,
``Q = M^T P`` all-reduced, the average approximated by ``P Q^T``.

Random numbers never enter the graph (every rank would draw its own): :meth:`PowerSGD.before_step`
fills a bucket's Q eagerly with the values DDP draws, from generators of the hook's own (DDP's
reseeds the user's global ones). The ``"q"`` and ``"error"`` state tensors are graph inputs written
in place; the step count advances at the end of each synchronising backward, as DDP's
``bucket.is_last()`` does. Q's all-reduce and the uncompressed one are the hook's last stage and
overlap the backward; P's completes at the issue point. DDP requires ``start_powerSGD_iter > 1``
because its buckets are rebuilt after the first step; graphddp's are fixed at compile time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol

from graphddp.hooks.traced import GradBucket, HookState, TracedHook
from graphddp.values.schedule import Bucket, GradSlot

PHASES = ("allreduce", "powersgd")


@dataclasses.dataclass(frozen=True)
class _Group:
    """One batch of matrices compressed together: slot positions in the bucket, one shape."""

    slots: tuple[int, ...]
    rows: int
    cols: int
    rank: int

    @property
    def p_numel(self) -> int:
        return len(self.slots) * self.rows * self.rank

    @property
    def q_numel(self) -> int:
        return len(self.slots) * self.cols * self.rank


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one bucket is compressed: batches of matrices (in DDP's order) and the rest."""

    groups: tuple[_Group, ...]
    uncompressed: tuple[int, ...]  # slot positions sent as they are

    @property
    def q_numel(self) -> int:
        return sum(g.q_numel for g in self.groups)


def _matrix_shape(slot: GradSlot) -> tuple[int, int] | None:
    if not slot.shape:  # a 0-d tensor: DDP's hook cannot view it as a matrix; sent as it is
        return None
    return slot.shape[0], slot.numel // slot.shape[0] if slot.shape[0] else 0


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    """DDP's ``_orthogonalize``, functional: Gram-Schmidt up to rank 2 or in half precision,
    QR above."""
    rank = matrices.shape[2]
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(matrices).Q
    cols = [matrices[:, :, i:i + 1] for i in range(rank)]
    for i in range(rank):
        norm = torch.norm(cols[i], dim=1, keepdim=True)
        col = cols[i] / (norm + epsilon if epsilon else norm)
        cols[i] = col
        for j in range(i + 1, rank):
            cols[j] = cols[j] - torch.sum(col * cols[j], dim=1, keepdim=True) * col
    return cols[0] if rank == 1 else torch.cat(cols, dim=2)


class PowerSGD(TracedHook):
    """``comm_hook=graphddp.hooks.PowerSGD(...)``, with the settings of DDP's ``PowerSGDState``
    (the group is graphddp's). ``iter`` counts synchronising steps, as DDP's does."""

    phases = PHASES

    def __init__(
        self,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,  # noqa: N803 - DDP's name
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        import numpy as np

        least_of = (("matrix_approximation_rank", matrix_approximation_rank, 1), ("start_powerSGD_iter", start_powerSGD_iter, 0))
        for name, value, least in least_of:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PowerSGD: {name} must be an int >= {least}, got {value!r}")
        if not min_compression_rate >= 0:
            raise ValueError(f"PowerSGD: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        super().__init__(None, lambda state, bucket: self.compress(bucket), name="PowerSGD")
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)
        self.iter = 0
        self._has_q: set[tuple[int, int]] = set()  # (graph, bucket) whose Q holds last step's

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.matrix_approximation_rank}, start_powerSGD_iter={self.start_powerSGD_iter}, "
            f"error_feedback={self.use_error_feedback}, warm_start={self.warm_start})"
        )

    # -- the plan of one bucket, shared by the traced hook and the eager Q draw -----------------
    def layout(self, bucket: Bucket) -> _Layout:
        """DDP's split: compressed matrices grouped by shape (first appearance first), the rest."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        uncompressed = []
        for i, slot in enumerate(bucket.slots):
            shape = _matrix_shape(slot)
            if shape is None:
                uncompressed.append(i)
                continue
            n, m = shape
            rank = min(n, m, self.matrix_approximation_rank)
            if (n + m) * rank * self.min_compression_rate < n * m:
                by_shape.setdefault(shape, []).append(i)
            else:
                uncompressed.append(i)
        groups = []
        for (n, m), slots in by_shape.items():
            rank = min(n, m, self.matrix_approximation_rank)
            batches = [tuple(slots)] if self.batch_tensors_with_same_shape else [(s,) for s in slots]
            groups.extend(_Group(b, n, m, rank) for b in batches)
        return _Layout(tuple(groups), tuple(uncompressed))

    # -- traced, per bucket ---------------------------------------------------------------------
    def compress(self, bucket: GradBucket) -> torch.Tensor:
        """The compressed average of one bucket."""
        layout = self.layout(bucket.plan)
        flat = bucket.buffer()
        if self.use_error_feedback:
            error = bucket.state_tensor("error", [flat.numel()])
            flat = flat + error
        q_state = bucket.state_tensor("q", [layout.q_numel])
        grads = [flat[off:off + s.numel] for s, off in zip(bucket.plan.slots, bucket.plan.offsets())]
        group = bucket.group
        uncompressed = [grads[i] for i in layout.uncompressed]
        sent_as_is = funcol.all_reduce(torch.cat(uncompressed), "sum", group) if uncompressed else None
        matrices, qs, q_at = [], [], 0
        for g in layout.groups:
            matrices.append(torch.stack([grads[i].view(g.rows, g.cols) for i in g.slots]))
            q = q_state[q_at:q_at + g.q_numel].view(len(g.slots), g.cols, g.rank)
            qs.append(_orthogonalize(q, self.orthogonalization_epsilon))
            q_at += g.q_numel
        approx: list[torch.Tensor] = []
        if layout.groups:
            ps = [torch.bmm(m, q) for m, q in zip(matrices, qs)]
            p_sum = funcol.all_reduce(torch.cat([p.reshape(-1) for p in ps]), "sum", group)
            ps, p_at = [], 0
            for g in layout.groups:
                ps.append(_orthogonalize(p_sum[p_at:p_at + g.p_numel].view(len(g.slots), g.rows, g.rank), self.orthogonalization_epsilon))
                p_at += g.p_numel
            qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(matrices, ps)]
            q_avg = funcol.all_reduce(torch.cat([q.reshape(-1) for q in qs]), "sum", group) / bucket.world_size
            q_state.copy_(q_avg)
            q_at = 0
            for g, p in zip(layout.groups, ps):
                q = q_avg[q_at:q_at + g.q_numel].view(len(g.slots), g.cols, g.rank)
                approx.append(torch.bmm(p, q.transpose(1, 2)))
                q_at += g.q_numel
        pieces: list[torch.Tensor | None] = [None] * len(grads)
        if sent_as_is is not None:
            averaged, at = sent_as_is / bucket.world_size, 0
            for i in layout.uncompressed:
                pieces[i] = averaged[at:at + grads[i].numel()]
                at += grads[i].numel()
        for g, batch in zip(layout.groups, approx):
            for j, i in enumerate(g.slots):
                pieces[i] = batch[j].reshape(-1)
        out = torch.cat(pieces)  # type: ignore[arg-type]
        if self.use_error_feedback:
            error.copy_(flat - out)
        return out

    # -- eager, around steps --------------------------------------------------------------------
    def phase(self) -> str:
        return "allreduce" if self.iter < self.start_powerSGD_iter else "powersgd"

    def before_step(self, states: HookState, graph_index: int, schedule: Any) -> None:
        """Draw Q for the buckets that need fresh values, as DDP does."""
        if self.phase() != "powersgd":
            return
        for bucket in schedule.buckets:
            key = states.owner(graph_index, bucket.index)  # a recompile's bucket shares its state
            if self.warm_start and key in self._has_q:
                continue
            layout = self.layout(bucket)
            dtype = getattr(torch, bucket.dtype)
            q_state = states.tensors[states.key(graph_index, bucket.index, "q")]
            # DDP seeds torch's CPU generator inside fork_rng(devices=[]); torch.manual_seed
            # reseeds every CUDA generator too, which that fork does not restore. A private CPU
            # generator with the same seed draws the same values and leaves the user's alone.
            generator = torch.Generator().manual_seed(self.rng.randint(1_000_000_000))
            at = 0
            for g in layout.groups:
                q = torch.randn(len(g.slots), g.cols, g.rank, device="cpu", dtype=dtype, generator=generator)
                q_state[at:at + g.q_numel].copy_(q.reshape(-1))
                at += g.q_numel
            self._has_q.add(key)

    def after_backward(self) -> None:
        self.iter += 1
        if not self.warm_start:
            self._has_q.clear()

    def extra_state(self) -> dict[str, Any]:
        return {"iter": self.iter, "rng": self.rng.get_state(), "has_q": sorted(self._has_q)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "iter" in state:
            self.iter = int(state["iter"])
        if "rng" in state:
            self.rng.set_state(state["rng"])
        if "has_q" in state:
            self._has_q = {tuple(k) for k in state["has_q"]}  # type: ignore[misc]


def wire_numel(hook: PowerSGD, buckets: Sequence[Bucket]) -> int:
    """Elements PowerSGD sends per rank and step for ``buckets`` (for people and tests)."""
    total = 0
    for b in buckets:
        layout = hook.layout(b)
        total += sum(b.slots[i].numel for i in layout.uncompressed)
        total += sum(g.p_numel + g.q_numel for g in layout.groups)
    return total
