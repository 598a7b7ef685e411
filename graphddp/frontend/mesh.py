"""``device_mesh=``: the process groups a sharded mode runs on, read from a ``DeviceMesh``.

FSDP2's convention: a 1-D mesh is one group; a 2-D mesh is hybrid sharding, dim 0 replicating and
dim 1 sharding: parts are cut over the shard group and averaged over the replicate group too
(:class:`graphddp.values.placement.Placement`). What concerns the whole job (the broadcast, the
step's agreement, the buffers) runs on the group of every rank of the mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from graphddp.values.comm import group_name_of
from graphddp.values.placement import Level, Placement


@dataclasses.dataclass(frozen=True)
class MeshGroups:
    """The groups of one wrap: every rank, the shard group, the replicate group (None: flat)."""

    whole: Any
    shard: Any
    replicate: Any = None

    @property
    def placement(self) -> Placement:
        level = lambda g: Level(group_name_of(g), dist.get_world_size(g))  # noqa: E731
        return Placement(level(self.shard), level(self.replicate) if self.replicate is not None else None)


def flat_groups(group: Any) -> MeshGroups:
    return MeshGroups(group, group)


def resolve_mesh(where: str, device_mesh: Any, process_group: Any, sharding: str | None) -> MeshGroups:
    """The groups ``device_mesh`` names; without one, ``process_group`` (or WORLD) alone. A mesh of
    another rank count than the default group's is refused: its whole group would be a new group
    every rank must make."""
    if device_mesh is None:
        return flat_groups(process_group if process_group is not None else dist.group.WORLD)
    if process_group is not None:
        raise ValueError(f"{where}: pass device_mesh= or process_group=, not both (a 1-D mesh is one process group)")
    ndim = getattr(device_mesh, "ndim", None)
    if ndim == 1:
        return flat_groups(device_mesh.get_group())
    if ndim != 2:
        raise ValueError(
            f"{where}: device_mesh= must be a torch.distributed.device_mesh.DeviceMesh of 1 or 2 dims "
            f"(('replicate', 'shard') for hybrid sharding), got {type(device_mesh).__name__} with ndim={ndim}"
        )
    if sharding not in ("optimizer", "full", "auto"):
        raise ValueError(
            f"{where}: a 2-D device_mesh= is hybrid sharding: it needs sharding='optimizer', 'full' or 'auto' "
            f"(got sharding={sharding!r}); for replicated training over every rank pass a 1-D mesh or process_group="
        )
    if device_mesh.size() != dist.get_world_size():
        raise ValueError(
            f"{where}: device_mesh= spans {device_mesh.size()} ranks and the default process group "
            f"{dist.get_world_size()}; a hybrid mesh must span every rank"
        )
    return MeshGroups(dist.group.WORLD, device_mesh.get_group(1), device_mesh.get_group(0))
