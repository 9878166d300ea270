"""Which samples each rank reads next, from one global cursor that survives every resize.

The job reads one global order of its samples per epoch: a permutation drawn from ``(seed,
epoch)``, or ``0 .. n - 1`` without shuffling. A step of a world of ``W`` ranks reads the next
``W * batch_size`` positions of that order, rank ``r`` the ``batch_size`` positions from
``cursor + r * batch_size``. The cursor (positions read since the start of the job) is the whole
state: committed with each step, it tells a world of any size where to go on, so over any
sequence of resizes every sample of an epoch is read exactly once in the committed history
(a step that was not committed is read again by the world that redoes it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch

# What state_dict holds: the cursor, and what fixes the order it counts in.
_STATE_KEYS = ("cursor", "num_samples", "batch_size", "seed", "shuffle")


class ElasticSampler:
    """The global sample order of a job and its cursor.

    Args:
        num_samples: samples in one epoch (a map-style dataset's ``len``); at least 1.
        batch_size: samples each rank reads per step; at least 1.
        seed: draws each epoch's order (the same on every rank).
        shuffle: a new random order each epoch; False: ``0 .. num_samples - 1`` every epoch.

    Raises:
        ValueError: ``num_samples`` or ``batch_size`` is below 1, or ``seed`` is negative.
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        for name, value, least in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.cursor = 0  # positions of the global order read by the committed steps
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> its order (the two newest kept)

    @property
    def epoch(self) -> int:
        """The epoch the cursor is in."""
        return self.cursor // self.num_samples

    def indices(self, rank: int, world_size: int, *, steps_ahead: int = 0) -> torch.Tensor:
        """The sample indices ``rank`` reads at a step of a world of ``world_size`` ranks.

        Args:
            rank: the reader's rank in ``[0, world_size)``.
            world_size: the ranks of the world taking the step.
            steps_ahead: 0: the step at the cursor; k: the k-th step after it at this world size
                (a loader's prefetch), without moving the cursor.

        Returns:
            ``batch_size`` indices (int64); a step that crosses an epoch's end reads the last
            positions of one epoch and the first of the next.

        Raises:
            ValueError: ``world_size`` below 1, ``rank`` outside ``[0, world_size)`` or
                ``steps_ahead`` negative.
        """
        _check_world(rank, world_size)
        if steps_ahead < 0:
            raise ValueError(f"steps_ahead={steps_ahead} must be >= 0")
        return self._at(self.cursor, rank, world_size, steps_ahead)

    def _at(self, cursor: int, rank: int, world_size: int, steps_ahead: int) -> torch.Tensor:
        start = cursor + (steps_ahead * world_size + rank) * self.batch_size
        positions = torch.arange(start, start + self.batch_size, dtype=torch.int64)
        epochs = positions // self.num_samples
        offsets = positions % self.num_samples
        out = torch.empty_like(positions)
        for e in torch.unique(epochs).tolist():
            at = epochs == e
            out[at] = self._order(int(e))[offsets[at]]
        return out

    def batches(self, rank: int, world_size: int) -> Iterator[list[int]]:
        """The indices of this rank's steps from the cursor of now on, step after step, at a fixed
        world size: a ``batch_sampler`` for a ``DataLoader``. Iterating does not move the cursor,
        and :meth:`advance` does not move the iterator: advance once per step taken, and make a
        new iterator after a restore or a resize.

        Args:
            rank: the reader's rank.
            world_size: the ranks of the world.

        Returns:
            An endless iterator of index lists; make a new one after a resize.

        Raises:
            ValueError: as :meth:`indices`.
        """
        _check_world(rank, world_size)
        return self._batches_from(self.cursor, rank, world_size)

    def _batches_from(self, cursor: int, rank: int, world_size: int) -> Iterator[list[int]]:
        k = 0
        while True:
            yield self._at(cursor, rank, world_size, k).tolist()
            k += 1

    def advance(self, world_size: int, steps: int = 1) -> None:
        """Move the cursor past ``steps`` steps of a world of ``world_size`` ranks (call it when a
        step is done, before its commit).

        Args:
            world_size: the ranks of the world that took the steps.
            steps: how many steps.

        Raises:
            ValueError: ``world_size`` below 1 or ``steps`` negative.
        """
        if world_size < 1 or steps < 0:
            raise ValueError(f"world_size={world_size} must be >= 1 and steps={steps} >= 0")
        self.cursor += steps * world_size * self.batch_size

    def state_dict(self) -> dict:
        """The cursor and what fixes the order it counts in (DCP's ``Stateful`` convention).

        Returns:
            ``{"cursor", "num_samples", "batch_size", "seed", "shuffle"}``.
        """
        return {
            "cursor": self.cursor,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Go on from a committed cursor.

        Args:
            state: what :meth:`state_dict` returned (read back from a commit: untrusted).

        Raises:
            ValueError: a key is missing or of the wrong type, the cursor is negative, or the
                order it counts in differs from this sampler's (another dataset size, batch size,
                seed or shuffle): the message names the key and both values.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}: pass what ElasticSampler.state_dict() returned")
        cursor = state["cursor"]
        if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
            raise ValueError(f"sampler state: cursor={cursor!r} must be an integer >= 0")
        for key in _STATE_KEYS[1:]:
            if state[key] != getattr(self, key) or type(state[key]) is not type(getattr(self, key)):
                raise ValueError(
                    f"sampler state: {key}={state[key]!r} was committed, this sampler has {getattr(self, key)!r}: "
                    f"its cursor counts in another order; construct the sampler as the job did"
                )
        self.cursor = cursor

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                # one stream per (seed, epoch), never shared by two pairs
                key = hashlib.sha256(f"elastic_emb.sampler:{self.seed}:{epoch}".encode()).digest()
                g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples, dtype=torch.int64)
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size}) and world_size >= 1")
