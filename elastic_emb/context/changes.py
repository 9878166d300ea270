"""Which rows a context wrote: the change tracking that incremental commits build on.

Per table, one bool mask over this rank's local rows, on the context's device, plus one dump
slot at the end (so a write that skips some rows can mark "row or dump" with one
``index_fill_``, without a host synchronisation to select the rows it kept). Every write path
marks what it wrote, rows and their optimizer slots alike: ``apply_gradients`` the rows it
updated, ``import_shard``, ``load_state_dict`` and ``mark_restored`` every row, a ``reset`` that
moves this rank's rows every row. The lazy initial fill from the seed does not count: a row never
written equals its seeded value, which a restore reproduces.

:meth:`ChangeTracker.take` hands the masks to the caller and swaps in fresh zero ones, so the
caller owns what it got and nothing waits for the device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class ChangeTracker:
    """Bool masks of the rows written since the last :meth:`take`, per table."""

    def __init__(self, local_rows: Mapping[str, int], device: torch.device):
        self.device = device
        self._rows = dict(local_rows)
        self._masks = {name: self._fresh(n) for name, n in self._rows.items()}

    def _fresh(self, n: int) -> torch.Tensor:
        return torch.zeros(n + 1, dtype=torch.bool, device=self.device)

    def mark_rows(self, table: str, rows: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Mark local ``rows`` (int64, on the device) of ``table``; where ``keep`` is False the
        row was not written and is not marked."""
        if keep is not None:
            rows = torch.where(keep, rows, self._rows[table])  # the dump slot
        self._masks[table].index_fill_(0, rows, True)

    def mark_all(self) -> None:
        """Every row of every table was written."""
        for mask in self._masks.values():
            mask.fill_(True)

    def resize(self, local_rows: Mapping[str, int]) -> None:
        """This rank now holds other rows (a reset moved them): all of them count as written."""
        self._rows = dict(local_rows)
        self._masks = {name: self._fresh(n) for name, n in self._rows.items()}
        self.mark_all()

    def take(self) -> dict[str, torch.Tensor]:
        """Per table, ``(local rows,)`` bool, True for rows written since the previous call."""
        out = {name: mask[: self._rows[name]] for name, mask in self._masks.items()}
        self._masks = {name: self._fresh(n) for name, n in self._rows.items()}
        return out
