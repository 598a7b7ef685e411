"""Uneven inputs: ``model.join()``, DDP's context manager for ranks that run out of batches.

Without it, a rank whose data ends first leaves the others waiting in their next collective
forever. With it (``torch.distributed.algorithms.Join``, the model a ``Joinable``, so it composes
with ``ZeroRedundancyOptimizer``), a joined rank shadows every collective the others still run,
with zeros, in their order: ``Join.notify_join_context``; one maximum over ranks of what the step
does (:class:`JoinState`); the buffer broadcast and the average after ``no_sync`` when they run;
in a synchronising backward the agreement, where a joined rank makes the step divergent, and the
union average with its zeros. After everyone joined, every rank takes the model of the last rank
to join, as DDP.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from graphddp.runtime.agree import max_over_ranks
from graphddp.runtime.sync import average_async, broadcast_tensors

Replica = Any  # graphddp.frontend.replica.Replica, which imports this module

class JoinState:
    """One forward's state as every rank reads it after the maximum over ranks: four flags (sync,
    buffers, pending average, eager hook), then one per rank: still training."""

    def __init__(self, values: list[int], world: int) -> None:
        self.sync, self.buffers, self.pending, self.eager_hook = (bool(v) for v in values[:4])
        self.active = [r for r in range(world) if values[4 + r]]

    @classmethod
    def exchange(cls, replica: "Replica", flags: tuple[bool, bool, bool, bool], active: bool) -> "JoinState":
        group = replica.group
        world = dist.get_world_size(group)
        values = [int(f) for f in flags] + [0] * world
        if active:
            values[4 + dist.get_rank(group)] = 1
        state = cls(max_over_ranks(values, group), world)
        if state.eager_hook:
            raise RuntimeError(
                f"graphddp: join(): a rank joined while the others average gradients accumulated under no_sync through "
                f"comm_hook {replica.config.traced_hook.name!r}, which a joined rank cannot shadow; synchronise every "
                "step inside the join context, or use a built-in comm_hook"
            )
        return state

    @property
    def buffer_source(self) -> int:
        """The rank buffers come from: the highest still training (DDP's choice)."""
        return max(self.active) if self.active else 0


class ReplicaJoinHook(JoinHook):
    """What a joined rank runs for each step of the others, and once all have joined."""

    def __init__(self, replica: "Replica") -> None:
        self.replica = replica

    def main_hook(self) -> None:
        replica = self.replica
        state = JoinState.exchange(replica, (False, False, False, False), active=False)
        if state.buffers:
            broadcast_tensors(list(replica.module.buffers()), replica.group, state.buffer_source)
        if state.pending:
            trainable = [(n, p) for n, p in replica.module.named_parameters() if p.requires_grad]
            average_async(trainable, replica.group, shadow=True).wait()
        if state.sync:
            replica.backend.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (the highest, on a tie)."""
        replica = self.replica
        group = replica.group
        (source,) = max_over_ranks([dist.get_rank(group) if is_last_joiner else -1], group)
        tensors = [p.detach() for p in replica.module.parameters()]
        if replica.config.broadcast_buffers:
            tensors += list(replica.module.buffers())
        broadcast_tensors(tensors, group, source)


def join(view: Any, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
    """DDP's ``model.join(...)`` for a graphddp model ``view``; ``divide_by_initial_world_size=False``
    divides by the ranks still training."""
    return Join(
        [view], enable=enable, throw_on_early_termination=throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )


def join_hook(replica: "Replica", **kwargs: Any) -> ReplicaJoinHook:
    """The ``Joinable`` hook, where ``divide_by_initial_world_size`` reaches every rank."""
    replica.backend.union.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
    return ReplicaJoinHook(replica)
