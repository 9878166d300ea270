"""Capture variants that ``bench/commit_gpu.py`` measures against the library's, in one process.

Not part of the library: each is a hypothesis about the dense loop's overhead on an H200
(BENCHMARKS.md, "The device path"), measured as a mode of the bench's interleaved windows.

* :class:`SmCopyCapture`: the device-to-host copy done by a few SMs instead of the copy engine. A
  kernel with a bounded grid stores the staging buffer's bytes through the host buffer's device
  mapping (pinned and registered host memory is mapped into the GPU's address space: UVA), so the
  copy engine stays free for the training stream's small reads (``torch.unique``'s count,
  ``.item()``), which otherwise wait for the piece of the delta in flight (16 MiB, ~0.3 ms).
  The cost: the grid's SMs are busy for the whole copy, taken from the dense part's kernels.
* :class:`LeanCapture`: the launcher thread takes the next capture's log segment ahead (after
  launching this one's copy), so the training thread's commit call skips the ring's search
  (a stat of each held segment's manifest until a pruned one is found).
* :class:`GatherCapture`: the library's capture with every table gathered (the written values
  the context hands over ignored): the library's path before the written values.

:func:`sm_copy_bandwidth` measures the SM copy's bandwidth against the copy engine's for a few
grid sizes, and checks every byte.
"""

from __future__ import annotations

import mmap
import statistics
import threading

import torch

from elastic_emb.state.capture import DeviceCapture

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


class LeanCapture(DeviceCapture):
    """The library's capture, the next log segment taken by the launcher thread ahead."""

    def __init__(self, device, **kw) -> None:
        super().__init__(device, **kw)
        self._ahead = None  # a segment in flight, taken for the next capture
        self._ahead_lock = threading.Lock()
        self._land_fn = None

    def capture(self, shards, rows, num_rows, hold, land=None):
        if land is not None:
            self._land_fn = land
            with self._ahead_lock:
                ahead, self._ahead = self._ahead, None
            if ahead is not None:
                def land(nbytes, plain=land, ahead=ahead):
                    if nbytes <= ahead.size:
                        return ahead
                    ahead.release()
                    return plain(nbytes)
        return super().capture(shards, rows, num_rows, hold, land)

    def _launch(self, job) -> None:
        super()._launch(job)
        if self._land_fn is not None:
            with self._ahead_lock:
                if self._ahead is None:
                    self._ahead = self._land_fn(0)

    def drop_ahead(self) -> None:
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.release()


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


