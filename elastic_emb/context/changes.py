"""Which rows a context wrote: the change tracking that incremental commits build on.

Per table, the tracker keeps the local row numbers each write path touched, as the list of
int64 tensors those writes used (on the context's device: appending one needs no host
synchronisation), plus a flag for "every row". A write that skipped some of the rows it was
given marks the skipped ones with the table's *dump* number (its local row count), so it can
record "row or dump" with one ``torch.where`` and no host sync; readers drop the dump. Every
write path marks what it wrote, rows and their optimizer slots alike: ``apply_gradients`` the
rows it updated, ``import_shard``, ``load_state_dict`` and ``mark_restored`` every row, a
``reset`` that moves this rank's rows every row. The lazy initial fill from the seed does not
count: a row never written equals its seeded value, which a restore reproduces.

The work of a commit is therefore proportional to the rows written, not to the shard:
:meth:`ChangeTracker.take_rows` hands over the lists (deduplicated at capture, or raw for a
device-side capture that tolerates duplicates), and only :meth:`ChangeTracker.take`, the bool
mask of the context contract, builds a whole-shard mask. Memory stays bounded without a commit
taking the changes: once the listed entries of a table exceed its row count they are folded
into a mask of that table (one ``index_fill_`` per tensor, still no host sync).

A device-side capture (:mod:`elastic_emb.state.capture`) reads the changed rows on a side
stream while the next step runs; :meth:`ChangeTracker.hold` records its "rows read" event, and
every write path calls :meth:`ChangeTracker.before_write` first, which makes the writing stream
wait for that event (a device-side wait, no host sync): a row is never changed while it is
being captured.

The values written: a row update that computes the new rows whole (Adagrad, see
:func:`~elastic_emb.context.optim.apply_rows`) hands them to :meth:`ChangeTracker.mark_rows`.
Once a device-side capture has taken the rows raw (``take_rows(unique=False)``), the tracker
keeps the values of the first write to each table since the last take, and
:meth:`~ChangeTracker.take_rows` returns them with the rows (:class:`RowsTaken`): they are the
delta's bytes, so the capture copies them to the host instead of gathering the rows from the
table (on an H200 that gather, its launch and its wait in the next row update cost 1.3-2.5% of a
20 ms step). A second write to a table drops its values (one delta must not hold two values of a
row), and so does a fold into a mask: the capture gathers those tables. Memory: at most one
write's values per table, which the update allocated anyway, held until the next take.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class RowsTaken(dict):
    """What :meth:`ChangeTracker.take_rows` returns: per table the rows (a plain dict of them),
    and ``written``: per table whose one write since the last take left its values, those values
    (``{"weight": [k, ...], slot name: [k, ...]}``, row ``i`` the value written to ``rows[i]``)."""

    def __init__(self, rows=(), written: dict | None = None) -> None:
        super().__init__(rows)
        self.written: dict[str, dict[str, torch.Tensor]] = dict(written or {})


class ChangeTracker:
    """The rows written since the last :meth:`take` / :meth:`take_rows`, per table."""

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

    def mark_rows(self, table: str, rows: torch.Tensor, keep: torch.Tensor | None = None,
                  values: dict[str, torch.Tensor] | None = None) -> None:
        """Mark local ``rows`` (int64, on the device) of ``table``; where ``keep`` is False the
        row was not written and is not marked. ``values``: the values now in those rows, per
        tensor (see the module docstring). The tracker keeps ``rows`` and ``values`` (the caller
        must not change them afterwards)."""
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
        """This rank now holds other rows (a reset moved them): all of them count as written."""
        self._reset(local_rows)
        self._all = set(self._rows)

    def take(self) -> dict[str, torch.Tensor]:
        """Per table, ``(local rows,)`` bool, True for rows written since the previous take."""
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
        """Per table, the local rows written since the previous take, as an int64 tensor on the
        device; None for a table whose every row was written. ``unique``: sorted, without
        duplicates (on CUDA a host synchronisation: the number of distinct rows). Otherwise the
        rows as written, duplicates included, in no particular order, where entries equal to
        the table's local row count stand for no row (see the module docstring); no host sync;
        and ``written``: the values of the tables written once since the last take (from the
        second raw take on: the first one tells the tracker to keep them)."""
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
            rows = (parts[0] if len(parts) == 1 else torch.cat(parts) if parts
                    else torch.empty(0, dtype=torch.int64, device=self.device))
            if unique and rows.numel():
                rows = torch.unique(rows)  # sorted
                if int(rows[-1]) == n:
                    rows = rows[:-1]
            out[name] = rows
        self._reset(self._rows)
        return out

    # -- device-side captures -----------------------------------------------------------------

    def hold(self, event: torch.cuda.Event) -> None:
        """A capture reads rows until ``event``: writes wait for it (:meth:`before_write`)."""
        self._held.append(event)

    def before_write(self) -> None:
        """Called by every write path before it writes rows: the current stream waits (on the
        device, no host sync) until the captures in flight have read their rows."""
        if self._held:
            stream = torch.cuda.current_stream(self.device)
            for event in self._held:
                event.wait(stream)  # a CUDA event, or a capture's pending one (the same wait(stream))
            self._held = []
