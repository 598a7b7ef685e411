"""Uneven inputs: ``model.join()``, DDP's context manager for ranks that run out of batches.

Without it, a rank whose data ends first leaves the others waiting in their next collective
forever. With it (``torch.distributed.algorithms.Join`` and a graphddp model as a
``Joinable``, so it composes with ``ZeroRedundancyOptimizer`` and other joinables), a rank
that has no more batches *shadows* every collective the others still run, with zeros, until
all are done; then every rank takes the model of the last rank to finish.

What a rank still training runs per forward, and its joined peer shadows (:meth:`JoinState`):

1. ``Join.notify_join_context`` (the context manager's own all-reduce, which tells the joined
   ranks to keep shadowing and, with ``throw_on_early_termination``, raises on every rank);
2. one maximum over ranks (``max_over_ranks``) of what the coming step does: whether its backward synchronises, whether
   buffers are broadcast now, whether gradients accumulated under ``no_sync`` are averaged
   now, and which ranks are still training (buffers come from the highest of them, as DDP's);
3. the buffer broadcast and the average of accumulated gradients, when they run;
4. in a synchronising backward: the step's agreement, where a joined rank asks for a divergent
   step, and the union average at its end (:mod:`graphddp.runtime.union`), with zeros from the joined
   rank, through the traced comm hook's buckets and state when there is one, as DDP's join hook
   runs the hook on zero buckets. The step's graphs run locally meanwhile: a step with a
   joined rank does not overlap its communication.

``divide_by_initial_world_size`` (default True, DDP's) divides by the world size; False by the
number of ranks still training. After everyone joined, the parameters (and buffers, with
``broadcast_buffers``) are broadcast from the last rank to join, as DDP does; with
``optimizer=`` the joined ranks' optimizer states stay as they were when they joined.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from graphddp.runtime.agree import max_over_ranks
from graphddp.runtime.sync import average_async, broadcast_tensors

Replica = Any  # graphddp.frontend.replica.Replica, which imports this module

class JoinState:
    """One forward's state as every rank reads it after the maximum over ranks: the four flags
    of the module docstring's 2. (sync, buffers, pending, eager hook), then one per rank: still
    training."""

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
    """DDP's ``model.join(...)`` for a graphddp model ``view`` (module docstring)."""
    return Join(
        [view], enable=enable, throw_on_early_termination=throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )


def join_hook(replica: "Replica", **kwargs: Any) -> ReplicaJoinHook:
    """The ``Joinable`` hook; ``divide_by_initial_world_size`` reaches every rank here (the
    context manager asks every rank's joinables for their hooks)."""
    replica.backend.union.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
    return ReplicaJoinHook(replica)
