"""Delta commits captured on the GPU: a side-stream gather, an asynchronous copy to pinned memory.

On CUDA a commit must not stop the step: a 1M-id step changes about 0.5 GB of rows and slots,
and gathering them on the host (a sync, an indexed copy, a pageable copy) costs hundreds of
milliseconds. :class:`DeviceCapture` instead, in ``lc.commit(step)`` and without any host
synchronisation:

1. takes the rows written since the last commit as the context recorded them
   (``take_changed_rows(unique=False)``: the int64 row tensors of each write, duplicates
   included; their sizes are known on the host, so the staging size is too);
2. on a side stream that first waits for the training stream (so every write of the step is in),
   gathers the index and the rows of the weight and of every optimizer slot into one device
   staging buffer, laid out exactly as the delta's data file;
3. records a "rows read" event, and makes every later write of the context wait for it on the
   device (``hold_writes``): the next step's lookups and dense part run at once, its row update
   waits only for the gather, so no captured row is ever torn;
4. copies the staging buffer (asynchronously, same side stream) straight into a free segment of
   the node's log ring (:mod:`elastic_emb.state.ring`: shared-memory files registered with CUDA
   once), or, when none is free, into a pinned host buffer the writer then copies into a file.

That is all the training thread launches: no checksum. The background writer
(:class:`~elastic_emb.state.writer.CommitWriter`) waits for the copy's event in its own thread,
computes the CRC32 of every tensor of the delta over the bytes where they landed, on several
cores (:func:`finished_records`; zlib's CRC32, so restore checks them as any other), and writes
the manifest last, as for any commit: naming the log segment the bytes already are in, or, for a
delta that took the pinned path, after copying them into a file and checksumming them on the way
(:func:`~elastic_emb.state.crc.write_and_checksum`). (A CRC32 computed on the GPU cost the training
thread about 16 ms per commit of launching small tensor operations, most of a 20 ms step.)

Pinned buffers come from a small pool (``buffers``): when every buffer is in use, the next capture
waits for the oldest commit to be written (bounded), which is the back-pressure that keeps host
memory bounded.

Duplicates: a row written twice since the last commit appears twice in the delta, with the same
bytes (both copies were gathered after the step, in one pass). A write that skipped rows marked
them with the table's local row count (``n``); those entries carry row ``n - 1``'s bytes and
restore skips them (:func:`~elastic_emb.state.delta.read_chain`). Restore applies the deltas in
order, so the newest value of each row wins.
"""

from __future__ import annotations

import threading
import time

import torch

from elastic_emb.protocol import ShardData
from elastic_emb.state.crc import checksum_ranges
from elastic_emb.state.delta import INDEX
from elastic_emb.state.manifest import ShardRecord, TensorRecord, row_bytes, row_spec, tensor_items

ALIGN = 64  # every tensor of the staging buffer starts on this many bytes (views of any dtype)
PENDING_CRC = -1  # a TensorRecord's crc32 before the writer computed it


