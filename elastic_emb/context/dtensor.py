"""The context's rows as DTensors, for ``torch.distributed.checkpoint``.

DTensor and DCP work only with process groups registered in ``torch.distributed``'s global
state, which the context's private group is not; so the state dict uses the *default* group,
which must be initialized with the same rank and world size as the context (torchrun's
``init_process_group()`` gives exactly that). The mesh covers the owner ranks
``0..ep_size-1`` only, because DTensor ``Shard(0)`` over that mesh is exactly the row layout of
:mod:`elastic_emb.sharding`; ranks >= ep_size are outside it and hold empty local tensors. The
local tensors are views of the arena, so a ``state_dict()`` costs no copy and DCP ``load`` into
it writes the arena; a checkpoint saved at one world size loads at another.
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
        """A DeviceMesh over the owner ranks of the default process group; raises
        ``RuntimeError`` when that group is missing or does not match ``topology``."""
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
    """``{"<table>.weight": DTensor, "<table>.<slot>": DTensor}``, ``Shard(0)`` over ``mesh``,
    local tensors the arena's own."""
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
    """Copy the local shards of ``state`` (as :func:`state_dict` gives, possibly loaded by DCP)
    into the arena. Raises ``KeyError`` for a missing key, ``ValueError`` for a wrong shape."""
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
