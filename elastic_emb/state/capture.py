"""Delta commits captured on the GPU: a side-stream gather, an asynchronous copy to pinned memory.

On CUDA a commit must not stop the step: a 1M-id step changes about 0.5 GB of rows and slots,
and gathering them on the host (a sync, an indexed copy, a pageable copy) costs hundreds of
milliseconds. :class:`DeviceCapture` instead, in ``lc.commit(step)`` and without any host
synchronisation:

1. takes the rows written since the last commit as the context recorded them
   (``take_changed_rows(unique=False)``: the int64 row tensors of each write, duplicates
   included; their sizes are known on the host, so the staging size is too), lays the delta
   out, records a "step done" event on the training stream and hands the rest to the capture's
   launcher thread; it also makes every later write of the context wait (``hold_writes``) for
   the "rows read" event of step 3, which the launcher records;
2. the launcher thread, on a side stream that first waits for "step done" (so every write of
   the step is in), gathers the index and the rows of the weight and of every optimizer slot
   into one device staging buffer, laid out exactly as the delta's data file;
3. records "rows read": the next step's lookups and dense part run at once, its row update
   waits only for the gather (on the device; on the host only until the launcher has launched
   the gather, a fraction of a millisecond), so no captured row is ever torn;
4. copies the staging buffer (asynchronously) straight into a free segment of the node's log
   ring (:mod:`elastic_emb.state.ring`: shared-memory files registered with CUDA once), or,
   when none is free, into a pinned host buffer the writer then copies into a file; in pieces
   alternating between two streams (:meth:`DeviceCapture._copy`), so that the training
   stream's own small reads from the GPU are not queued behind a whole delta.

The values written instead of a gather: where the context hands over, with a table's rows, the
values its one write since the last commit put there (``rows.written``, see
:class:`elastic_emb.context.changes.RowsTaken`: the optimizer computed them whole), those tensors
ARE the delta's bytes: the launcher copies them (and the row numbers) straight to the host, and
steps 2-3 do not happen for that table: no gather, no staging buffer, and no hold (the next row
update waits for nothing, the capture does not read the table). Measured on an H200
(BENCHMARKS.md, "The device path"): a 20 ms dense step's overhead +4.0% instead of +7.3% with the
gather (about 2 points lower, paired, over two runs). Tables written twice since the last commit,
or without values (SGD), are gathered as above.

Why a thread launches the gather and the copy: the training thread's time in ``lc.commit`` is
time the GPU idles (a step ends by reading its loss, which drains the training stream), and on
an H200 launching them took it 2 ms per commit of a 20 ms step, 4.7 ms once the copy went in
pieces. Now it spends the cost of laying out the records, taking a log segment and recording an
event: 0.3 ms on that host (:data:`TRACE` lists each step for the bench), 0.5 ms with the rest of
``SnapshotTier.capture``. Measured there and not kept (BENCHMARKS.md, "The device path"): the
pieces launched through the CUDA driver by ``ctypes`` (fewer Python calls in the launcher), the
gather launched by the training thread itself, larger or smaller pieces, the gather as one Triton
kernel per tensor, the copy by a few SMs instead of the copy engine (much slower steps: the SMs are
taken from the dense part), the log segment taken ahead by the launcher, the layout, records and
log segment all taken by the launcher (the call 0.52 -> 0.33 ms, the step the same: the work then
competes with the next step's launches); none made the step faster.

No checksum is computed on the GPU or by the training thread. The background writer
(:class:`~elastic_emb.state.writer.CommitWriter`) waits for the copy's events in its own thread,
computes the checksum of every tensor of the delta over the bytes where they landed, on several
cores, each chunk once the copy has landed past its end (:meth:`_PendingCopy.landed`: the writer
wakes every :data:`MARK_BYTES`, not once per piece, so it takes the GIL a few times per commit;
on an H200 checksumming as the copy lands left 3-5 ms of the writer's work after a 9.4 ms copy,
against 10.7 ms after the whole copy) (:func:`finished_records`; for a delta in a log segment XXH3-64 in 16 MiB chunks,
:data:`DELTA_CHECKSUM`: zlib's CRC32 was the bound of the whole commit path, see
:mod:`elastic_emb.state.digest`; the pinned path keeps CRC32), and writes
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

import math
import threading
import time
from collections import deque

import torch

from elastic_emb.native_calls import native_call
from elastic_emb.protocol import ShardData
from elastic_emb.state.digest import digest_ranges
from elastic_emb.state.delta import INDEX
from elastic_emb.state.manifest import ShardRecord, TensorRecord, tensor_items

ALIGN = 64  # every tensor of the staging buffer starts on this many bytes (views of any dtype)
PENDING_CRC = -1  # a TensorRecord's crc32 before the writer computed it
DELTA_CHECKSUM = "xxh3_64"  # the algorithm of a delta's checksums when it landed in a log segment
IDLE_SECONDS = 2.0  # the launcher thread exits after this long without a capture
PIECE_BYTES = 16 << 20  # the device-to-host copy of a delta goes in pieces of this size (see DeviceCapture._copy)
MARK_BYTES = 64 << 20  # the writer wakes once per this many bytes landed (see _PendingCopy.landed)
TRACE: list | None = None  # a list to append (label, perf_counter_ns) to at the steps of a capture call (bench)


def _trace(label: str) -> None:
    if TRACE is not None:
        TRACE.append((label, time.perf_counter_ns()))


class DeviceCapture:
    """Captures deltas of one CUDA context; one per lifecycle (its pinned buffers are reused)."""

    def __init__(self, device: torch.device, buffers: int = 3, timeout: float = 300.0,
                 piece_bytes: int = PIECE_BYTES) -> None:
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
        _trace("start")
        written = getattr(rows, "written", None) or {}
        layout, off, gathers = [], 0, False
        for name in sorted(shards):
            sd, idx = shards[name], rows.get(name)
            if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or idx.device != self.device:
                raise ValueError(f"rows[{name!r}] must be a 1-D int64 tensor on {self.device}, got "
                                 f"{None if idx is None else (tuple(idx.shape), idx.dtype, str(idx.device))}")
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
                trs.append((TensorRecord.model_construct(name=tname, dtype=dtype, row_shape=shape, offset=off,
                                                         nbytes=k * row_b, crc32=PENDING_CRC, algorithm="crc32"), t))
                off += -(-k * row_b // ALIGN) * ALIGN
            vals = _written_values(written.get(name), trs, k, self.device)
            gathers = gathers or vals is None
            layout.append((name, sd, idx, trs, vals))
        total = off
        _trace("layout")
        seg = land(total) if land is not None else None
        buf = seg if seg is not None else self._acquire(total)
        host = (seg.host if seg is not None else buf)[:total]
        _trace("land")
        records = [ShardRecord.model_construct(table=name, num_rows=num_rows[name], start=sd.rows.start,
                                               stop=sd.rows.stop, tensors=[tr for tr, _ in trs])
                   for name, sd, _, trs, _ in layout]
        _trace("records")
        job = _Job(self.timeout, host, total, layout)
        job.ready.record(torch.cuda.current_stream(self.device))  # the step's writes come first
        if gathers:  # (a capture of written values alone never reads the table)
            hold(_PendingRead(job))
        _trace("ready")
        # The launcher is woken last: from then on it competes with this thread for the GIL.
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic_emb-capture", daemon=True)
                self._thread.start()
            self._cv.notify()
        _trace("handed")
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
            for name, sd, idx, trs, _ in gathered:
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
        if staging is not None and len(gathered) == len(job.layout):
            sources = [(0, staging)]  # the whole delta from one buffer
        else:  # per tensor, in the order of the delta: written values as they are, the rest gathered
            sources = []
            for name, sd, idx, trs, vals in job.layout:
                for tr, _ in trs:
                    if vals is None:
                        src = staging[tr.offset: tr.offset + tr.nbytes]
                    else:
                        src = (idx if tr.name == INDEX else vals[tr.name]).reshape(-1).view(torch.uint8)
                    if tr.nbytes:
                        sources.append((tr.offset, src))
        job.layout = None  # the row tensors may go (their last use is recorded on the side streams)
        job.set_read(read)
        job.set_copied(*self._copy(job.host, sources, read))

    def _copy(self, host: torch.Tensor, sources: list[tuple[int, torch.Tensor]],
              read: torch.cuda.Event) -> tuple[torch.cuda.Event, list[tuple[int, torch.cuda.Event]]]:
        """Copy each ``(offset, bytes)`` of ``sources`` (uint8 device tensors, in increasing
        offsets) into ``host`` at its offset, after ``read``; the event after which all of it is
        there, and per piece (the byte it ends at, the event after which it and every piece before
        it are there: each piece waits for the one before), so the writer can checksum what has
        landed.

        In pieces of ``piece_bytes``, alternately on the two side streams, each piece waiting for
        the one before: a stream's queue runs dry after each piece, so a small read of the
        training stream (``.item()``, ``torch.unique``'s count), which goes through the same copy
        engine, waits for one piece, not for the whole delta (measured on an H200: a 516 MB copy
        in one piece, or in pieces queued on one stream, kept such a read waiting 8-9 ms)."""
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
            for dst, src in zip(host[off: off + n].split(piece), source.split(piece)):
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
        if (v is None or v.device != device or v.dtype != t.dtype or tuple(v.shape) != (k, *tr.row_shape)
                or not v.is_contiguous()):
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
            raise TimeoutError(f"the capture's {what} was not launched within {self.timeout}s: the capture launcher "
                               f"thread is stuck (a CUDA call that does not return); check the GPU")
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
    """``(offset, nbytes)`` of every tensor of ``records``, in order."""
    return [(tr.offset, tr.nbytes) for rec in records for tr in rec.tensors]


def finished_records(records: list[ShardRecord], data, crcs: list[int] | None = None,
                     algorithm: str = "crc32", landed=None) -> list[ShardRecord]:
    """``records`` of a GPU capture (:data:`PENDING_CRC`) with the checksum of each tensor's bytes
    by ``algorithm`` (:mod:`elastic_emb.state.digest`): ``crcs`` (one per tensor, in order) when
    the caller computed them, else computed here from ``data`` (the delta's bytes on the host,
    numpy uint8, read only after the capture's event) on several cores
    (:func:`~elastic_emb.state.digest.digest_ranges`; ``landed``: as the copy lands, see there)."""
    if crcs is None:
        crcs = digest_ranges(data, record_ranges(records), algorithm, landed)
    it = iter(crcs)
    return [rec.model_copy(update={"tensors": [tr.model_copy(update={"crc32": next(it), "algorithm": algorithm})
                                               for tr in rec.tensors]}) for rec in records]