class DeviceCapture:
    """Captures deltas of one CUDA context; one per lifecycle (its pinned buffers are reused)."""

    def __init__(self, device: torch.device, buffers: int = 3, timeout: float = 300.0) -> None:
        if buffers < 1:
            raise ValueError(f"buffers={buffers} must be >= 1 pinned buffers")
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.buffers = buffers
        self.timeout = timeout
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cv = threading.Condition()

    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least ``nbytes``: a free one, or a new one while fewer than
        ``buffers`` exist; else wait (at most ``timeout``) for the writer to release one."""
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while not self._free and self._allocated >= self.buffers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no pinned commit buffer came free in {self.timeout}s: the background "
                                       f"writer is stuck (storage or a peer); check ELASTIC_EMB_STATE_DIR")
                self._cv.wait(left)
            buf = self._free.pop() if self._free else None
            if buf is None:
                self._allocated += 1
        if buf is not None and buf.numel() >= nbytes:
            return buf
        del buf  # too small: replaced by one with room to grow (pinned allocations are slow)
        return torch.empty(max(nbytes + nbytes // 4, 1 << 20), dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor) -> None:
        """Give a pinned buffer back (the writer wrote what it held)."""
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def capture(self, shards: dict[str, ShardData], rows: dict[str, torch.Tensor], num_rows: dict[str, int],
                hold, land=None) -> tuple[list[ShardRecord], torch.Tensor, torch.cuda.Event, object]:
        """Start capturing the rows ``rows[table]`` (raw, see the module docstring) of ``shards``
        (the context's own tensors, on this device). ``hold(event)`` makes the context's writes
        wait for ``event``. ``land(nbytes)``: a log segment (:mod:`elastic_emb.state.ring`) to copy
        the delta straight into, or None (then a pinned buffer of the pool). Returns (records with
        :data:`PENDING_CRC`, the host bytes the data file will hold, the event after which they are
        there, and the pinned buffer or the segment to release)."""
        layout, off = [], 0
        for name in sorted(shards):
            sd, idx = shards[name], rows.get(name)
            if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or idx.device != self.device:
                raise ValueError(f"rows[{name!r}] must be a 1-D int64 tensor on {self.device}, got "
                                 f"{None if idx is None else (tuple(idx.shape), idx.dtype, str(idx.device))}")
            k = idx.numel()
            items = [(INDEX, None, torch.int64, [], 8)] + [
                (tname, t, t.dtype, row_spec(t)[1], row_bytes(row_spec(t))) for tname, t in tensor_items(sd)]
            trs = []
            for tname, t, dtype, shape, row_b in items:
                if t is not None and t.device != self.device:
                    raise ValueError(f"table {name!r} tensor {tname!r} is on {t.device}, not {self.device}")
                trs.append((TensorRecord(name=tname, dtype=str(dtype).removeprefix("torch."), row_shape=shape,
                                         offset=off, nbytes=k * row_b, crc32=PENDING_CRC), t))
                off += -(-k * row_b // ALIGN) * ALIGN
            layout.append((name, sd, idx, trs))
        total = off
        seg = land(total) if land is not None else None
        buf = seg if seg is not None else self._acquire(total)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))  # the step's writes come first
        with torch.cuda.stream(side):
            staging = torch.empty(total, dtype=torch.uint8, device=self.device)
            for name, sd, idx, trs in layout:
                idx.record_stream(side)  # allocated on the training stream, read here
                n, k = len(sd.rows), idx.numel()
                src = idx.clamp(max=max(n - 1, 0))  # skipped entries (== n) read row n - 1; restore skips them
                for tr, t in trs:
                    dst = staging[tr.offset: tr.offset + tr.nbytes]
                    if tr.name == INDEX:
                        dst.view(torch.int64).copy_(idx)
                    elif k and n:
                        torch.index_select(t, 0, src, out=dst.view(t.dtype).view(k, *tr.row_shape))
                    elif k:
                        dst.zero_()  # an empty shard: every entry is a skipped one
            read = torch.cuda.Event()
            read.record(side)
            host = (seg.host if seg is not None else buf)[:total]
            host.copy_(staging, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)  # the bytes are on the host: the writer checksums them there
        hold(read)
        records = [ShardRecord(table=name, num_rows=num_rows[name], start=sd.rows.start, stop=sd.rows.stop,
                               tensors=[tr for tr, _ in trs]) for name, sd, _, trs in layout]
        return records, host, copied, buf


def record_ranges(records: list[ShardRecord]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of every tensor of ``records``, in order."""
    return [(tr.offset, tr.nbytes) for rec in records for tr in rec.tensors]


def finished_records(records: list[ShardRecord], data, crcs: list[int] | None = None) -> list[ShardRecord]:
    """``records`` of a GPU capture (:data:`PENDING_CRC`) with the CRC32 of each tensor's bytes:
    ``crcs`` (one per tensor, in order) when the caller computed them, else computed here from
    ``data`` (the delta's bytes on the host, numpy uint8, read only after the capture's event) on
    several cores (:func:`~elastic_emb.state.crc.checksum_ranges`)."""
    if crcs is None:
        crcs = checksum_ranges(data, record_ranges(records))
    it = iter(crcs)
    return [rec.model_copy(update={"tensors": [tr.model_copy(update={"crc32": next(it)}) for tr in rec.tensors]})
            for rec in records]
