"""Capture variants that ``bench/commit_gpu.py`` measures against the library's, in one process.

Not part of the library: each is a hypothesis about the dense loop's overhead on an H200
(BENCHMARKS.md, "The device path"), measured as a mode of the bench's interleaved windows.

* :class:`SmCopyCapture`: the device-to-host copy done by a few SMs instead of the copy engine. A
  kernel with a bounded grid stores the staging buffer's bytes through the host buffer's device
  mapping (pinned and registered host memory is mapped into the GPU's address space: UVA), so the
  copy engine stays free for the training stream's small reads (``torch.unique``'s count,
  ``.item()``), which otherwise wait for the piece of the delta in flight (16 MiB, ~0.3 ms).
  The cost: the grid's SMs are busy for the whole copy, taken from the dense part's kernels.
* :class:`DeferredCapture` (with :func:`deferred_capture`): the training thread only checks the
  rows, picks the written values, records "step done" and hands over; the launcher thread lays the
  delta out, takes its log segment and makes its records, and the writer waits for them
  (:class:`PendingCapture`). The commit call 0.41 -> 0.24 ms on an H200, the step no faster.
  (Before it, a launcher taking the next log segment ahead: the call 0.49 -> 0.40 ms, the step
  no faster either.)
* :class:`GatherCapture`: the library's capture with every table gathered (the written values
  the context hands over ignored): the library's path before the written values.

:func:`sm_copy_bandwidth` measures the SM copy's bandwidth against the copy engine's for a few
grid sizes, and checks every byte.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import statistics
import threading
from dataclasses import dataclass

import torch

from elastic_emb.state.capture import (ALIGN, IDLE_SECONDS, PENDING_CRC, DeviceCapture, _Job, _PendingCopy,
                                       _PendingRead, _trace)
from elastic_emb.state.delta import INDEX
from elastic_emb.state.manifest import CommitId, ShardRecord, TensorRecord, tensor_items
from elastic_emb.state.snapshot import Capture

try:
    import triton
    import triton.language as tl
except ImportError:  # the bench's CPU smoke run
    triton = None

SM_PIECE_BYTES = 64 << 20  # one launch (and one "landed" event for the writer) per this many bytes
BLOCK = 2048  # int64 elements per program per iteration (16 KiB)

if triton is not None:
    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        """``dst[:n] = src[:n]``, int64 elements, a grid-stride loop over ``n``: the grid size
        (how many SMs the copy holds) is the caller's choice, not ``n``'s."""
        start = tl.program_id(0) * BLOCK
        stride = tl.num_programs(0) * BLOCK
        for lo in range(start, n, stride):
            offs = lo + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


class _HostMapping:
    """A pinned or registered host buffer as the GPU sees it: ``__cuda_array_interface__`` over
    its pointer (the same address on the device under UVA), so torch makes a CUDA tensor of it."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive as long as the CUDA tensor (torch holds this object)
        self.__cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "strides": None,
                                         "data": (host.data_ptr(), False), "version": 2}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over ``host``'s bytes (pinned or ``cudaHostRegister``-ed)."""
    return torch.as_tensor(_HostMapping(host), device=device)


def sm_copy(dst: torch.Tensor, src: torch.Tensor, programs: int) -> None:
    """Copy ``src`` into ``dst`` (uint8 CUDA tensors, sizes a multiple of 8) on the current
    stream with ``programs`` programs."""
    n = src.numel() // 8
    _copy_kernel[(programs,)](src.view(torch.int64), dst.view(torch.int64), n, BLOCK=BLOCK, num_warps=4)


class SmCopyCapture(DeviceCapture):
    """The library's capture with the copy done by ``programs`` SMs (see the module docstring)."""

    def __init__(self, device, programs: int, **kw) -> None:
        super().__init__(device, **kw)
        self.programs = programs
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def _view(self, host: torch.Tensor) -> torch.Tensor:
        key = (host.data_ptr(), host.numel())
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = device_view(host, self.device)
        return v

    def _copy(self, host, sources, read):
        side = self.stream  # the gather ran here, "read" recorded after it: no wait needed
        torch.cuda.set_stream(side)
        dst = self._view(host)
        marks, prev = [], read
        for off, source in sources:
            source.record_stream(side)
            for lo in range(0, source.numel(), SM_PIECE_BYTES):
                hi = min(lo + SM_PIECE_BYTES, source.numel())
                sm_copy(dst[off + lo: off + hi], source[lo:hi], self.programs)
                prev = torch.cuda.Event()
                prev.record(side)
                marks.append((off + hi, prev))
        return prev, marks


