"""The whole optimizer state of a model compiled with ``optimizer=``, whatever its sharding.

With ``sharding="optimizer"`` each rank's ``opt.state`` holds its parts only
(:mod:`graphddp.optim.shard`); a checkpoint is written from the whole state, so that a plain
``torch.optim`` optimizer of the same class loads it, and a run on another world size resumes
from it. Replicated, the optimizer's own ``state_dict()`` is already whole. With ``sharding="full"`` the
optimizer steps the parts (:mod:`graphddp.frontend.full`) and the model gathers its state.
"""
from __future__ import annotations

from typing import Any, Mapping

from graphddp.frontend.full import FullyShardedGraphDDP
from graphddp.frontend.replica import ReplicaView


def _attached(model: Any, where: str) -> Any:
    replica = getattr(model, "_replica", None) if isinstance(model, ReplicaView) else None
    if replica is None or replica.optimizer is None:
        raise TypeError(f"{where}: expects a model from graphddp.compile(..., optimizer=) or graphddp.backend(..., optimizer=)")
    replica.step.gathers.finish()  # gather="forward": the parameters as the state describes them
    return replica.optimizer


def _fully_sharded(model: Any) -> FullyShardedGraphDDP | None:
    """``model``'s fully sharded state: the module ``graphddp.compile`` returned, or the one a
    ``graphddp.backend`` object holds (its ``sharded``)."""
    if isinstance(model, FullyShardedGraphDDP):
        return model
    inner = getattr(model, "sharded", None)
    return inner if isinstance(inner, FullyShardedGraphDDP) else None


def full_optimizer_state_dict(model: Any) -> dict[str, Any]:
    """The state dict a plain optimizer of the attached one's class would have, on every rank.

    Sharded, every rank takes part (it gathers the parts): call it on all ranks."""
    full = _fully_sharded(model)
    if full is not None:
        return full.full_optimizer_state_dict()
    attached = _attached(model, "graphddp.full_optimizer_state_dict")
    if attached.sharded is None:
        return attached.optimizer.state_dict()
    return attached.sharded.full_state_dict()


def load_full_optimizer_state_dict(model: Any, state: Mapping[str, Any]) -> None:
    """Load a whole optimizer state (from :func:`full_optimizer_state_dict` on any world size, or
    from a plain optimizer's ``state_dict()``); sharded, each rank keeps its parts."""
    full = _fully_sharded(model)
    if full is not None:
        return full.load_full_optimizer_state_dict(state)
    attached = _attached(model, "graphddp.load_full_optimizer_state_dict")
    if attached.sharded is None:
        attached.optimizer.load_state_dict(state)
    else:
        attached.sharded.load_full(state)
