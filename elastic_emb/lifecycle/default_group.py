"""The default process group that DCP and DTensor need, one per generation.

``torch.distributed.checkpoint`` and DTensor work on the default (WORLD) process group, which
torch keeps process-wide. The lifecycle needs it only for the durable tier, and a resize changes
its rank and size: so the group is (re)initialized for each generation, on a private prefix of
the generation's store, and destroyed at close. A default group the user created is used as long
as it matches the topology, and never destroyed here; one that does not match is an error, since
replacing it would pull it from under the user's code.
"""

from __future__ import annotations

from datetime import timedelta

from elastic_emb.errors import ElasticEmbError
from elastic_emb.store import generation_store
from elastic_emb.topology import Topology


class DefaultGroup:
    """The default gloo process group of the current generation, made and destroyed here.

    A default group the user created is used while it matches the topology, and never destroyed.
    """

    def __init__(self) -> None:
        self._owned = False  # this object initialized the default group (and destroys it)
        self._generation: int | None = None  # the generation it was initialized for

    def ensure(self, topology: Topology, store, timeout: float):
        """The default group for ``topology``, made when needed.

        Args:
            topology: the current generation's topology.
            store: the generation's store; the group forms on a ``dcp`` prefix of it.
            timeout: seconds for the group's operations.

        Returns:
            ``torch.distributed.group.WORLD``: the user's matching group, this generation's, or a
            new one (the previous generation's is destroyed first).

        Raises:
            ElasticEmbError: a default group created outside elastic_emb does not match the
                topology's rank and world size.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            if not self._owned:
                if dist.get_world_size() == topology.world_size and dist.get_rank() == topology.rank:
                    return dist.group.WORLD
                raise ElasticEmbError(
                    f"the default process group (rank {dist.get_rank()} of {dist.get_world_size()}) was created "
                    f"outside elastic_emb and does not match rank {topology.rank} of {topology.world_size}; "
                    f"destroy it before a resize, or leave durable_dir unset"
                )
            if self._generation == topology.generation:
                return dist.group.WORLD
            dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=generation_store(store, topology, "dcp"),
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=timeout),
        )
        self._owned = True
        self._generation = topology.generation
        return dist.group.WORLD

    def destroy(self) -> None:
        """Destroy the default group if this object made it (a user's own group stays)."""
        if self._owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owned = False