class _DeferredJob(_Job):
    """A capture the launcher thread lays out (records, log segment) before launching it."""

    def __init__(self, timeout: float, plan: list, num_rows: dict, land, nbytes: int, give_back) -> None:
        super().__init__(timeout, None, 0, None)
        self.plan, self.num_rows, self.land, self.nbytes, self.give_back = plan, num_rows, land, nbytes, give_back
        self.records = self.buffer = None
        self._laid_set = threading.Event()
        self._lock = threading.Lock()
        self._dropped = False  # released before it was laid out: the launcher gives its buffer back

    def set_laid_out(self, records, host, total, layout, buffer) -> None:
        with self._lock:
            self.records, self.host, self.total, self.layout, self.buffer = records, host, total, layout, buffer
            self.plan = None
        self._laid_set.set()

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.plan = None
        self._laid_set.set()

    def resolve(self):
        if not self._laid_set.wait(self.timeout):
            raise TimeoutError(f"the capture's layout was not made within {self.timeout}s: the launcher is stuck")
        if self.records is None:
            raise RuntimeError(f"laying out a commit's capture failed: {self.error}") from self.error
        return self.records, self.host, self.buffer

    def drop(self):
        """Its buffer to give back now, or None (not laid out yet: the launcher gives it back)."""
        with self._lock:
            if self.records is not None or self.error is not None:
                return self.buffer
            self._dropped = True
            return None

    def after_launch(self) -> None:
        with self._lock:
            dropped = self._dropped
        if dropped and self.buffer is not None:
            self.give_back(self.buffer)


