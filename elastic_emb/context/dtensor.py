"""The context's rows as DTensors, for ``torch.distributed.checkpoint``.

:func:`state_dict` gives each table's weight and slots as ``Shard(0)`` DTensors over the owner
ranks of the *default* process group (views of the arena, no copy); :func:`load_state_dict`
copies such a state back; :class:`MeshCache` keeps the DeviceMesh. A checkpoint saved at one
world size loads at another.

Design: ``docs/CONTEXT.md`` (section "DTensor view").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from elastic_emb.context.arena import Arena
from elastic_emb.protocol import TableSpec
from elastic_emb.topology import Topology


class MeshCache:
    """The DeviceMesh over the owner ranks, rebuilt when the default group changes."""

    def __init__(self) -> None:
        self._cached: tuple | None = None

    def mesh(self, topology: Topology, device: torch.device):
        """A DeviceMesh over the owner ranks ``0..ep_size-1`` of the default process group.

        Args:
            topology: the context's topology, which the default group must match.
            device: the context's device (its type names the mesh's device type).

        Returns:
            The mesh (cached while the default group stays the same).

        Raises:
            RuntimeError: when the default group is not initialised, or its rank or world size
                differs from ``topology``'s.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "state_dict needs torch.distributed's default process group (DTensor and DCP only use "
                "registered groups): call torch.distributed.init_process_group() with the same rank "
                "and world size first"
            )
        if dist.get_rank() != topology.rank or dist.get_world_size() != topology.world_size:
            raise RuntimeError(
                f"default process group is rank {dist.get_rank()} of {dist.get_world_size()}, but this "
                f"context is rank {topology.rank} of {topology.world_size}; re-initialize it to match"
            )
        if self._cached is not None and self._cached[0] is dist.group.WORLD:
            return self._cached[1]
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device.type, list(range(topology.ep_size)))
        self._cached = (dist.group.WORLD, mesh)
        return mesh


def state_dict(arena: Arena, tables: Mapping[str, TableSpec], mesh) -> dict:
    """The arena's rows and slots as DTensors.

    Args:
        arena: the context's arena.
        tables: every table, by name.
        mesh: the owner ranks' mesh (:meth:`MeshCache.mesh`).

    Returns:
        ``{"<table>.weight": DTensor, "<table>.<slot>": DTensor}``, ``Shard(0)`` over ``mesh``,
        whose local tensors are the arena's own.
    """
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, spec in tables.items():
        parts = {"weight": arena.weights[name], **arena.slots[name]}
        for slot, local in parts.items():
            shape = (spec.num_rows, *local.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            out[f"{name}.{slot}"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
            )
    return out


def load_state_dict(arena: Arena, tables: Mapping[str, TableSpec], state: Mapping[str, object]) -> None:
    """Copy the local shards of ``state`` into the arena.

    Args:
        arena: the context's arena.
        tables: every table, by name.
        state: as :func:`state_dict` gives it, possibly loaded by DCP; values are DTensors or
            plain local tensors.

    Raises:
        KeyError: when a table's weight or slot is missing from ``state``.
        ValueError: when a local tensor's shape differs from the arena's.
    """
    from torch.distributed.tensor import DTensor

    for name in tables:
        for slot, dst in {"weight": arena.weights[name], **arena.slots[name]}.items():
            key = f"{name}.{slot}"
            if key not in state:
                raise KeyError(f"load_state_dict: missing key {key!r}; have {sorted(state)}")
            src = state[key]
            local = src.to_local() if isinstance(src, DTensor) else src
            if dst.numel() == 0:
                continue  # ranks outside the owner mesh hold an empty (shapeless) local tensor
            if tuple(local.shape) != tuple(dst.shape):
                raise ValueError(f"load_state_dict: {key!r} local shape {tuple(local.shape)} != {tuple(dst.shape)}")
            if local.data_ptr() != dst.data_ptr():
                dst.copy_(local)
