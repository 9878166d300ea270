"""Which rows a context wrote: the change tracking that incremental commits build on.

:class:`ChangeTracker` keeps, per table, the local rows each write path touched (as the device
tensors those writes used, no host sync), folds them into a mask when they outgrow the table,
makes writes wait for device-side captures in flight, and keeps the values a table's one write
computed; :class:`RowsTaken` is what :meth:`ChangeTracker.take_rows` hands over.

Design: ``docs/CONTEXT.md`` (section "Change tracking").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class RowsTaken(dict):
    """What :meth:`ChangeTracker.take_rows` returns: per table the rows (a plain dict of them),
    and ``written``: per table whose one write since the last take left its values, those values
    (``{"weight": [k, ...], slot name: [k, ...]}``, row ``i`` the value written to ``rows[i]``).

    Args:
        rows: the per-table rows (anything ``dict`` accepts).
        written: the per-table values; None: none.
    """

    def __init__(self, rows=(), written: dict | None = None) -> None:
        super().__init__(rows)
        self.written: dict[str, dict[str, torch.Tensor]] = dict(written or {})


class ChangeTracker:
    """The rows written since the last :meth:`take` / :meth:`take_rows`, per table.

    Args:
        local_rows: each table's local row count.
        device: where the row tensors and masks live.
    """

    def __init__(self, local_rows: Mapping[str, int], device: torch.device):
        self.device = device
        self._held: list[torch.cuda.Event] = []
        self._keep_values = False  # set once a device-side capture took the rows raw
        self._reset(local_rows)

    def _reset(self, local_rows: Mapping[str, int]) -> None:
        self._rows = dict(local_rows)
        self._lists: dict[str, list[torch.Tensor]] = {name: [] for name in self._rows}
        self._listed = dict.fromkeys(self._rows, 0)  # entries in each table's list
        self._values: dict[str, dict[str, torch.Tensor] | None] = {}  # a table's one write: its values
        self._folded: dict[str, torch.Tensor] = {}  # tables whose lists grew past their rows: a mask
        self._all: set[str] = set()

    def mark_rows(
        self,
        table: str,
        rows: torch.Tensor,
        keep: torch.Tensor | None = None,
        values: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Mark local ``rows`` of ``table`` as written. No host sync.

        The tracker keeps ``rows`` and ``values``: the caller must not change them afterwards.

        Args:
            table: the table written.
            rows: local row numbers, int64 on the device; entries equal to the table's local
                row count stand for no row.
            keep: where False, the row was not written and is not marked; None: all were.
            values: the values now in those rows, per tensor (``"weight"`` and each slot), kept
                for a device-side capture when this is the table's one write since the last take
                (``docs/CONTEXT.md``, section "Values written").
        """
        if table in self._all:
            return
        n = self._rows[table]
        if keep is not None:
            rows = torch.where(keep, rows, n)  # the dump number: no row
        first = not self._lists[table] and table not in self._folded
        self._lists[table].append(rows.reshape(-1))
        self._listed[table] += rows.numel()
        if first and values is not None and self._keep_values:
            self._values[table] = values
        else:  # a second write (or none kept): the capture gathers this table
            self._values.pop(table, None)
        if self._listed[table] > n + 1:
            self._values.pop(table, None)
            mask = self._folded.get(table)
            if mask is None:
                mask = self._folded[table] = torch.zeros(n + 1, dtype=torch.bool, device=self.device)
            for t in self._lists[table]:
                mask.index_fill_(0, t, True)
            self._lists[table], self._listed[table] = [], 0

    def mark_all(self) -> None:
        """Every row of every table was written."""
        self._reset(self._rows)
        self._all = set(self._rows)

    def resize(self, local_rows: Mapping[str, int]) -> None:
        """This rank now holds other rows (a reset moved them): all of them count as written.

        Args:
            local_rows: each table's new local row count.
        """
        self._reset(local_rows)
        self._all = set(self._rows)

    def take(self) -> dict[str, torch.Tensor]:
        """Hand over the rows written since the previous take, as masks, and start afresh.

        Returns:
            Per table, a ``(local rows,)`` bool tensor on the device, True for rows written.
        """
        out = {}
        for name, n in self._rows.items():
            mask = self._folded.get(name)
            if mask is None:
                mask = torch.zeros(n + 1, dtype=torch.bool, device=self.device)
            if name in self._all:
                mask.fill_(True)
            for t in self._lists[name]:
                mask.index_fill_(0, t, True)
            out[name] = mask[:n]
        self._reset(self._rows)
        return out

    def take_rows(self, unique: bool = True) -> RowsTaken:
        """Hand over the local rows written since the previous take, and start afresh.

        Args:
            unique: True: sorted, without duplicates (on CUDA a host synchronisation: the number
                of distinct rows). False: the rows as written, duplicates included, in no
                particular order, where entries equal to the table's local row count stand for
                no row; no host sync; this also tells the tracker to keep written values from
                now on.

        Returns:
            Per table, an int64 tensor of local rows on the device, or None for a table whose
            every row was written; with ``unique=False``, ``written`` holds the values of the
            tables written once since the last take (from the second raw take on).
        """
        out = RowsTaken(written={} if unique else self._values)
        if not unique:
            self._keep_values = True
        for name, n in self._rows.items():
            if name in self._all:
                out[name] = None
                continue
            parts = list(self._lists[name])
            if name in self._folded:
                mask = self._folded[name]
                if unique:
                    parts.append(mask.nonzero().flatten())
                else:  # every row or the dump number: no host sync for the count
                    parts.append(torch.where(mask, torch.arange(n + 1, device=self.device), n))
            rows = (
                parts[0]
                if len(parts) == 1
                else torch.cat(parts)
                if parts
                else torch.empty(0, dtype=torch.int64, device=self.device)
            )
            if unique and rows.numel():
                rows = torch.unique(rows)  # sorted
                if int(rows[-1]) == n:
                    rows = rows[:-1]
            out[name] = rows
        self._reset(self._rows)
        return out

    # -- device-side captures -----------------------------------------------------------------

    def hold(self, event: torch.cuda.Event) -> None:
        """A capture reads rows until ``event``: writes wait for it (:meth:`before_write`).

        Args:
            event: a CUDA event (or a capture's pending one) recorded after the rows are read.
        """
        self._held.append(event)

    def before_write(self) -> None:
        """Called by every write path before it writes rows: the current stream waits (on the
        device, no host sync) until the captures in flight have read their rows."""
        if self._held:
            stream = torch.cuda.current_stream(self.device)
            for event in self._held:
                event.wait(stream)  # a CUDA event, or a capture's pending one (the same wait(stream))
            self._held = []