class DeferredCapture(DeviceCapture):
    """The library's capture with its training-thread part cut to the rows' check, the choice of
    the written values, the "step done" event and the hand-over: the layout, the records and the
    log segment are the launcher thread's (:func:`deferred_capture`, :class:`PendingCapture`)."""

    def capture(self, shards, rows, num_rows, hold, land=None) -> _DeferredJob:
        _trace("start")
        written = getattr(rows, "written", None) or {}
        plan, gathers, nbytes = [], False, 0
        for name in sorted(shards):
            sd, idx = shards[name], rows.get(name)
            if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or idx.device != self.device:
                raise ValueError(f"rows[{name!r}] must be a 1-D int64 tensor on {self.device}")
            items, k = tensor_items(sd), idx.numel()
            vals = _items_written(written.get(name), items, k, self.device)
            for b in [8 * k] + [k * t.element_size() * math.prod(t.shape[1:]) for _, t in items]:
                nbytes += -(-b // ALIGN) * ALIGN  # (the data file's size: the commit's report)
            gathers = gathers or vals is None
            plan.append((name, sd, idx, items, vals))
        _trace("rows")
        job = _DeferredJob(self.timeout, plan, num_rows, land, nbytes, self._give_back)
        job.ready.record(torch.cuda.current_stream(self.device))  # the step's writes come first
        if gathers:
            hold(_PendingRead(job))
        _trace("ready")
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bench-deferred-capture", daemon=True)
                self._thread.start()
            self._cv.notify()
        _trace("handed")
        return job

    def _give_back(self, buf) -> None:
        if isinstance(buf, torch.Tensor):
            self.release(buf)
        else:
            buf.release()  # a log segment

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait(IDLE_SECONDS)
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                self._lay_out(job)
                self._launch(job)
            except BaseException as exc:  # raised where the capture is waited for (the writer, a hold)
                job.fail(exc)
            job.after_launch()

    def _lay_out(self, job: _DeferredJob) -> None:
        """As the library's capture lays a delta out on the training thread."""
        _trace("launcher_start")
        layout, off = [], 0
        for name, sd, idx, items, vals in job.plan:
            k, trs = idx.numel(), []
            for tname, t in [(INDEX, None)] + items:
                if t is None:
                    dtype, shape, row_b = "int64", [], 8
                else:
                    if t.device != self.device:
                        raise ValueError(f"table {name!r} tensor {tname!r} is on {t.device}, not {self.device}")
                    shape = list(t.shape[1:])
                    dtype, row_b = str(t.dtype).removeprefix("torch."), t.element_size() * math.prod(shape)
                trs.append((TensorRecord.model_construct(name=tname, dtype=dtype, row_shape=shape, offset=off,
                                                         nbytes=k * row_b, crc32=PENDING_CRC, algorithm="crc32"), t))
                off += -(-k * row_b // ALIGN) * ALIGN
            layout.append((name, sd, idx, trs, vals))
        total = off
        _trace("launcher_layout")
        seg = job.land(total) if job.land is not None else None
        buf = seg if seg is not None else self._acquire(total)
        host = (seg.host if seg is not None else buf)[:total]
        _trace("launcher_land")
        records = [ShardRecord.model_construct(table=name, num_rows=job.num_rows[name], start=sd.rows.start,
                                               stop=sd.rows.stop, tensors=[tr for tr, _ in trs])
                   for name, sd, _, trs, _ in layout]
        job.set_laid_out(records, host, total, layout, buf)
        _trace("launcher_records")


def _items_written(vals, items, k, device):
    """``vals`` when they are exactly the delta's tensors (as the library's ``_written_values``)."""
    if vals is None:
        return None
    for name, t in items:
        v = vals.get(name)
        if (v is None or v.device != device or v.dtype != t.dtype or v.shape[0] != k
                or v.shape[1:] != t.shape[1:] or not v.is_contiguous()):
            return None
    return vals


@dataclass(frozen=True)
class PendingCapture(Capture):
    """A :class:`Capture` whose records, bytes and buffer the launcher thread has yet to make."""

    pending: object = None

    def resolve(self) -> Capture:
        if self.pending is None:
            return self
        records, blob, buf = self.pending.resolve()
        return dataclasses.replace(self, records=records, blob=blob, buffer=buf, pending=None)

    def release(self) -> None:
        if self.pending is None:
            return super().release()
        buf = self.pending.drop()
        if buf is not None:
            self.pending.give_back(buf)


def deferred_capture(tier, step, shards, topology, num_rows, changes, device: DeferredCapture, hold) -> PendingCapture:
    """``tier.capture(..., device=device, hold=hold)`` of a delta, pending (the bench's writer
    resolves it first): the log segment, or the spare file of the pinned path, asked for by the
    launcher thread."""
    fp = topology.fingerprint()
    chain = tier._chain if tier._chain and tier._chain[0] == fp else None
    assert changes is not None and chain is not None and chain[2] < tier.max_chain, "the bench captures deltas"

    def land(nbytes):
        seg = tier._land(nbytes) if tier._ring_count else None
        if seg is None and tier.spares is not None:
            tier.spares.want(nbytes)
        return seg

    pending = device.capture(shards, changes, num_rows, hold, land=land)
    cap = PendingCapture(step, topology, None, None, chain[1], chain[2] + 1, _PendingCopy(pending), device, None,
                         True, pending=pending)
    tier._chain = (fp, CommitId(step, topology.generation, fp), chain[2] + 1)
    return cap


def _median_event_ms(fn, runs: int = 5) -> float:
    xs = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        xs.append(a.elapsed_time(b))
    return statistics.median(xs)


def sm_copy_bandwidth(device: torch.device, nbytes: int = 512 << 20,
                      grids: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 132)) -> dict:
    """GB/s of the copy engine and of the SM copy (per grid size) from device memory into pinned
    memory and into a ``cudaHostRegister``-ed mapping (flags 0, as the log ring registers), each
    checked byte for byte against the source."""
    out: dict = {"bytes": nbytes}
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    ref = src.cpu()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mm = mmap.mmap(-1, nbytes)
    reg = torch.frombuffer(mm, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(reg.data_ptr(), nbytes, 0))
    out["register_error"] = err
    targets = {"pinned": pinned} if err else {"pinned": pinned, "registered": reg}
    try:
        for name, host in targets.items():
            row: dict = {}
            host.zero_()
            row["copy_engine_gbs"] = nbytes / _median_event_ms(lambda: host.copy_(src, non_blocking=True)) / 1e6
            row["copy_engine_equal"] = bool(torch.equal(host, ref))
            try:
                dst = device_view(host, device)
            except Exception as exc:  # noqa: BLE001 (reported in the JSON, the SM modes then skipped)
                row["error"] = f"{type(exc).__name__}: {exc}"
                out[name] = row
                continue
            for g in grids:
                host.zero_()
                try:
                    ms = _median_event_ms(lambda: sm_copy(dst, src, g), runs=3)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"grid {g}: {type(exc).__name__}: {exc}"
                    break
                row[f"sm{g}_gbs"] = nbytes / ms / 1e6
                row[f"sm{g}_equal"] = bool(torch.equal(host, ref))
            out[name] = row
    finally:
        torch.cuda.synchronize()
        if not err:
            cudart.cudaHostUnregister(reg.data_ptr())
    return out  # (the mapping goes with the last view of it)



class GatherCapture(DeviceCapture):
    """The library's capture without the written values: every table gathered from the table
    (the library's path before 2026-12-02, and its path for tables written twice per commit)."""

    def capture(self, shards, rows, num_rows, hold, land=None):
        return super().capture(shards, dict(rows), num_rows, hold, land)


