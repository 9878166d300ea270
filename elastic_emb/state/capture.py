"""Delta commits captured on the GPU: a side-stream gather, an asynchronous copy to host memory.

:class:`DeviceCapture` lays a delta out in ``lc.commit(step)`` without a host synchronisation and
hands the rest to a launcher thread: on a side stream it gathers the changed rows (or takes the
values the row update wrote), holds the context's next writes until they are read, and copies the
delta in pieces into a log segment or a pinned buffer. The background writer then checksums the
bytes as they land (:func:`finished_records`) and writes the manifest last.

Design: ``docs/COMMIT.md`` (section "Capturing deltas on the GPU").
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import torch

from elastic_emb.native_calls import native_call
from elastic_emb.protocol import ShardData
from elastic_emb.state.delta import INDEX
from elastic_emb.state.digest import digest_ranges
from elastic_emb.state.manifest import ShardRecord, TensorRecord, tensor_items

ALIGN = 64  # every tensor of the staging buffer starts on this many bytes (views of any dtype)
PENDING_CRC = -1  # a TensorRecord's crc32 before the writer computed it
DELTA_CHECKSUM = "xxh3_64"  # the algorithm of a delta's checksums when it landed in a log segment
IDLE_SECONDS = 2.0  # the launcher thread exits after this long without a capture
PIECE_BYTES = 16 << 20  # the device-to-host copy of a delta goes in pieces of this size (see DeviceCapture._copy)
MARK_BYTES = 64 << 20  # the writer wakes once per this many bytes landed (see _PendingCopy.landed)


class DeviceCapture:
    """Captures deltas of one CUDA context; one per lifecycle (its pinned buffers are reused).

    Args:
        device: the context's CUDA device (without an index: the current one).
        buffers: the most pinned buffers; a capture waits for one to come free beyond that.
        timeout: how long a capture waits for a pinned buffer, and a wait for the launcher.
        piece_bytes: the size of the pieces the copy to the host goes in (0: one copy).

    Raises:
        ValueError: if ``buffers`` is below 1 or ``piece_bytes`` is negative.
    """

    def __init__(
        self, device: torch.device, buffers: int = 3, timeout: float = 300.0, piece_bytes: int = PIECE_BYTES
    ) -> None:
        if buffers < 1:
            raise ValueError(f"buffers={buffers} must be >= 1 pinned buffers")
        if piece_bytes < 0:
            raise ValueError(f"piece_bytes={piece_bytes} must be >= 0 (0: the delta in one copy)")
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.stream2 = torch.cuda.Stream(self.device)  # every other piece of the copy (see _copy)
        self.piece_bytes = piece_bytes
        self.buffers = buffers
        self.timeout = timeout
        self._jobs: deque[_Job] = deque()  # captures whose gather and copy the launcher has yet to launch
        self._thread: threading.Thread | None = None
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
                    raise TimeoutError(
                        f"no pinned commit buffer came free in {self.timeout}s: the background "
                        f"writer is stuck (storage or a peer); check ELASTIC_EMB_STATE_DIR"
                    )
                self._cv.wait(left)
            buf = self._free.pop() if self._free else None
            if buf is None:
                self._allocated += 1
        if buf is not None and buf.numel() >= nbytes:
            return buf
        del buf  # too small: replaced by one with room to grow (pinned allocations are slow)
        return torch.empty(max(nbytes + nbytes // 4, 1 << 20), dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor) -> None:
        """Give a pinned buffer back to the pool (the writer wrote what it held).

        Args:
            buf: the buffer a capture returned.
        """
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def capture(
        self, shards: dict[str, ShardData], rows: dict[str, torch.Tensor], num_rows: dict[str, int], hold, land=None
    ) -> tuple[list[ShardRecord], torch.Tensor, torch.cuda.Event, object]:
        """Start capturing a delta: lay it out here, launch the gather and copy on the launcher.

        Args:
            shards: table -> the context's own shard, on this device.
            rows: table -> the raw row tensor of its writes since the last commit (int64, 1-D, on
                this device, duplicates included, the shard's row count for skipped entries); a
                ``written`` attribute may hold, per table, the values its one write put there.
            num_rows: table -> rows in the table.
            hold: ``hold(event)`` makes the context's writes wait for ``event`` (``hold_writes``).
            land: ``land(nbytes)`` returns a log segment (:mod:`elastic_emb.state.ring`) to copy the
                delta straight into, or None; without it, or on None, a pinned buffer of the pool.

        Returns:
            A tuple: the records (checksums :data:`PENDING_CRC`), the host bytes the data file will
            hold, what to wait on for them (its ``synchronize()`` and ``landed()``), and the pinned
            buffer or the segment to release afterwards.

        Raises:
            ValueError: if a row tensor or a shard tensor is not as described, or not on this device.
            TimeoutError: if no pinned buffer came free within the timeout (the writer is stuck).
        """
        written = getattr(rows, "written", None) or {}
        layout, off, gathers = [], 0, False
        for name in sorted(shards):
            sd, idx = shards[name], rows.get(name)
            if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or idx.device != self.device:
                raise ValueError(
                    f"rows[{name!r}] must be a 1-D int64 tensor on {self.device}, got "
                    f"{None if idx is None else (tuple(idx.shape), idx.dtype, str(idx.device))}"
                )
            k = idx.numel()
            trs = []
            for tname, t in [(INDEX, None)] + tensor_items(sd):
                if t is None:
                    dtype, shape, row_b = "int64", [], 8
                else:  # (the row size from the tensor itself: manifest.row_bytes makes a tensor to ask)
                    if t.device != self.device:
                        raise ValueError(f"table {name!r} tensor {tname!r} is on {t.device}, not {self.device}")
                    shape = list(t.shape[1:])
                    dtype, row_b = str(t.dtype).removeprefix("torch."), t.element_size() * math.prod(shape)
                # (model_construct: values computed here, no validation on the training thread)
                trs.append(
                    (
                        TensorRecord.model_construct(
                            name=tname,
                            dtype=dtype,
                            row_shape=shape,
                            offset=off,
                            nbytes=k * row_b,
                            crc32=PENDING_CRC,
                            algorithm="crc32",
                        ),
                        t,
                    )
                )
                off += -(-k * row_b // ALIGN) * ALIGN
            vals = _written_values(written.get(name), trs, k, self.device)
            gathers = gathers or vals is None
            layout.append((name, sd, idx, trs, vals))
        total = off
        seg = land(total) if land is not None else None
        buf = seg if seg is not None else self._acquire(total)
        host = (seg.host if seg is not None else buf)[:total]
        records = [
            ShardRecord.model_construct(
                table=name,
                num_rows=num_rows[name],
                start=sd.rows.start,
                stop=sd.rows.stop,
                tensors=[tr for tr, _ in trs],
            )
            for name, sd, _, trs, _ in layout
        ]
        job = _Job(self.timeout, host, total, layout)
        job.ready.record(torch.cuda.current_stream(self.device))  # the step's writes come first
        if gathers:  # (a capture of written values alone never reads the table)
            hold(_PendingRead(job))
        # The launcher is woken last: from then on it competes with this thread for the GIL.
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic_emb-capture", daemon=True)
                self._thread.start()
            self._cv.notify()
        return records, host, _PendingCopy(job), buf

    def _run(self) -> None:
        """The launcher thread: launches each job's gather and copy, in order; exits when idle."""
        torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait(IDLE_SECONDS)
                if not self._jobs:
                    self._thread = None  # a later capture starts another
                    return
                job = self._jobs.popleft()
            try:
                with native_call():  # its tensor ops release the GIL: the exit waits for them (briefly)
                    self._launch(job)
            except BaseException as exc:  # raised where the capture is waited for (a write, a hold)
                job.fail(exc)

    def _launch(self, job: "_Job") -> None:
        side = self.stream
        side.wait_event(job.ready)
        gathered = [entry for entry in job.layout if entry[4] is None]
        staging = None
        with torch.cuda.stream(side):
            if gathered:
                staging = torch.empty(job.total, dtype=torch.uint8, device=self.device)
            for _name, sd, idx, trs, _ in gathered:
                idx.record_stream(side)  # allocated on the training stream, read here
                n, k = len(sd.rows), idx.numel()
                src = idx.clamp(max=max(n - 1, 0))  # skipped entries (== n) read row n - 1; restore skips them
                for tr, t in trs:
                    dst = staging[tr.offset : tr.offset + tr.nbytes]
                    if tr.name == INDEX:
                        dst.view(torch.int64).copy_(idx)
                    elif k and n:
                        torch.index_select(t, 0, src, out=dst.view(t.dtype).view(k, *tr.row_shape))
                    elif k:
                        dst.zero_()  # an empty shard: every entry is a skipped one
            read = torch.cuda.Event()
            read.record(side)
        if staging is not None and len(gathered) == len(job.layout):
            sources = [(0, staging)]  # the whole delta from one buffer
        else:  # per tensor, in the order of the delta: written values as they are, the rest gathered
            sources = []
            for _name, _sd, idx, trs, vals in job.layout:
                for tr, _ in trs:
                    if vals is None:
                        src = staging[tr.offset : tr.offset + tr.nbytes]
                    else:
                        src = (idx if tr.name == INDEX else vals[tr.name]).reshape(-1).view(torch.uint8)
                    if tr.nbytes:
                        sources.append((tr.offset, src))
        job.layout = None  # the row tensors may go (their last use is recorded on the side streams)
        job.set_read(read)
        job.set_copied(*self._copy(job.host, sources, read))

    def _copy(
        self, host: torch.Tensor, sources: list[tuple[int, torch.Tensor]], read: torch.cuda.Event
    ) -> tuple[torch.cuda.Event, list[tuple[int, torch.cuda.Event]]]:
        """Copy each ``(offset, bytes)`` of ``sources`` (uint8 device tensors, in increasing
        offsets) into ``host`` at its offset, after ``read``; the event after which all of it is
        there, and per piece (the byte it ends at, the event after which it and every piece before
        it are there: each piece waits for the one before), so the writer can checksum what has
        landed.

        In pieces of ``piece_bytes``, alternately on the two side streams, each piece waiting for
        the one before: a stream's queue runs dry after each piece, so a small read of the
        training stream (``.item()``, ``torch.unique``'s count), which goes through the same copy
        engine, waits for one piece, not for the whole delta (as it would with one copy, or with
        pieces queued on one stream)."""
        side, other = self.stream, self.stream2
        prev = read  # recorded on ``side``
        marks, i = [], 0
        # (one split of each buffer, not two slices a piece, and the launcher's own current stream
        # set without restoring it: fewer Python-level torch calls holding the GIL the training
        # thread needs)
        for off, source in sources:
            n = source.numel()
            piece = min(self.piece_bytes or n, n) or 1
            end = off
            for dst, src in zip(host[off : off + n].split(piece), source.split(piece)):
                st = side if i % 2 == 0 else other
                if i:
                    st.wait_event(prev)
                torch.cuda.set_stream(st)
                dst.copy_(src, non_blocking=True)
                prev = torch.cuda.Event()
                prev.record(st)
                end += dst.numel()
                marks.append((end, prev))
                i += 1
        if i > 1:  # freed (or, for written values, reused) only once both streams have read them
            for _, source in sources:
                source.record_stream(side)
                source.record_stream(other)
            side.wait_event(prev)  # the next capture comes after this copy's last piece, as before
        elif sources:
            sources[0][1].record_stream(side)
        return prev, marks


def _written_values(vals: dict | None, trs: list, k: int, device: torch.device) -> dict | None:
    """``vals`` (a table's written values) when they are exactly the delta's tensors (every
    tensor of ``trs`` there, ``k`` contiguous rows of its dtype and row shape, on ``device``),
    else None: the table is gathered."""
    if vals is None:
        return None
    for tr, t in trs[1:]:
        v = vals.get(tr.name)
        if (
            v is None
            or v.device != device
            or v.dtype != t.dtype
            or tuple(v.shape) != (k, *tr.row_shape)
            or not v.is_contiguous()
        ):
            return None
    return vals


class _Job:
    """One capture between the training thread and the launcher: what to gather and where to
    copy it, and the two events the launcher records ("rows read", "copied"), or its error."""

    def __init__(self, timeout: float, host: torch.Tensor, total: int, layout: list) -> None:
        self.timeout = timeout
        self.host = host
        self.total = total
        self.layout = layout
        self.ready = torch.cuda.Event()  # recorded on the training stream by the capture
        self.read: torch.cuda.Event | None = None
        self.copied: torch.cuda.Event | None = None
        self.marks: list[tuple[int, torch.cuda.Event]] = []  # per piece of the copy (see DeviceCapture._copy)
        self.error: BaseException | None = None
        self._read_set = threading.Event()
        self._copied_set = threading.Event()

    def set_read(self, event: torch.cuda.Event) -> None:
        self.read = event
        self._read_set.set()

    def set_copied(self, event: torch.cuda.Event, marks: list[tuple[int, torch.cuda.Event]] = ()) -> None:
        self.copied, self.marks = event, list(marks)
        self._copied_set.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.layout = None
        self._read_set.set()
        self._copied_set.set()

    def wait_launched(self, flag: threading.Event, what: str) -> None:
        if not flag.wait(self.timeout):
            raise TimeoutError(
                f"the capture's {what} was not launched within {self.timeout}s: the capture launcher "
                f"thread is stuck (a CUDA call that does not return); check the GPU"
            )
        if self.error is not None:
            raise RuntimeError(f"launching a commit's {what} on the GPU failed: {self.error}") from self.error


class _PendingRead:
    """What the context's writes wait for (``hold_writes``): "rows read" once launched. Has the
    ``wait(stream)`` of a CUDA event, which ``Stream.wait_event`` calls."""

    def __init__(self, job: _Job) -> None:
        self.job = job

    def wait(self, stream=None) -> None:
        self.job.wait_launched(self.job._read_set, "gather")
        self.job.read.wait(stream)


class _PendingCopy:
    """What the writer waits for: every piece of the copy on the host (``synchronize``)."""

    def __init__(self, job: _Job) -> None:
        self.job = job

    def synchronize(self) -> None:
        self.job.wait_launched(self.job._copied_set, "copy to the host")
        self.job.copied.synchronize()

    def landed(self, every: int | None = None):
        """The bytes on the host so far, a count from the start of the delta, yielded once at least
        ``every`` more bytes of the copy have landed since the last count (the last: all of them):
        the writer checksums each part as it lands instead of after the whole copy, and wakes (and
        takes the GIL) a few times per commit, not once per piece of the copy (default
        :data:`MARK_BYTES`; 1: once per piece)."""
        self.job.wait_launched(self.job._copied_set, "copy to the host")
        every = MARK_BYTES if every is None else every
        marks, last = self.job.marks, 0
        for end, event in marks[:-1]:
            if end - last >= every:
                event.synchronize()
                last = end
                yield end
        self.job.copied.synchronize()
        yield self.job.total


def record_ranges(records: list[ShardRecord]) -> list[tuple[int, int]]:
    """Where each tensor of a delta lies in its data.

    Args:
        records: the delta's records.

    Returns:
        ``(offset, nbytes)`` of every tensor of every record, in order.
    """
    return [(tr.offset, tr.nbytes) for rec in records for tr in rec.tensors]


def finished_records(
    records: list[ShardRecord], data, crcs: list[int] | None = None, algorithm: str = "crc32", landed=None
) -> list[ShardRecord]:
    """The records of a GPU capture with the checksum of each tensor filled in.

    Args:
        records: records with :data:`PENDING_CRC` checksums.
        data: the delta's bytes on the host (numpy uint8), read once they have landed; unused when
            ``crcs`` is given.
        crcs: one checksum per tensor, in order, when the caller computed them; None: computed here
            on the checksum threads (:func:`~elastic_emb.state.digest.digest_ranges`).
        algorithm: the checksum algorithm (:mod:`elastic_emb.state.digest`).
        landed: growing byte counts of ``data`` that have landed (see ``digest_ranges``), so the
            checksums run as the copy lands.

    Returns:
        Copies of ``records`` with their checksums and ``algorithm`` set.
    """
    if crcs is None:
        crcs = digest_ranges(data, record_ranges(records), algorithm, landed)
    it = iter(crcs)
    return [
        rec.model_copy(
            update={
                "tensors": [tr.model_copy(update={"crc32": next(it), "algorithm": algorithm}) for tr in rec.tensors]
            }
        )
        for rec in records
    ]
