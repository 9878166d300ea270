"""EmbContext: one generation's sharded embedding context, a communicator plus a memory arena.

This is the PyTorch counterpart of a C++ ``AsyncEmbContext``: it is built for exactly one
topology (world size and expert-parallel size), and everything in it is sized for that world.

Communicator
    A process group of its own, built directly from a backend (``ProcessGroupGloo`` or
    ``ProcessGroupNCCL``) on a store prefix private to the generation
    (:func:`elastic_emb.store.generation_store`) and to this construction or reset, with an
    explicit timeout. It is *not* the global default process group and is not registered with
    ``torch.distributed``'s global state, so two contexts (the old and the new one during a live
    reshard) can live in one process, and the user's own default group is never touched.

Arena
    One allocation per device holding every table's local rows and optimizer slots (carved into
    views, 256-byte aligned), plus staging buffers for the all-to-alls, sized from the world
    size (``staging_rows_per_rank * world_size`` rows of the widest table, each direction). A
    batch larger than the staging grows it (logged); a second lookup in flight while the
    staging is leased gets buffers of its own. :attr:`EmbContext.arena_bytes` reports the size.

Lookup (``lookup(table, ids) -> LookupHandle``)
    1. Check the ids on the host (a 1-D integer tensor); the range check comes later, free.
    2. Deduplicate without a host sync (``_dedup``): the batch is cut into ``pipeline_chunks``
       pieces (NCCL default 3), piece k's ids become keys ``k * num_rows + id`` (32-bit when
       they fit), one sort orders them by piece and then by owner (row-wise sharding is
       monotone), and the unique keys, the inverse index and the per-(owner, piece) counts come
       from a running count of first occurrences: no ``torch.unique``, whose output size costs
       a sync. The same kernels compute, per position of the batch, where its row will come
       from (the receive buffer, or this rank's shard). On CUDA these ~30 small kernels are
       captured once per (call, batch size) in a CUDA graph and replayed: launching them from
       Python cost more than running them.
    3. One count exchange, the lookup's only host synchronisation: a header per peer with the
       counts meant for it, a tag naming the call, the batch's smallest and largest id and its
       length. So
       every rank learns in that one exchange whether anyone's ids are out of range (that rank
       raises :class:`InvalidIds` naming the id, the others :class:`PeerLookupError`; nobody
       hangs) or whether ranks are in different calls (:class:`CollectiveMismatch`, instead of
       trading wrong rows). For large batches the unique keys ride in the same exchange, as the
       owner's row numbers, in a fixed-capacity block per peer behind the header; the block's
       size is one per context, grown from the headers every rank reads alike, so the exchange
       never differs in size between ranks; otherwise an id all-to-all follows.
       On CUDA the headers' copy to pinned host memory is queued behind the exchange and the
       host polls one event.
    4. Per piece, the owner gathers the rows asked of it and starts that piece's row
       all-to-all (``async_op``; the NCCL stream at high priority), so gathering piece k+1
       overlaps sending piece k. Rows a rank owns itself never enter an exchange.
    5. The result is assembled per piece in one pass: on CUDA each row, duplicates expanded,
       read from the receive buffer or straight from the shard
       (:func:`elastic_emb.gather.gather_rows`, a Triton kernel); on the CPU, where that would
       take two passes, own rows are first gathered once behind the received rows and the
       result is one index_select. On CUDA the assembly is queued at once on a stream of the context's
       own: piece k is assembled as soon as it lands, and the caller's stream is not held up
       meanwhile. ``handle.wait()`` orders the caller's stream after it (or, with a timeout,
       waits on the host). On gloo ``wait()`` completes the exchanges and assembles. A lookup
       returns the rows as they were at ``lookup()``: writes to the shard first settle lookups
       in flight.
    Every collective is issued inside ``lookup`` in program order, so handles may be waited in
    any order on any rank without mismatching collectives. A world of one rank skips all of it:
    a lookup is then a plain gather.

Gradients (``apply_gradients(table, ids, grads)``, collective)
    Duplicates are summed locally, unique rows and their summed gradients travel to the owners
    (all-to-all), the owner sums again across senders and applies the optimizer
    (:mod:`elastic_emb.optim`) to unique rows.

Lifecycle
    ``reset(rank, world_size)`` re-forms the communicator for the same world size on a fresh
    store prefix; if the rank mapping changed, local shards are moved to their new owner over
    the new communicator so the table is kept. A different world size raises
    :class:`WorldSizeChanged`. ``close()`` is idempotent: gloo shuts down; NCCL destroys when
    healthy and aborts when not (bounded by the timeout, in a thread), see FACTS "NCCL
    pitfalls". ``close(wait=False)``, what the lifecycle does on a resize, leaves that destroy to
    a background thread while the next context forms (:func:`wait_releases`). Anything after
    ``close`` raises :class:`ContextClosed`.

NCCL settings
    The first NCCL context of a process sets ``NCCL_CUMEM_ENABLE=0`` unless the environment
    sets it (:data:`NCCL_DEFAULTS`): with cuMem buffers a new communicator took 0.38 s to
    connect and 0.41 s to destroy on 2 H200s, without them 0.09 s and 0.10 s, at equal
    bandwidth (bench/nccl_setup.py).

Resharding
    ``export_shard`` / ``import_shard`` hand the local rows and slots with their global row
    range to the lifecycle layer. ``state_dict`` exposes them as DTensors (``Shard(0)`` over the
    owner ranks, zero-copy views of the arena) that ``torch.distributed.checkpoint`` saves at
    one world size and loads at another; see :meth:`EmbContext.state_dict` for the mesh.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
import zlib
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb import optim
from elastic_emb.errors import ContextClosed, ElasticEmbError, WorldSizeChanged
from elastic_emb.events import get_logger
from elastic_emb.gather import gather_rows
from elastic_emb.protocol import ContextBase, OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import RowRange, owned_range, rows_per_owner
from elastic_emb.store import generation_store
from elastic_emb.topology import Topology, is_power_of_two

__all__ = [
    "EmbContext",
    "LookupHandle",
    "InvalidIds",
    "PeerLookupError",
    "CommunicationError",
    "CollectiveMismatch",
    "init_rows",
    "INIT_BLOCK_ROWS",
    "wait_releases",
    "apply_nccl_defaults",
]

log = get_logger("elastic_emb.context")

# init_rows draws each block of this many global rows from its own generator, so a row's
# initial value depends only on (seed, table name, row), never on who owns it.
INIT_BLOCK_ROWS = 4096
_ALIGN = 256
_INT32_MAX = 2**31 - 1
_POISON = -1
# Pipeline pieces per lookup at most. The count exchange always carries this many counts (plus
# the call tag) per peer, so two ranks in different calls still exchange equal byte counts and
# can tell each other so, instead of corrupting the transport (gloo aborts on a size mismatch).
_MAX_CHUNKS = 16
# A count-exchange header per peer, int64: counts per piece, the call tag, the batch's lo and hi
# id, its length, and the exchange block this call would like (bytes; see EmbContext._block_bytes).
_HEADER_WIDTH = _MAX_CHUNKS + 5
_H_TAG, _H_LO, _H_HI, _H_LEN, _H_WANT = range(_MAX_CHUNKS, _MAX_CHUNKS + 5)


def _header_words(key_dtype: torch.dtype) -> int:
    """How many elements of ``key_dtype`` one header takes in the fused count + id buffer."""
    return _HEADER_WIDTH * (8 // torch.empty((), dtype=key_dtype).element_size())


# NCCL settings elastic_emb applies when the user has not set them (os.environ.setdefault), before
# the process's first communicator: NCCL reads them once per process.
#   NCCL_CUMEM_ENABLE=0: with cuMem buffers (NCCL's default since 2.19) a new communicator's first
#   all-reduce and all-to-all took 0.15 + 0.20 s to connect on 2 H200s and its destroy 0.41 s;
#   with plain device buffers 0.00 + 0.02 s and 0.10 s, at the same all-to-all bandwidth
#   (bench/nccl_setup.py, BENCHMARKS.md). A resize destroys and builds a communicator, so this is
#   most of its cost. Set NCCL_CUMEM_ENABLE=1 yourself where cuMem is required (multi-node NVLink,
#   NVLS multicast).
NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}
_nccl_defaults_applied = False


def apply_nccl_defaults() -> dict[str, str]:
    """Set :data:`NCCL_DEFAULTS` where the environment does not; returns what was set. Called by
    the first NCCL context of the process (it must precede the process's first NCCL
    communicator to take effect); callers that create NCCL communicators of their own earlier
    can call it first."""
    global _nccl_defaults_applied
    applied = {}
    for key, value in NCCL_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    if not _nccl_defaults_applied:
        _nccl_defaults_applied = True
        log.info("context.nccl_env", set_by_elastic_emb=applied,
                 effective={k: os.environ.get(k) for k in NCCL_DEFAULTS})
    return applied


class InvalidIds(ElasticEmbError, IndexError):
    """ids passed to lookup/apply_gradients are not a 1-D integer tensor of rows in range."""


class PeerLookupError(ElasticEmbError, RuntimeError):
    """Another rank passed invalid ids to the same collective call; this call was cancelled on
    every rank (the communicator stays usable)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CommunicationError(ElasticEmbError, RuntimeError):
    """A collective of the context failed or timed out; the context is now unhealthy."""


class CollectiveMismatch(ElasticEmbError, RuntimeError):
    """Ranks made different calls at the same point (say ``lookup('a')`` on one rank and
    ``apply_gradients('a')`` or ``lookup('b')`` on another). Detected in the count exchange, on
    every rank, before any id or row moves; the context stays usable."""


# ---------------------------------------------------------------------------------------------
# Deterministic initial rows
# ---------------------------------------------------------------------------------------------


def init_rows(spec: TableSpec, seed: int, rows: RowRange) -> torch.Tensor:
    """Initial values of global rows ``rows`` of ``spec``: uniform in ``±1/sqrt(dim)``.

    Identical whatever the world size: every block of :data:`INIT_BLOCK_ROWS` global rows is
    drawn from a CPU generator seeded with ``(seed, crc32(table name), block)``, and a range is
    cut out of the blocks it touches.
    """
    out = torch.empty(len(rows), spec.dim, dtype=spec.torch_dtype)
    if not len(rows):
        return out
    if rows.stop > spec.num_rows:
        raise ValueError(f"rows [{rows.start}, {rows.stop}) exceed table {spec.name!r} of {spec.num_rows} rows")
    bound = 1.0 / (spec.dim**0.5)
    name_hash = zlib.crc32(spec.name.encode())
    gen = torch.Generator()
    first, last = rows.start // INIT_BLOCK_ROWS, (rows.stop - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1):
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, spec.num_rows)
        gen.manual_seed((seed * 1_000_003 + name_hash) * 1_000_033 + block & 0x7FFF_FFFF_FFFF_FFFF)
        vals = torch.rand(b1 - b0, spec.dim, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)
        lo, hi = max(b0, rows.start), min(b1, rows.stop)
        out[lo - rows.start : hi - rows.start] = vals[lo - b0 : hi - b0].to(spec.torch_dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Arena
# ---------------------------------------------------------------------------------------------


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _carve(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buf[offset : offset + nbytes].view(dtype).view(shape)


class _Arena:
    """One device allocation: resident rows + slots per table; staging kept beside it."""

    def __init__(self, device: torch.device, layout: dict[str, tuple[int, TableSpec, dict]], staging_bytes: int):
        self.device = device
        plan: list[tuple[str, str, tuple[int, ...], torch.dtype, int]] = []
        offset = 0
        for name, (nrows, spec, slot_shapes) in layout.items():
            plan.append((name, "weight", (nrows, spec.dim), spec.torch_dtype, offset))
            offset += _aligned(nrows * spec.bytes_per_row())
            for slot, (shape, dtype) in slot_shapes.items():
                full = (nrows, *shape)
                plan.append((name, slot, full, dtype, offset))
                numel = nrows
                for s in shape:
                    numel *= s
                offset += _aligned(numel * torch.empty((), dtype=dtype).element_size())
        self.resident_bytes = offset
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self.weights: dict[str, torch.Tensor] = {}
        self.slots: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layout}
        for name, what, shape, dtype, off in plan:
            view = _carve(self.buffer, off, shape, dtype)
            if what == "weight":
                self.weights[name] = view
            else:
                self.slots[name][what] = view
        self.staging = torch.empty(max(staging_bytes, 1), dtype=torch.uint8, device=device)
        self._leased = False
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() + self.staging.numel()

    def lease(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A byte buffer of at least ``nbytes``: the staging if free (grown if too small), else
        a fresh allocation. Returns (buffer, leased)."""
        with self._lock:
            if self._leased:
                return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device), False
            if self.staging.numel() < nbytes:
                grown = max(nbytes, 2 * self.staging.numel())
                log.info("arena.staging_grown", old_bytes=self.staging.numel(), new_bytes=grown)
                self.staging = torch.empty(grown, dtype=torch.uint8, device=self.device)
            self._leased = True
            return self.staging, True

    def release(self) -> None:
        with self._lock:
            self._leased = False


class _Staging:
    """Carves consecutive typed views out of a leased byte buffer."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.offset = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        view = _carve(self.buf, self.offset, shape, dtype)
        self.offset += _aligned(view.numel() * view.element_size())
        return view


def _staging_need(counts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    total = 0
    for shape, dtype in counts:
        numel = 1
        for s in shape:
            numel *= s
        total += _aligned(numel * torch.empty((), dtype=dtype).element_size())
    return total


# Contexts not yet closed: closed at interpreter exit, before torch's own teardown, so that no
# communicator is destroyed by static destructors (gloo then aborts the process).
_OPEN: "weakref.WeakSet[EmbContext]" = weakref.WeakSet()


@atexit.register
def _close_open_contexts() -> None:
    for ctx in list(_OPEN):
        try:
            ctx.close()
        except Exception:
            pass
    # Communicators still being released in the background: let them finish before torch's
    # own teardown (bounded by their timeouts).
    wait_releases()


class _Release:
    """Destroy or abort one communicator, bounded: a destroy still running after ``timeout``
    means a peer is gone, and is followed by an abort (FACTS: NCCL pitfalls); an abort still
    running after another ``timeout`` is reported and left to the process's exit."""

    def __init__(self, pg, method: str, timeout: float, log_, keep=None):
        self.pg, self.method, self.timeout, self._log, self._keep = pg, method, timeout, log_, keep
        self.thread: threading.Thread | None = None
        self.error: str | None = None
        self.seconds: float | None = None
        self.done = threading.Event()

    def _call(self, method: str) -> bool:
        def target() -> None:
            try:
                getattr(self.pg, method)()
            except Exception as exc:  # reported, not swallowed silently
                self.error = f"{method}: {exc}"
                self._log.warning("context.group_release_failed", method=method, error=str(exc))

        t = threading.Thread(target=target, name=f"elastic_emb-{method}", daemon=True)
        t.start()
        t.join(self.timeout)
        return not t.is_alive()

    def run(self) -> None:
        started = time.monotonic()
        try:
            finished = self._call(self.method)
            if not finished:
                self._log.error("context.group_release_timeout", method=self.method, timeout=self.timeout)
                self.error = f"{self.method} did not finish within {self.timeout}s"
                if self.method == "shutdown" and self._call("abort"):
                    self.error += "; aborted instead"
            self.seconds = time.monotonic() - started
            self._log.info("context.group_released", method=self.method, seconds=round(self.seconds, 4),
                           error=self.error)
        finally:
            self.pg = self._keep = None
            self.done.set()

    def start(self) -> None:
        with _RELEASES_LOCK:
            _RELEASES.append(self)
        self.thread = threading.Thread(target=self.run, name="elastic_emb-release", daemon=True)
        self.thread.start()


_RELEASES: list[_Release] = []
_RELEASES_LOCK = threading.Lock()


def wait_releases(timeout: float | None = None) -> list[dict]:
    """Wait for the communicators that ``close(wait=False)`` handed to background threads, at
    most ``timeout`` seconds in all (default: each release's own bound, twice the context's
    timeout). Returns one record per release: method, seconds, error (None when clean), done."""
    with _RELEASES_LOCK:
        pending = list(_RELEASES)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for r in pending:
        left = 2 * r.timeout + 1 if deadline is None else max(0.0, deadline - time.monotonic())
        finished = r.done.wait(left)
        out.append({"method": r.method, "seconds": r.seconds, "error": r.error, "done": finished})
        if finished:
            with _RELEASES_LOCK:
                if r in _RELEASES:
                    _RELEASES.remove(r)
    return out


def _poll(ready, timeout: float) -> bool:
    """Call ``ready()`` until it is true (True) or ``timeout`` seconds pass (False): yield the
    core between calls for the first ~2000, then sleep 0.2 ms, so a wait of a few ms is noticed
    at once and a long one does not burn a core."""
    deadline = time.monotonic() + timeout
    spins = 0
    while not ready():
        if time.monotonic() > deadline:
            return False
        spins += 1
        time.sleep(0 if spins < 2000 else 0.0002)
    return True


# Batches at least this long have their dedup kernels replayed from a CUDA graph; at most this
# many graphs (call x batch size) are kept per context.
_CAPTURE_MIN_IDS = 16384
_MAX_GRAPHS = 8
# A large-batch lookup asks for its ids to ride in the count exchange when the fixed-capacity
# buffer (both directions) is at most this big; bigger worlds or batches exchange the ids after
# the counts.
_FUSED_MAX_BYTES = 64 << 20


class _DedupGraph:
    """The dedup kernels of one (call, batch size) captured in a CUDA graph, with static input
    and outputs. A replay overwrites the outputs, so it first orders the stream after the last
    lookup that read them (``last_done``: recorded once that lookup has computed its positions,
    the last use of the outputs)."""

    def __init__(self, ctx: "EmbContext", spec: TableSpec, n: int, chunks: int, tag: int, block: int):
        dev = ctx.device
        self.inputs = ctx._dedup_inputs(spec, n, chunks, tag, block)  # held: the graph reads their memory
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        current = torch.cuda.current_stream(dev)
        warm = torch.cuda.Stream(device=dev)
        warm.wait_stream(current)
        with torch.cuda.stream(warm):  # first run outside capture: library workspaces get allocated
            ctx._dedup_compute(spec, self.ids, chunks, *self.inputs)
        current.wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = ctx._dedup_compute(spec, self.ids, chunks, *self.inputs)
        self.last_done: torch.cuda.Event | None = None

    def replay(self, ids: torch.Tensor) -> tuple:
        current = torch.cuda.current_stream(ids.device)
        if self.last_done is not None:
            current.wait_event(self.last_done)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.out


# ---------------------------------------------------------------------------------------------
# Lookup handle
# ---------------------------------------------------------------------------------------------


class LookupHandle:
    """An in-flight lookup. ``wait()`` completes the row exchanges and returns the rows in the
    order of the ids passed to ``lookup``. Waiting twice returns the same tensor.

    Holds one work object per pipeline piece, the receive buffer of the received rows and, per
    position of the batch, where its row is (``pos``: >= 0 in the receive buffer, < 0 in the
    shard, from its end) (or a finished result, for a world of one rank); ``bounds`` are the
    pieces' positions in the ids.

    On CUDA the assembly is queued at once, by :meth:`_reorder_on_side_stream`, on a stream of
    the context's own: piece k is assembled as soon as its exchange lands, while later pieces
    are still on the wire, whenever the caller gets round to ``wait()``; and the caller's
    stream is not held up meanwhile (it could run the dense part of the model). ``wait()``
    then orders the caller's stream after that work. On the CPU (gloo) ``wait()`` assembles."""

    def __init__(self, ctx: "EmbContext", table: str, works, recv_rows, pos, leased: bool,
                 keep: tuple = (), bounds: list[int] | None = None, own_in_recv: bool = False):
        self._ctx = ctx
        self._table = table
        self._works = works
        self._recv = recv_rows
        self._pos = pos
        self._own_in_recv = own_in_recv  # CPU: own rows already copied behind the received ones
        self._bounds = bounds
        self._leased = leased
        self._keep = keep  # send buffers must outlive the exchange
        self._result: torch.Tensor | None = None if bounds is not None else recv_rows
        self._queued: tuple[torch.Tensor, torch.cuda.Event] | None = None  # (result, done) on CUDA
        self._delivered = False  # wait() returned the rows once: later waits return them again
        if works:
            ctx._pending.add(self)

    @property
    def done(self) -> bool:
        return self._result is not None

    def _empty_result(self) -> torch.Tensor:
        spec = self._ctx.tables[self._table]
        return torch.empty(self._bounds[-1], spec.dim, dtype=spec.torch_dtype, device=self._ctx.device)

    def _reorder(self, k: int, result: torch.Tensor) -> None:
        """Piece k's rows into the caller's order (duplicates expanded), in ``result``: received
        rows from the receive buffer, this rank's own straight from its shard."""
        lo, hi = self._bounds[k], self._bounds[k + 1]
        if hi <= lo:
            return
        if self._own_in_recv:
            torch.index_select(self._recv, 0, self._pos[lo:hi], out=result[lo:hi])
        else:
            gather_rows(result[lo:hi], self._ctx._arena.weights[self._table], self._recv, self._pos[lo:hi])

    def _reorder_on_side_stream(self, ready, result: torch.Tensor) -> None:
        """``ready``: an event on the caller's stream after the positions are computed and
        ``result`` allocated."""
        ctx = self._ctx
        side = ctx._side_stream()
        with torch.cuda.stream(side):
            side.wait_event(ready)
            for k, work in enumerate(self._works):
                work.wait()  # orders this stream after the exchange of piece k; does not block the host
                self._reorder(k, result)
            done = torch.cuda.Event()
            done.record(side)
        # Made on the caller's stream, used on the side stream: tell the allocator.
        for t in (result, self._recv, self._pos):
            t.record_stream(side)
        self._queued = (result, done)

    def _drain(self, timeout: float) -> None:
        """Complete the exchanges without producing a result (the context is closing): a
        communicator must not be torn down under a collective its peers are still in."""
        for work in self._works:
            try:
                work.wait(timedelta(seconds=timeout)) if self._ctx.topology.backend != "nccl" else work.wait()
            except Exception as exc:  # the context is going away; report, do not raise
                self._ctx._log.warning("context.pending_lookup_failed", table=self._table, error=str(exc)[:200])
                break
        if self._queued is not None:
            torch.cuda.current_stream(self._ctx.device).wait_event(self._queued[1])
        self._works = []

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows, ``[len(ids), dim]``. Without ``timeout`` on CUDA this only orders the
        caller's stream after the lookup (CUDA semantics: the rows are ready for any later work
        on that stream); with ``timeout`` the host waits until they are ready, at most that long,
        and raises :class:`CommunicationError` past it."""
        if self._delivered:
            return self._result  # type: ignore[return-value]
        ctx = self._ctx
        if ctx.closed:
            # Also for a one-rank world, whose rows were gathered at lookup time: a handle not
            # waited on before close() behaves the same whatever the world size.
            raise ContextClosed(
                f"lookup of table {self._table!r} was waited on after its context "
                f"(generation {ctx.topology.generation}) was closed; look up again on the new context"
            )
        if self._result is not None:  # a one-rank world gathered the rows at lookup time
            self._delivered = True
            return self._result
        what = f"lookup({self._table!r}) row exchange"
        try:
            if self._queued is not None:
                result, done = self._queued
                if timeout is not None:
                    ctx._wait_event(done, timeout, what)
                torch.cuda.current_stream(ctx.device).wait_event(done)
            else:
                result = self._empty_result()
                for k, work in enumerate(self._works):
                    ctx._wait(work, timeout, what, host=timeout is not None)
                    self._reorder(k, result)
            self._result = result
        finally:
            if self._leased:
                ctx._arena_release()
                self._leased = False
            self._works = []
            self._keep = ()
            self._queued = None
            ctx._pending.discard(self)
        self._delivered = True
        return self._result

    def _settle(self) -> None:
        """The context is about to write rows while this lookup is in flight. On CUDA the lookup
        reads the rows its own rank owns from the shard when it assembles the result, so the
        caller's stream waits for that assembly (no host wait): a lookup returns the rows as
        they were when ``lookup()`` was called. The CPU path copied them at ``lookup()``."""
        if self._queued is not None:
            torch.cuda.current_stream(self._ctx.device).wait_event(self._queued[1])


# ---------------------------------------------------------------------------------------------
# The context
# ---------------------------------------------------------------------------------------------


class EmbContext(ContextBase):
    """A sharded embedding context for one topology. See the module docstring."""

    def __init__(
        self,
        topology: Topology,
        store: dist.Store,
        *,
        tables: Sequence[TableSpec],
        optimizer: OptimizerSpec = OptimizerSpec(),
        device: torch.device | str | None = None,
        timeout: float = 60.0,
        require_power_of_two: bool = True,
        seed: int | None = 0,
        staging_rows_per_rank: int = 4096,
        pipeline_chunks: int | None = None,
        high_priority_stream: bool | None = None,
        capture_dedup: bool = True,
    ) -> None:
        started = time.monotonic()
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        if not tables:
            raise ValueError("tables is empty: an EmbContext needs at least one TableSpec")
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"table names {dup} appear more than once in tables; names must be unique")
        if staging_rows_per_rank < 0:
            raise ValueError(f"staging_rows_per_rank={staging_rows_per_rank} must be >= 0")
        if pipeline_chunks is None:
            # NCCL: overlap gathers and reorders with the row exchanges (separate streams).
            # Gloo: a CPU process does one thing at a time, pieces would only add round trips.
            # Three pieces: bench/lookup.py on 2 H200s measured 0.45 / 0.46 / 0.46 of the
            # all-to-all ceiling for 2 / 3 / 4 pieces (1M ids per rank); fewer pieces launch less.
            pipeline_chunks = 3 if topology.backend == "nccl" else 1
        if not 1 <= pipeline_chunks <= _MAX_CHUNKS:
            raise ValueError(f"pipeline_chunks={pipeline_chunks} must be in [1, {_MAX_CHUNKS}]")
        self.pipeline_chunks = pipeline_chunks
        # NCCL: the exchanges' kernels go first when they compete with gathers and reorders for
        # the GPU (bench/lookup.py: 0.36 -> 0.43 of the all-to-all ceiling in 4 pieces).
        self.high_priority_stream = topology.backend == "nccl" if high_priority_stream is None else bool(high_priority_stream)
        self._check_ep(topology, require_power_of_two)
        self.topology = topology
        self.tables: dict[str, TableSpec] = {t.name: t for t in tables}
        self.optimizer = optimizer
        self.timeout = float(timeout)
        self.require_power_of_two = require_power_of_two
        self.seed = seed
        self.staging_rows_per_rank = staging_rows_per_rank
        self.device = self._pick_device(topology, device)
        self._base_store = store
        self._closed = False
        self._healthy = True
        self._key_bounds_cache: dict = {}  # owner boundaries per (table, pieces, key dtype)
        self._headers: dict = {}  # count-exchange header templates per call tag
        self._host_headers: dict = {}  # CUDA: pinned host copies of the headers, per shape
        self._offsets: tuple | None = None  # piece offsets of the last batch size
        self._side: torch.cuda.Stream | None = None  # NCCL: where lookups reorder (see LookupHandle)
        self.capture_dedup = bool(capture_dedup)  # CUDA: replay the dedup kernels from a graph
        self._graphs: dict = {}  # (call tag, batch size, block bytes) -> _DedupGraph
        # Bytes per peer of every count exchange (0: the header alone). Grown from what large
        # lookups ask for in their headers, so every rank derives the same value (see _dedup).
        self._block_bytes = 0
        self._fused_lookups = 0  # lookups whose ids came with the counts (tests, benchmarks)
        self._capture_failed: str | None = None
        self._pending: weakref.WeakSet[LookupHandle] = weakref.WeakSet()
        self._log = log.bind(run_id=topology.run_id, generation=topology.generation, rank=topology.rank)
        self.process_group, self._backend = self._form_group(topology, store)
        self._arena = self._allocate(topology)
        # Rows are initialised lazily: a context built for a resize has its rows overwritten by
        # the restore at once, and seeding them first cost 13 s per rank for 2M x 128 rows on the
        # GPU machine. The first use that reads rows fills them (_materialise); import_shard and
        # mark_restored() (after a restore wrote every row through shard_views) skip the fill.
        self._uninitialised: set[str] = set(self.tables)
        for name in self.tables:
            optim.init_slots(self.optimizer, self._arena.slots[name])
        _OPEN.add(self)
        self._log.info(
            "context.constructed",
            world_size=topology.world_size,
            ep_size=topology.ep_size,
            backend=topology.backend,
            device=str(self.device),
            tables=len(self.tables),
            arena_bytes=self.arena_bytes,
            resident_bytes=self._arena.resident_bytes,
            seconds=round(time.monotonic() - started, 4),
        )

    # -- properties -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._closed

    @property
    def arena_bytes(self) -> int:
        """Bytes the arena holds on the device now (resident rows and slots + staging)."""
        return 0 if self._closed else self._arena.nbytes

    def arena_report(self) -> dict:
        """Sizes of the arena's parts, for logs and benchmarks."""
        self._check_open("arena_report")
        a = self._arena
        return {
            "device": str(self.device),
            "resident_bytes": a.resident_bytes,
            "staging_bytes": a.staging.numel(),
            "total_bytes": a.nbytes,
            "tables": {
                n: {"local_rows": a.weights[n].shape[0], "rows": [self.owned(n).start, self.owned(n).stop]}
                for n in self.tables
            },
        }

    def owned(self, table: str) -> RowRange:
        """The global rows of ``table`` this rank owns (empty on ranks >= ep_size)."""
        spec = self._spec(table)
        return owned_range(spec.num_rows, self.topology.ep_size, self.topology.rank)

    # -- construction helpers -----------------------------------------------------------------

    @staticmethod
    def _check_ep(topology: Topology, require_power_of_two: bool) -> None:
        ep = topology.ep_size
        if ep < 1 or ep > topology.world_size:
            raise ValueError(f"ep_size={ep} must be in [1, world_size={topology.world_size}]")
        if require_power_of_two and not is_power_of_two(ep):
            raise ValueError(
                f"ep_size={ep} is not a power of two; set ELASTIC_EMB_EP_SIZE to a power of two "
                f"(1, 2, 4, ...) or construct with require_power_of_two=False"
            )

    @staticmethod
    def _pick_device(topology: Topology, device) -> torch.device:
        if device is not None:
            dev = torch.device(device)
        elif topology.backend == "nccl":
            dev = torch.device("cuda", topology.local_rank)
        else:
            dev = torch.device("cpu")
        if topology.backend == "nccl" and dev.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA device, got device={dev}; use backend 'gloo' on CPU")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={dev} but CUDA is not available; use backend 'gloo' and device 'cpu'")
            if dev.index is None:
                dev = torch.device("cuda", topology.local_rank % torch.cuda.device_count())
        return dev

    def _form_group(self, topology: Topology, store: dist.Store):
        """A process group private to this context, on a fresh prefix of the generation's keys.

        Each rank counts its own constructions/resets within the generation; the k-th one on
        every rank pairs with the k-th on the others, so re-forming never reuses keys (FACTS:
        reused keys hang)."""
        started = time.monotonic()
        gen_store = generation_store(store, topology, "ctx")
        instance = int(gen_store.add(f"instances/rank{topology.rank}", 1))
        pg_store = dist.PrefixStore(f"pg{instance}/", gen_store)
        timeout = timedelta(seconds=self.timeout)
        rank, size = topology.rank, topology.world_size
        try:
            if topology.backend == "gloo":
                backend = dist.ProcessGroupGloo(pg_store, rank, size, timeout)
                backend._set_sequence_number_for_group()
                pg = dist.ProcessGroup(pg_store, rank, size)
                pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
                pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
                if torch.cuda.is_available():
                    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
            else:
                apply_nccl_defaults()
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                opts.is_high_priority_stream = self.high_priority_stream
                backend = dist.ProcessGroupNCCL(pg_store, rank, size, opts)
                backend._set_sequence_number_for_group()
                torch.cuda.set_device(self.device)
                backend.eager_connect_single_device(self.device)
                pg = dist.ProcessGroup(pg_store, rank, size)
                pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
                pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        except Exception as exc:
            raise CommunicationError(
                f"could not form the {topology.backend} process group of rank {rank}/{size} "
                f"(run {topology.run_id!r} generation {topology.generation}, instance {instance}) within "
                f"{self.timeout}s: {exc}. Check that every rank constructs the context"
            ) from exc
        pg._set_group_name(f"elastic_emb.{topology.run_id}.gen{topology.generation}.{instance}")
        # The first collective connects; do it now so construction fails here, not in a lookup.
        probe = torch.ones(1, device=self.device)
        self._wait(pg.allreduce([probe]), None, "construction probe")
        if int(probe.item()) != size:
            raise CommunicationError(f"construction probe summed to {probe.item()}, expected {size}")
        if topology.backend == "nccl" and size > 1:
            # NCCL sets up the point-to-point connections an all-to-all needs only at the first
            # all-to-all (the all-reduce above uses other channels): ~0.2 s on 2 H200s, which the
            # first lookup or the live reshard would otherwise pay. Pay it in construction.
            ids = torch.arange(size, dtype=torch.int64, device=self.device)
            got = torch.empty_like(ids)
            self._wait(pg.alltoall_base(got, ids, [1] * size, [1] * size, dist.AllToAllOptions()), None,
                       "construction all-to-all probe")
            if got.tolist() != [rank] * size:
                raise CommunicationError(f"construction all-to-all probe returned {got.tolist()}, expected {[rank] * size}")
        self._log.info("context.group_formed", instance=instance, seconds=round(time.monotonic() - started, 4))
        return pg, backend

    def _allocate(self, topology: Topology) -> _Arena:
        layout = {}
        for name, spec in self.tables.items():
            nrows = len(owned_range(spec.num_rows, topology.ep_size, topology.rank))
            layout[name] = (nrows, spec, optim.slot_shapes(self.optimizer, spec.dim))
        widest = max(s.bytes_per_row() for s in self.tables.values())
        cap = self.staging_rows_per_rank * topology.world_size
        # each direction: rows + ids (int64)
        staging = 2 * _aligned(cap * (widest + 8))
        return _Arena(self.device, layout, staging)

    def _materialise(self) -> None:
        """Fill the rows of every table not yet initialised: seeded (``init_rows``) or zeros."""
        if not self._uninitialised:
            return
        a = self._arena
        for name in sorted(self._uninitialised):
            if self.seed is None:
                a.weights[name].zero_()
            else:
                a.weights[name].copy_(init_rows(self.tables[name], self.seed, self.owned(name)))
        self._uninitialised.clear()

    def mark_restored(self) -> None:
        """Declare that every row of every table was written through :meth:`shard_views` (a
        restore did it), so the lazy initial fill is skipped."""
        self._check_open("mark_restored")
        self._uninitialised.clear()

    # -- checks -------------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosed(
                f"{what} on a closed EmbContext (run {self.topology.run_id!r} generation "
                f"{self.topology.generation}, world size {self.topology.world_size}); construct a new context"
            )

    def _spec(self, table: str) -> TableSpec:
        try:
            return self.tables[table]
        except KeyError:
            raise KeyError(f"unknown table {table!r}; this context holds {sorted(self.tables)}") from None

    def _check_ids(self, ids) -> tuple[torch.Tensor | None, str | None]:
        """Host-side checks (type, shape, dtype): (ids as int64 on the device, None) or (None, reason).
        The range check is done on the device (:meth:`_dedup`) or by :meth:`_validate_ids`."""
        if not isinstance(ids, torch.Tensor):
            return None, f"ids must be a torch.Tensor, got {type(ids).__name__}"
        if ids.dim() != 1:
            return None, f"ids must be 1-D, got shape {tuple(ids.shape)}"
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            return None, f"ids must be an integer tensor, got dtype {ids.dtype}"
        return ids.to(device=self.device, dtype=torch.int64), None

    @staticmethod
    def _range_error(spec: TableSpec, lo: int, hi: int) -> str | None:
        if lo >= 0 and hi < spec.num_rows:
            return None
        bad = lo if lo < 0 else hi
        return (f"id {bad} is out of range for table {spec.name!r} of {spec.num_rows} rows "
                f"(valid ids are 0..{spec.num_rows - 1})")

    def _validate_ids(self, spec: TableSpec, ids) -> tuple[torch.Tensor | None, str | None]:
        """Host checks plus the range check, which costs one device sync (a one-rank world has
        no count exchange to fold it into)."""
        ids, reason = self._check_ids(ids)
        if ids is None or not ids.numel():
            return ids, reason
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()
        reason = self._range_error(spec, lo, hi)
        return (None, reason) if reason else (ids, None)

    # -- communication ------------------------------------------------------------------------

    def _wait(self, work, timeout: float | None, what: str, host: bool = True) -> None:
        """Complete ``work`` within ``timeout`` (default: the context's).

        Gloo: ``Work.wait(timeout)`` blocks on a condition variable. NCCL: ``Work.wait(timeout)``
        polls with 10 ms sleeps (ProcessGroupNCCL's kSynchronizeBusyWaitMillis), far too coarse
        for a lookup of a few ms, so the host polls ``is_completed()`` itself with short sleeps
        when it needs the result (``host=True``), and otherwise only orders the current stream
        after the collective (``host=False``; the communicator's own timeout still bounds it).
        """
        t = self.timeout if timeout is None else timeout
        try:
            if self.topology.backend != "nccl":
                ok = work.wait(timedelta(seconds=t))
            else:
                ok = _poll(work.is_completed, t) if host else True
                if ok:
                    work.wait()
        except Exception as exc:
            self._healthy = False
            raise CommunicationError(
                f"{what} failed on rank {self.topology.rank} (generation {self.topology.generation}): {exc}. "
                f"A peer died or is stuck; close this context and let the lifecycle re-form the world"
            ) from exc
        if ok is False:
            raise self._timed_out(what, t)

    def _timed_out(self, what: str, t: float) -> CommunicationError:
        self._healthy = False
        return CommunicationError(
            f"{what} timed out after {t}s on rank {self.topology.rank} (generation "
            f"{self.topology.generation}): a peer is stuck or gone; close this context (it aborts) and "
            f"let the lifecycle re-form the world"
        )

    def _side_stream(self) -> "torch.cuda.Stream":
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def _wait_event(self, event, timeout: float, what: str) -> None:
        """Poll a CUDA event until done, at most ``timeout`` seconds (host side)."""
        if not _poll(event.query, timeout):
            raise self._timed_out(what, timeout)

    def _arena_release(self) -> None:
        if self._arena is not None:
            self._arena.release()

    def _alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        try:
            return self.process_group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
        except Exception as exc:
            self._healthy = False
            raise CommunicationError(f"all-to-all failed on rank {self.topology.rank}: {exc}") from exc

    _OPS = {1: "lookup", 2: "apply_gradients"}

    def _tag(self, op: int, table: str, chunks: int = 1) -> int:
        """Identifies a call (operation, table, pipeline chunks) so the count exchange can prove
        that every rank is in the same call."""
        names = sorted(self.tables)
        idx = names.index(table) if table in self.tables else (1 << 20) - 1
        return (chunks << 40) | (op << 20) | idx

    def _describe_tag(self, tag: int) -> str:
        names = sorted(self.tables)
        chunks, rest = divmod(tag, 1 << 40)
        op, idx = divmod(rest, 1 << 20)
        table = names[idx] if idx < len(names) else "<unknown table>"
        return f"{self._OPS.get(op, f'op{op}')}({table!r}) in {chunks} chunk(s)"

    def _header_template(self, tag: int) -> torch.Tensor:
        """``[2, world, width]`` int64: row 0 the headers to send (counts, tag, lo, hi, length,
        wanted block per peer), row 1 where the peers' land; one buffer, so one copy to the host
        reads both."""
        template = self._headers.get(tag)
        if template is None:
            world = self.topology.world_size
            template = torch.zeros(2, world, _HEADER_WIDTH, dtype=torch.int64)
            template[0, :, _H_TAG] = tag
            template = self._headers[tag] = template.to(self.device)
        return template

    def _exchange_counts(self, hdr: torch.Tensor, chunks: int, what: str, tag: int,
                         spec: TableSpec | None = None, xbuf: torch.Tensor | None = None
                         ) -> tuple[list[list[int]], list[list[int]], int]:
        """All-to-all of a header per peer (``hdr[0]``, see :meth:`_header_template`): the
        counts ``[world, chunks]`` meant for it, the call tag, the smallest and largest id of
        the sender's batch, its length and the block it wants. Returns (sent, received) as
        ``[peer][chunk]`` lists and the longest batch of any rank; one device sync reads
        everything.

        While :attr:`_block_bytes` is 0 the headers travel alone; after that every exchange
        sends a block of that many bytes per peer (``xbuf``, int64 words, header first), so that
        ranks in different calls still exchange equal byte counts. Every rank then grows the
        block from the same headers, before any error is raised, so all keep the same size.

        The ids are range-checked here, on the host, from the headers (no sync of its own): the
        rank whose ids are out of ``spec``'s range raises :class:`InvalidIds` naming the id, its
        peers raise :class:`PeerLookupError`; a count of -1 (poison, sent by :meth:`_cancel`)
        means the sender failed before counting; a rank in a different call gives
        :class:`CollectiveMismatch`. All of it happens before any id or row travels."""
        world, me = self.topology.world_size, self.topology.rank
        width = _HEADER_WIDTH
        if not self._block_bytes:
            splits = [width] * world
            work = self._alltoall(hdr[1].reshape(-1), hdr[0].reshape(-1), splits, splits)
            label = f"{what} count exchange"
        else:  # one block per peer: the header, then (for a large lookup) its keys; hdr views the headers
            words = xbuf.view(torch.int64)
            if words.shape[2] * 8 != self._block_bytes:
                raise RuntimeError(f"internal: {what} built a {words.shape[2] * 8}-byte block, the context "
                                   f"exchanges {self._block_bytes}")
            splits = [words.shape[2]] * world
            work = self._alltoall(words[1].reshape(-1), words[0].reshape(-1), splits, splits)
            label = f"{what} count and id exchange"
        if self.device.type == "cuda":
            # Queue the copy of the headers to the host behind the exchange and poll for that
            # copy, instead of polling for the exchange and then copying (a second round trip).
            self._wait(work, None, label, host=False)
            host = self._host_headers.get(hdr.shape)
            if host is None:
                host = self._host_headers[hdr.shape] = torch.empty(hdr.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(hdr, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._wait_event(copied, self.timeout, label)
            self._wait(work, None, label)  # done by now; raises if the exchange failed
            both = host.reshape(-1).tolist()
        else:
            self._wait(work, None, label)
            both = hdr.reshape(-1).tolist()
        rows_sent = [both[p * width : (p + 1) * width] for p in range(world)]
        rows = [both[(world + p) * width : (world + p + 1) * width] for p in range(world)]
        tags = [r[_H_TAG] for r in rows]
        # Every rank sees the same headers, so every rank grows the block alike, whatever happens next.
        want = max(r[_H_WANT] for r in rows)
        if want > self._block_bytes:
            self._log.info("context.count_block_grown", old_bytes=self._block_bytes, new_bytes=want)
            self._block_bytes = want
        longest = max(r[_H_LEN] for r in rows)
        sent, got = [r[:chunks] for r in rows_sent], [r[:chunks] for r in rows]
        out_of_range = []
        if spec is not None:
            out_of_range = [p for p, r in enumerate(rows)
                            if tags[p] == tag and self._range_error(spec, r[_H_LO], r[_H_HI])]
        if me in out_of_range:
            lo, hi = rows[me][_H_LO], rows[me][_H_HI]
            raise InvalidIds(f"{what} on rank {me}: {self._range_error(spec, lo, hi)}")
        bad = [r for r, row in enumerate(rows) if any(x < 0 for x in row[:_MAX_CHUNKS])]
        if bad:
            raise PeerLookupError(
                f"{what} was cancelled on rank {self.topology.rank}: rank(s) {bad} passed invalid input "
                f"(see the InvalidIds error on those ranks); the context stays usable",
                bad,
            )
        other = {r: tg for r, tg in enumerate(tags) if tg != tag}
        if other:
            calls = ", ".join(f"rank {r} called {self._describe_tag(tg)}" for r, tg in sorted(other.items()))
            raise CollectiveMismatch(
                f"rank {self.topology.rank} called {self._describe_tag(tag)} but {calls}: every rank must "
                f"make the same lookup/apply_gradients calls in the same order (an empty ids tensor where it "
                f"has none) on contexts built with the same pipeline_chunks"
            )
        if out_of_range:
            raise PeerLookupError(
                f"{what} was cancelled on rank {self.topology.rank}: rank(s) {out_of_range} passed ids out of "
                f"range (see the InvalidIds error on those ranks); the context stays usable",
                out_of_range,
            )
        return sent, got, longest

    def _cancel(self, what: str, tag: int) -> None:
        """Send poison in place of counts, so the peers raise instead of waiting for this rank."""
        chunks = max(1, tag >> 40)
        xbuf = None
        if self._block_bytes:
            xbuf = torch.zeros(2, self.topology.world_size, self._block_bytes // 8, dtype=torch.int64,
                               device=self.device)
            hdr = xbuf[:, :, :_HEADER_WIDTH]
            hdr.copy_(self._header_template(tag))
        else:
            hdr = self._header_template(tag).clone()
        hdr[0, :, :chunks] = _POISON
        try:
            self._exchange_counts(hdr, chunks, what, tag, xbuf=xbuf)
        except (PeerLookupError, CollectiveMismatch):
            pass

    def _spec_or_cancel(self, table: str, what: str, op: int, chunks: int = 1) -> TableSpec:
        if table in self.tables:
            return self.tables[table]
        if self.topology.world_size > 1:
            self._cancel(what, self._tag(op, table, chunks))
        return self._spec(table)  # raises the KeyError naming the tables

    def _key_bounds(self, spec: TableSpec, chunks: int, dtype: torch.dtype) -> torch.Tensor:
        """``[chunks, world + 1]`` keys where each owner's rows start, per piece (piece k's keys
        are ``k * num_rows + id``). Cached: world and EP size are fixed for the context's life."""
        key = (spec.name, chunks, dtype)
        bounds = self._key_bounds_cache.get(key)
        if bounds is None:
            world, rows = self.topology.world_size, spec.num_rows
            per = rows_per_owner(rows, self.topology.ep_size)
            firsts = [min(p * per, rows) for p in range(world + 1)]
            bounds = torch.tensor([[k * rows + f for f in firsts] for k in range(chunks)], dtype=dtype)
            bounds = self._key_bounds_cache[key] = bounds.to(self.device)
        return bounds

    def _piece_offsets(self, n: int, chunks: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """``k * rows`` for each position of piece k of a batch of ``n`` (cached for the last
        batch size: training batches repeat it)."""
        key = (n, chunks, rows, dtype)
        if self._offsets is None or self._offsets[0] != key:
            bounds = [n * k // chunks for k in range(chunks + 1)]
            off = torch.cat([torch.full((bounds[k + 1] - bounds[k],), k * rows, dtype=dtype)
                             for k in range(chunks)]).to(self.device)
            self._offsets = (key, off)
        return self._offsets[1]

    def _dedup(self, spec: TableSpec, ids, what: str, tag: int, chunks: int):
        """Validate, deduplicate per piece and exchange counts with ONE host synchronisation.

        The batch is cut into ``chunks`` consecutive pieces; piece k's ids become the keys
        ``k * num_rows + id``, so one sort deduplicates every piece and leaves the unique keys
        grouped by piece, then by owner (row-wise sharding is monotone). Nothing here needs a
        size on the host (``torch.unique`` would sync for its output size): the unique keys are
        scattered to their slots in a buffer of the batch's length, and the per-(owner, piece)
        counts are differences of a running count of first occurrences at the owners'
        boundaries. The range check rides the count exchange: each rank's smallest and largest
        id travel in its count headers, so every rank learns in that one exchange whose ids are
        out of range, and that rank raises :class:`InvalidIds` naming the id, before any id or
        row is sent.

        On CUDA these ~20 small kernels cost more to launch from Python than to run, so for
        batches of :data:`_CAPTURE_MIN_IDS` ids or more they are captured once per (call, batch
        size) in a CUDA graph (:class:`_DedupGraph`) and replayed.

        Large lookups also send their ids with the counts. From the context's second exchange
        on, the count exchange carries a block of :attr:`_block_bytes` per peer (the same on
        every rank, see :meth:`_exchange_counts`): the header, then room for the keys meant for
        that peer, piece-major, in a fixed capacity (any peer could own every key). A lookup
        lays its unique keys out there when the table is wide enough for that padding to be
        cheap (:meth:`_fusable`) and its batch fits; when every rank's batch fitted (the lengths
        travel in the headers), the keys are used as they came, otherwise the caller exchanges
        the ids once the counts are known. A large lookup asks in its header for a block that
        would hold its batch (:meth:`_want_bytes`), so the first one grows the block for the next.

        Returns (uniq, inverse, sent, got, n_unique, keys, graph): ``uniq[:n_unique]`` the
        unique keys (piece-major, sorted), ``inverse[i]`` the slot of position i's key, the
        exchanged counts as ``[peer][piece]`` lists, the exchange buffer when the keys came in
        it (else None), and the graph replayed (or None)."""
        checked, reason = self._check_ids(ids)
        if checked is None:
            self._cancel(what, tag)  # tell the peers before raising, so nobody waits for this rank
            raise InvalidIds(f"{what} on rank {self.topology.rank}: {reason}")
        n = checked.numel()
        block = self._block_bytes  # as it is for this call; the exchange may grow it for the next
        graph = self._dedup_graph(spec, n, chunks, tag, block) if n >= _CAPTURE_MIN_IDS else None
        if graph is not None:
            uniq, inverse, hdr, xbuf, pos = graph.replay(checked)
        else:
            inputs = self._dedup_inputs(spec, n, chunks, tag, block)
            uniq, inverse, hdr, xbuf, pos = self._dedup_compute(spec, checked, chunks, *inputs)
        sent, got, longest = self._exchange_counts(hdr, chunks, what, tag, spec=spec, xbuf=xbuf)
        n_unique = sum(sum(c) for c in sent)
        capacity = self._key_capacity(spec, chunks, tag, block)
        keys = xbuf if capacity and longest <= capacity else None  # every rank decides alike
        self._fused_lookups += keys is not None
        return uniq, inverse, sent, got, n_unique, keys, graph, pos

    def _key_dtype(self, spec: TableSpec, chunks: int) -> torch.dtype:
        # 32-bit keys when they fit: the radix sort makes half the passes, ids travel in half the bytes.
        return torch.int32 if chunks * spec.num_rows <= _INT32_MAX else torch.int64

    def _dedup_inputs(self, spec: TableSpec, n: int, chunks: int, tag: int, block_bytes: int) -> tuple:
        """The constant inputs of :meth:`_dedup_compute`: piece offsets, owner boundaries, header
        template, slot numbers (when the keys are laid out per peer or positions computed), the
        exchange block's layout (None while the headers travel alone: (elements, key capacity or
        0, peer block starts)), the block this call asks for, and ``mine`` (positions, CUDA)."""
        dtype = self._key_dtype(spec, chunks)
        offsets = self._piece_offsets(n, chunks, spec.num_rows, dtype) if chunks > 1 and n else None
        lookup = (tag >> 20) & 0xFFFFF == 1
        layout = None
        if block_bytes:
            elems = block_bytes // torch.empty((), dtype=dtype).element_size()
            capacity = self._key_capacity(spec, chunks, tag, block_bytes)
            if n > capacity:
                capacity = 0  # this batch does not fit: header only (every rank learns it from the lengths)
            layout = (elems, capacity,
                      torch.arange(self.topology.world_size, device=self.device) * elems + _header_words(dtype))
        want = self._want_bytes(spec, n, chunks, tag)
        # A lookup on CUDA also computes where each result row will come from (see
        # _pipelined_lookup): that needs this rank's number and its shard's length. The CPU
        # path places its own rows itself.
        mine = (self.topology.rank, len(self.owned(spec.name))) if lookup and self.device.type == "cuda" else None
        slots = torch.arange(n, device=self.device) if mine is not None or (layout and layout[1]) else None
        return offsets, self._key_bounds(spec, chunks, dtype), self._header_template(tag), slots, layout, want, mine

    def _fusable(self, spec: TableSpec, chunks: int, tag: int) -> bool:
        """Whether a call's ids may ride in the count exchange: lookups only, of tables wide
        enough that the fixed-capacity padding (world x batch keys each way, against about a
        batch of rows for the row exchange) costs at most 1/8 of the row bytes: world x key
        bytes <= row bytes / 8, up to 16 ranks for 128 fp32 columns and 32-bit keys."""
        key_bytes = torch.empty((), dtype=self._key_dtype(spec, chunks)).element_size()
        return (tag >> 20) & 0xFFFFF == 1 and 8 * self.topology.world_size * key_bytes <= spec.bytes_per_row()

    def _key_capacity(self, spec: TableSpec, chunks: int, tag: int, block_bytes: int) -> int:
        """Keys per peer a block of ``block_bytes`` holds for this call (0: none), less one dump word."""
        if not block_bytes or not self._fusable(spec, chunks, tag):
            return 0
        dtype = self._key_dtype(spec, chunks)
        return block_bytes // torch.empty((), dtype=dtype).element_size() - _header_words(dtype) - 1

    def _want_bytes(self, spec: TableSpec, n: int, chunks: int, tag: int) -> int:
        """The block a call of ``n`` ids asks for in its header: 0 unless a large fusable lookup;
        rounded up to 1/16 of a power of two, so batch lengths that wander a little do not grow
        it call after call; 0 too when the buffer (both directions) would pass
        :data:`_FUSED_MAX_BYTES`."""
        if n < _CAPTURE_MIN_IDS or not self._fusable(spec, chunks, tag):
            return 0
        key_bytes = torch.empty((), dtype=self._key_dtype(spec, chunks)).element_size()
        need = 8 * _HEADER_WIDTH + (n + 1) * key_bytes
        grain = 1 << max(3, need.bit_length() - 4)
        need = -(-need // grain) * grain
        return need if 2 * self.topology.world_size * need <= _FUSED_MAX_BYTES else 0

    def _dedup_compute(self, spec: TableSpec, checked: torch.Tensor, chunks: int, offsets, bounds, template,
                       slots=None, layout=None, want: int = 0, mine=None):
        """The device half of :meth:`_dedup`: no host synchronisation, no allocation sized from
        data (so it can be captured in a CUDA graph). Returns (uniq, inverse, header, xbuf, pos).

        With a block ``layout`` the headers and the keys share one buffer ``xbuf`` ``[2 (send,
        receive), world, elements]`` of the key dtype: per peer the header (as int64 words),
        then, when the layout has a key capacity, the keys meant for that peer, piece-major, as
        the owner's own row numbers (so the owner gathers with them as they come). ``header``
        is then an int64 view of the header words.

        With ``mine`` = (this rank, its shard's rows), for a lookup: ``pos``, per position of
        the batch, where its row will be (:func:`elastic_emb.gather.gather_rows`): for a key
        this rank owns, its shard row counted from the end (< 0); otherwise its row in the
        receive buffer, which holds the received rows piece by piece, peers in rank order (the
        unique keys less this rank's own, in order)."""
        n, dev = checked.numel(), checked.device
        keys = checked.to(self._key_dtype(spec, chunks))
        if offsets is not None:
            keys = keys + offsets
        sorted_keys, perm = torch.sort(keys)
        head = torch.ones(n, dtype=torch.bool, device=dev)
        if n > 1:
            torch.ne(sorted_keys[1:], sorted_keys[:-1], out=head[1:])
        firsts = torch.zeros(n + 1, dtype=torch.int64, device=dev)  # first occurrences before each position
        torch.cumsum(head, 0, out=firsts[1:])
        slot = firsts[1:] - 1
        uniq = torch.empty(n, dtype=keys.dtype, device=dev).scatter_(0, slot, sorted_keys)
        inverse = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, perm, slot)
        at = firsts[torch.searchsorted(sorted_keys, bounds)]  # [chunks, world + 1] slots at owner boundaries
        counts = at[:, 1:] - at[:, :-1]  # [chunks, world]
        world = counts.shape[1]
        if slots is not None:
            # Each unique slot's (piece, owner) segment, k * (world + 1) + owner; slots past the
            # last unique key land in the last piece's sentinel column (owner == world).
            seg = torch.searchsorted(at.reshape(-1), slots, right=True) - 1
            owner = seg % (world + 1)
            owner_row = uniq - bounds.reshape(-1)[seg]  # the key's row number at its owner
        pos = None
        if mine is not None:
            me, shard_rows = mine
            piece = seg // (world + 1)
            mine_before = torch.cumsum(counts[:, me], 0) - counts[:, me]  # my keys in earlier pieces
            local_before = mine_before[piece] + torch.where(owner > me, counts[:, me][piece], 0)
            src = torch.where(owner == me, owner_row - shard_rows, slots - local_before)
            pos = src[inverse]
        xbuf = None
        if layout is None:
            hdr = template.clone()
        else:
            elems, capacity, peer_at = layout
            hw = _header_words(keys.dtype)
            xbuf = torch.zeros(2, world, elems, dtype=keys.dtype, device=dev)
            hdr = xbuf[:, :, :hw].view(torch.int64)
            hdr.copy_(template)
            if capacity:
                # Where slot s goes: its (piece, owner) segment, then that owner's block, after the
                # owner's keys of earlier pieces. Slots past the last unique key go to a dump word.
                before = torch.cumsum(counts, 0) - counts  # keys for the same owner in earlier pieces
                within = torch.zeros(chunks, world + 1, dtype=torch.int64, device=dev)
                within[:, :world] = before - at[:, :world]
                within = within.reshape(-1)[seg] + slots  # position among the keys meant for that owner
                valid = (owner < world) & (slots < firsts[n])  # within < n <= capacity: _dedup_inputs
                dest = torch.where(valid, peer_at[owner.clamp(max=world - 1)] + within, hw + capacity)
                xbuf[0].reshape(-1).scatter_(0, dest, owner_row)
        hdr[0, :, :chunks] = counts.t()  # [world, chunks]
        hdr[0, :, _H_LEN] = n
        hdr[0, :, _H_WANT] = want
        if n:
            hdr[0, :, _H_LO : _H_HI + 1] = torch.stack(torch.aminmax(checked))  # range-checked from the headers
        return uniq, inverse, hdr, xbuf, pos

    def _dedup_graph(self, spec: TableSpec, n: int, chunks: int, tag: int, block: int) -> "_DedupGraph | None":
        if not self.capture_dedup or self.device.type != "cuda" or self._capture_failed:
            return None
        key = (tag, n, block)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = _DedupGraph(self, spec, n, chunks, tag, block)
            except Exception as exc:  # reported once; the eager path is equivalent, only slower
                self._capture_failed = repr(exc)[:300]
                self._log.warning("context.dedup_capture_failed", error=self._capture_failed)
                return None
            if len(self._graphs) >= _MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = graph
        return graph

    def _route(self, spec: TableSpec, ids, what: str, tag: int):
        """First half of apply_gradients: validate, dedup, exchange counts and ids (own ids
        included). Returns (uniq, inverse, send_counts, recv_counts, recv_ids)."""
        uniq, inverse, sent, got, n_unique, _, _, _ = self._dedup(spec, ids, what, tag, 1)
        uniq = uniq[:n_unique]
        send_list, recv_list = [c[0] for c in sent], [c[0] for c in got]
        recv_ids = torch.empty(sum(recv_list), dtype=uniq.dtype, device=self.device)
        self._wait(self._alltoall(recv_ids, uniq, recv_list, send_list), None, f"{what} id exchange", host=False)
        return uniq, inverse, send_list, recv_list, recv_ids

    # -- public operations ---------------------------------------------------------------------

    def lookup(self, table: str, ids: torch.Tensor) -> LookupHandle:
        """Start a lookup of ``ids`` (collective: every rank calls it, possibly with no ids).
        Returns before the row exchange completes; ``handle.wait()`` gives ``[len(ids), dim]``."""
        self._check_open(f"lookup({table!r})")
        self._materialise()
        what = f"lookup({table!r})"
        spec = self._spec_or_cancel(table, what, 1, self.pipeline_chunks)
        if self.topology.world_size == 1:
            # One rank owns everything: no exchange, no dedup; a plain gather.
            checked, reason = self._validate_ids(spec, ids)
            if checked is None:
                raise InvalidIds(f"{what} on rank 0: {reason}")
            rows = self._arena.weights[table].index_select(0, checked)
            return LookupHandle(self, table, [], rows, None, False)
        return self._pipelined_lookup(spec, ids, what)

    def _pipelined_lookup(self, spec: TableSpec, ids, what: str) -> LookupHandle:
        """The batch is cut into ``pipeline_chunks`` consecutive pieces; one sort deduplicates
        them all (:meth:`_dedup`, the lookup's only host synchronisation), one count exchange
        and one id exchange serve all pieces. Then, per piece, the owner gathers the rows asked
        of it and starts that piece's row all-to-all, so gathering piece k+1 overlaps sending
        piece k, and assembling piece k overlaps sending the next ones.

        Rows a rank owns itself never enter an exchange. On CUDA nor the receive buffer: the
        result is assembled in one pass (:func:`elastic_emb.gather.gather_rows`), each row read
        from the receive buffer or straight from the shard, at positions ``pos`` that the dedup
        computed on the device (:meth:`_dedup_compute`). On the CPU they are gathered once behind
        the received rows (:meth:`_own_rows_behind`). The receive buffer holds the received rows
        piece by piece, each piece's peers in rank order, as the all-to-alls write them."""
        table = spec.name
        world, me = self.topology.world_size, self.topology.rank
        chunks = self.pipeline_chunks
        tag = self._tag(1, table, chunks)
        n = ids.numel() if isinstance(ids, torch.Tensor) else 0
        uniq, inverse, sent, got, n_unique, xbuf, graph, pos = self._dedup(spec, ids, what, tag, chunks)
        rows = spec.num_rows
        start = self.owned(table).start
        dev = self.device

        # Where each piece's unique keys start, and where each peer's keys start within a piece.
        size = [sum(sent[p][k] for p in range(world)) for k in range(chunks)]
        base = [sum(size[:k]) for k in range(chunks + 1)]
        starts = [[sum(sent[q][k] for q in range(p)) for k in range(chunks)] for p in range(world)]

        in_tot = [0 if p == me else sum(sent[p]) for p in range(world)]
        out_tot = [0 if p == me else sum(got[p]) for p in range(world)]
        if xbuf is not None:
            # The keys came with the counts, as my own row numbers: peer p's at the start of its
            # block, after the header.
            hw = _header_words(xbuf.dtype)
            got_keys = [xbuf[1, p, hw : hw + out_tot[p]] for p in range(world) if out_tot[p]]
            asked_rows = got_keys[0] if len(got_keys) == 1 else (torch.cat(got_keys) if got_keys else uniq[:0])
        else:
            # One id exchange for every piece: to peer p go its keys of piece 0, then of piece 1, ...
            pieces = [uniq[base[k] + starts[p][k] : base[k] + starts[p][k] + sent[p][k]]
                      for p in range(world) if p != me for k in range(chunks) if sent[p][k]]
            if len(pieces) == 1:
                send_keys = pieces[0]
            else:
                send_keys = torch.cat(pieces) if pieces else uniq[:0]
            recv_keys = torch.empty(sum(out_tot), dtype=uniq.dtype, device=dev)
            self._wait(self._alltoall(recv_keys, send_keys, out_tot, in_tot), None, f"{what} id exchange", host=False)
            # My row number of every key asked of me (piece k's keys are k * rows + id).
            asked_rows = (recv_keys.remainder(rows) if chunks > 1 else recv_keys) - start

        weight = self._arena.weights[table]
        n_serve = [sum(got[p][k] for p in range(world) if p != me) for k in range(chunks)]
        n_local = [sent[me][k] for k in range(chunks)]
        n_remote = [size[k] - n_local[k] for k in range(chunks)]
        rbase = [sum(n_remote[:k]) for k in range(chunks + 1)]  # where piece k's received rows start
        # CUDA: my own rows are read from my shard when the result is assembled (one pass, a
        # Triton kernel). The CPU has no such kernel and torch ops would take two passes over
        # them, so there they are gathered once, behind the received rows, and the result is one
        # index_select (65,536 ids x 64 fp32 on the 2-core CPU: 1.25 ms against 4.3 ms for the
        # torch form of the two-source gather).
        own_behind = dev.type != "cuda"
        n_recv = rbase[-1] + (sum(n_local) if own_behind else 0)
        need = _staging_need([((n_serve[k], spec.dim), spec.torch_dtype) for k in range(chunks)]
                             + [((n_recv, spec.dim), spec.torch_dtype)])
        buf, leased = self._arena.lease(need)
        staging = _Staging(buf)
        # Received rows, piece by piece, each piece's peers in rank order (as an all-to-all writes
        # them), then on the CPU my own rows.
        got_rows = staging.take((n_recv, spec.dim), spec.torch_dtype)
        peer_at = [sum(out_tot[:p]) for p in range(world)]  # where peer p's keys start in recv_keys
        if own_behind:
            pos = self._own_rows_behind(uniq, inverse, n_unique, weight, got_rows, base, size, starts[me], n_local,
                                        rbase, rows, start)
        if dev.type == "cuda":
            # Allocated on the caller's stream before the event the side stream waits on, so any
            # earlier user of its memory is done by then; the event also covers ``pos``.
            result = torch.empty(n, spec.dim, dtype=spec.torch_dtype, device=dev)
            if graph is not None:
                # The side stream reads the positions until this lookup is assembled; the graph's
                # copy would be overwritten by the next lookup's replay, which waits only for
                # ``ready`` (so that it can run while this lookup's rows are on the wire).
                pos = pos.clone()
            ready = torch.cuda.Event()
            ready.record()
            if graph is not None:
                graph.last_done = ready  # the graph's outputs are free again once this fires
        works, serves = [], []
        try:
            for k in range(chunks):
                serve = staging.take((n_serve[k], spec.dim), spec.torch_dtype)
                asked = [asked_rows[peer_at[p] + sum(got[p][:k]) : peer_at[p] + sum(got[p][: k + 1])]
                         for p in range(world) if p != me and got[p][k]]
                if asked:
                    torch.index_select(weight, 0, asked[0] if len(asked) == 1 else torch.cat(asked), out=serve)
                out_splits = [0 if p == me else sent[p][k] for p in range(world)]
                in_splits = [0 if p == me else got[p][k] for p in range(world)]
                works.append(self._alltoall(got_rows[rbase[k] : rbase[k + 1]], serve, out_splits, in_splits))
                serves.append(serve)
        except Exception:
            if leased:
                self._arena.release()
            raise
        bounds = [n * k // chunks for k in range(chunks + 1)]
        handle = LookupHandle(self, table, works, got_rows, pos, leased, keep=tuple(serves), bounds=bounds,
                              own_in_recv=own_behind)
        if dev.type == "cuda":
            handle._reorder_on_side_stream(ready, result)
        return handle

    @staticmethod
    def _own_rows_behind(uniq, inverse, n_unique: int, weight, got_rows, base, size, before, n_local, rbase, rows: int,
                         start: int) -> torch.Tensor:
        """CPU: gather my own unique rows into ``got_rows`` behind the received ones; return, per
        position of the batch, its row in ``got_rows``. Unique keys are in (piece, owner) order:
        in piece k those of owners before me, mine, then those of owners after me."""
        src = torch.empty(n_unique, dtype=torch.int64)
        own_at = rbase[-1]
        for k in range(len(n_local)):
            b, bf, mine = base[k], before[k], n_local[k]
            if bf:
                torch.arange(rbase[k], rbase[k] + bf, out=src[b : b + bf])
            if mine:
                torch.arange(own_at, own_at + mine, out=src[b + bf : b + bf + mine])
                torch.index_select(weight, 0, uniq[b + bf : b + bf + mine] - (k * rows + start),
                                   out=got_rows[own_at : own_at + mine])
                own_at += mine
            if size[k] > bf + mine:
                torch.arange(rbase[k] + bf, rbase[k + 1], out=src[b + bf + mine : b + size[k]])
        return src.index_select(0, inverse)

    def apply_gradients(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Route ``grads`` (``[len(ids), dim]``) to the owners of ``ids`` and apply the optimizer
        there; gradients of duplicate ids are summed (collective: every rank calls it)."""
        self._check_open(f"apply_gradients({table!r})")
        self._materialise()
        what = f"apply_gradients({table!r})"
        spec = self._spec_or_cancel(table, what, 2)
        tag = self._tag(2, table)
        shape_ok = (
            isinstance(grads, torch.Tensor)
            and isinstance(ids, torch.Tensor)
            and grads.dim() == 2
            and grads.shape[1] == spec.dim
            and ids.dim() == 1
            and grads.shape[0] == ids.shape[0]
        )
        if not shape_ok:
            got = tuple(grads.shape) if isinstance(grads, torch.Tensor) else type(grads).__name__
            n = tuple(ids.shape) if isinstance(ids, torch.Tensor) else "?"
            # Tell the peers before raising, so nobody waits for this rank.
            self._cancel(what, tag)
            raise InvalidIds(
                f"{what} on rank {self.topology.rank}: grads must be [len(ids), {spec.dim}] for ids of "
                f"shape {n}, got {got}"
            )
        uniq, inverse, send_list, recv_list, recv_ids = self._route(spec, ids, what, tag)
        summed = torch.zeros(len(uniq), spec.dim, dtype=spec.torch_dtype, device=self.device)
        if len(uniq):
            summed.index_add_(0, inverse, grads.to(device=self.device, dtype=spec.torch_dtype))
        recv_grads = torch.empty(len(recv_ids), spec.dim, dtype=spec.torch_dtype, device=self.device)
        self._wait(self._alltoall(recv_grads, summed, recv_list, send_list), None, f"{what} gradient exchange",
                   host=False)
        if not len(recv_ids):
            return
        local = recv_ids.long() - self.owned(table).start
        # Several senders may have sent the same row: sum them before the (non-linear) update.
        rows, inv = torch.unique(local, sorted=True, return_inverse=True)
        if rows.numel() != local.numel():
            total = torch.zeros(rows.numel(), spec.dim, dtype=spec.torch_dtype, device=self.device)
            total.index_add_(0, inv, recv_grads)
        else:
            total = torch.empty_like(recv_grads).index_copy_(0, inv, recv_grads)
        self._settle_lookups()
        optim.apply_rows(self.optimizer, self._arena.weights[table], self._arena.slots[table], rows, total)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (a small all-reduce, bounded by the timeout)."""
        self._check_open("barrier")
        t = torch.zeros(1, device=self.device)
        self._wait(self.process_group.allreduce([t]), None, "barrier")

    # -- reset and close -----------------------------------------------------------------------

    def reset(self, rank: int, world_size: int, *, topology: Topology | None = None, store=None) -> None:
        """Re-form the communicator for the same world size (the rank mapping may change).

        Raises ``ValueError`` for an invalid rank or world size, :class:`WorldSizeChanged` for a
        different world size, ``ValueError`` for a non-power-of-two EP size (unless the rule is
        off) or a changed EP size. Rows are kept: if this process's rank changed, its shard moves
        to the process that now holds its old rank.
        """
        self._check_open("reset")
        self._materialise()
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an int")
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if world_size != self.topology.world_size:
            raise WorldSizeChanged(self.topology.world_size, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, {world_size})")
        if topology is None:
            topology = self.topology.with_changes(rank=rank)
        if topology.rank != rank or topology.world_size != world_size:
            raise ValueError(
                f"topology (rank={topology.rank}, world_size={topology.world_size}) does not match "
                f"reset(rank={rank}, world_size={world_size})"
            )
        self._check_ep(topology, self.require_power_of_two)
        if topology.ep_size != self.topology.ep_size:
            raise ValueError(
                f"ep_size changed from {self.topology.ep_size} to {topology.ep_size}: the arena is laid "
                f"out for the old sharding; close this context and construct a new one"
            )
        if topology.backend != self.topology.backend:
            raise ValueError(
                f"backend changed from {self.topology.backend!r} to {topology.backend!r}: construct a new context"
            )
        started = time.monotonic()
        old_rank = self.topology.rank
        was_healthy = self._healthy
        self._log = log.bind(run_id=topology.run_id, generation=topology.generation, rank=topology.rank)
        # Form the new communicator before releasing the old one: NCCL destroy immediately
        # followed by init races (FACTS, pytorch#119196), and a failed re-form leaves the old
        # context as it was.
        new_pg, new_backend = self._form_group(topology, store if store is not None else self._base_store)
        if was_healthy:
            self._drain_pending()
        self._shutdown_group(abort=not was_healthy)
        self.process_group, self._backend = new_pg, new_backend
        self._healthy = True
        # Every rank starts the new communicator with headers alone: a rank whose last call failed
        # half way may not have grown the block with the others. The dedup graphs hold this
        # rank's number and shard length (see _dedup_inputs): a new rank mapping voids them.
        self._block_bytes = 0
        self._graphs.clear()
        if store is not None:
            self._base_store = store
        self.topology = topology
        moved = self._remap_rows(old_rank)
        self._log.info("context.reset", old_rank=old_rank, moved_bytes=moved,
                       seconds=round(time.monotonic() - started, 4))

    def _remap_rows(self, old_rank: int) -> int:
        """After a reset: move each process's resident arena to the process that now has its
        old rank. One all-to-all of bytes; every rank takes part even when nothing moves."""
        world, rank = self.topology.world_size, self.topology.rank
        olds = torch.zeros(world, dtype=torch.int64, device=self.device)
        olds[rank] = old_rank
        self._wait(self.process_group.allreduce([olds]), None, "reset rank exchange")
        old_of = olds.tolist()  # old_of[new rank] = old rank
        if old_of == list(range(world)):
            return 0
        if sorted(old_of) != list(range(world)):
            self._healthy = False
            raise CommunicationError(f"reset: old ranks {old_of} are not a permutation of 0..{world - 1}")
        new_arena = self._allocate(self.topology)
        src = self._arena.buffer[: self._arena.resident_bytes]
        dst = new_arena.buffer[: new_arena.resident_bytes]
        in_splits = [0] * world
        in_splits[old_rank] = src.numel()  # the process now holding my old rank needs my rows
        out_splits = [0] * world
        out_splits[old_of.index(rank)] = dst.numel()  # I take the rows of my new rank's old holder
        self._wait(self._alltoall(dst, src, out_splits, in_splits), None, "reset row move")
        self._arena = new_arena
        return int(src.numel())

    def _shutdown_group(self, abort: bool, wait: bool = True, keep=None) -> None:
        """Release the communicator: destroy (``shutdown``) or ``abort``, bounded by the timeout
        (a destroy that passes it falls back to abort). ``wait=False`` (NCCL) hands the release
        to a background thread and returns at once; ``keep`` (the arena, after a failure) stays
        alive until the release is done, in case a stuck kernel still touches it."""
        pg = getattr(self, "process_group", None)
        if pg is None:
            return
        self.process_group = None
        self._backend = None  # the group must not outlive close (no teardown at interpreter exit)
        method = "abort" if abort else "shutdown"
        log_ = self._log
        if self.topology.backend == "gloo":
            # Gloo: abort() only closes this rank's connections. A healthy close has drained every
            # pending lookup first, so no collective is in flight and no peer loses data; shutdown()
            # left a joinable thread behind when a peer had died ("terminate called without an
            # active exception" at interpreter exit), abort did not.
            try:
                pg.abort()
            except Exception as exc:  # reported, not swallowed silently
                log_.warning("context.group_release_failed", method="abort", error=str(exc))
            return
        release = _Release(pg, method, self.timeout, log_, keep)
        if wait:
            release.run()
        else:
            release.start()

    def _settle_lookups(self) -> None:
        """Before this context writes rows: lookups in flight read their own rank's rows first
        (:meth:`LookupHandle._settle`)."""
        for handle in list(self._pending):
            handle._settle()

    def _drain_pending(self) -> None:
        """Let lookups that were started but never waited finish their exchanges (every rank
        started them, so they complete), so that no collective is in flight at teardown."""
        for handle in list(self._pending):
            handle._drain(self.timeout)
        self._pending.clear()

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        """Release the communicator and the arena. Idempotent. ``abort`` forces (True) or forbids
        (False) aborting the communicator; by default it aborts only when unhealthy.

        ``wait=False`` (what the lifecycle does on a resize) returns as soon as the context is
        unusable and its arena is back in the allocator, for the next context to reuse: the NCCL
        communicator is destroyed (or aborted) by a background thread, bounded by the timeout,
        while the next context forms (on 2 H200s a destroy took 0.10-0.28 s and an abort 0.53 s,
        bench/teardown.py). :func:`wait_releases` waits for those threads; each reports a
        ``context.group_released`` event, or ``context.group_release_failed``."""
        if self._closed:
            return
        started = time.monotonic()
        do_abort = (not self._healthy) if abort is None else abort
        if not do_abort:
            self._drain_pending()
        self._closed = True
        _OPEN.discard(self)
        arena = self._arena
        arena_bytes = arena.nbytes
        self._arena = None  # type: ignore[assignment]
        self._shutdown_group(abort=do_abort, wait=wait, keep=arena if do_abort else None)
        del arena
        if self.device.type == "cuda" and wait:
            torch.cuda.empty_cache()
        self._log.info("context.closed", aborted=do_abort, released_bytes=arena_bytes,
                       communicator="released" if wait or self.topology.backend == "gloo" else "releasing in background",
                       seconds=round(time.monotonic() - started, 4))

    def __enter__(self) -> "EmbContext":
        self._check_open("__enter__")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=True if exc_type is not None and not self._healthy else None)

    def __del__(self) -> None:  # best effort; close() is the real interface
        try:
            if not self._closed and getattr(self, "process_group", None) is not None and self.topology.backend == "gloo":
                self.close()
        except Exception:
            pass

    # -- shards --------------------------------------------------------------------------------

    def export_shard(self) -> dict[str, ShardData]:
        """Copies of this rank's rows and slots of every table, with their global row range."""
        self._check_open("export_shard")
        self._materialise()
        a = self._arena
        return {
            name: ShardData(
                table=name,
                rows=self.owned(name),
                weight=a.weights[name].clone(),
                slots={k: v.clone() for k, v in a.slots[name].items()},
            )
            for name in self.tables
        }

    def shard_views(self) -> dict[str, ShardData]:
        """This rank's rows and slots as the arena's own tensors: writable views, no copy.

        For a restore that writes rows in place (skipping export's clone and import's copy);
        the rows are not initialised by this call: a caller that wrote every row says so with
        :meth:`mark_restored`, anything else that reads rows initialises them first.
        The views are valid until ``close()`` or a ``reset`` that changes this rank's rank
        (which re-lays the arena); take them again after either."""
        self._check_open("shard_views")
        a = self._arena
        return {
            name: ShardData(table=name, rows=self.owned(name), weight=a.weights[name], slots=dict(a.slots[name]))
            for name in self.tables
        }

    def import_shard(self, shards: Mapping[str, ShardData]) -> None:
        """Overwrite this rank's rows with ``shards``: exactly this rank's owned range of every
        table, with every optimizer slot. Local (no communication)."""
        self._check_open("import_shard")
        self._settle_lookups()
        missing = sorted(set(self.tables) - set(shards))
        extra = sorted(set(shards) - set(self.tables))
        if missing or extra:
            raise ValueError(f"import_shard: tables missing {missing}, unknown {extra}; expected {sorted(self.tables)}")
        a = self._arena
        for name, shard in shards.items():
            want = self.owned(name)
            if shard.rows != want:
                raise ValueError(
                    f"import_shard: table {name!r} shard covers rows [{shard.rows.start}, {shard.rows.stop}) but "
                    f"rank {self.topology.rank} owns [{want.start}, {want.stop}); reshard first "
                    f"(elastic_emb.sharding.reshard_plan)"
                )
            if tuple(shard.weight.shape) != tuple(a.weights[name].shape):
                raise ValueError(f"import_shard: table {name!r} weight shape {tuple(shard.weight.shape)} != "
                                 f"{tuple(a.weights[name].shape)}")
            slot_names = set(a.slots[name])
            if set(shard.slots) != slot_names:
                raise ValueError(f"import_shard: table {name!r} slots {sorted(shard.slots)} != {sorted(slot_names)} "
                                 f"(optimizer {self.optimizer.kind!r})")
            for slot, t in shard.slots.items():
                if tuple(t.shape) != tuple(a.slots[name][slot].shape):
                    raise ValueError(f"import_shard: table {name!r} slot {slot!r} shape {tuple(t.shape)} != "
                                     f"{tuple(a.slots[name][slot].shape)}")
        for name, shard in shards.items():
            a.weights[name].copy_(shard.weight)
            for slot, t in shard.slots.items():
                a.slots[name][slot].copy_(t)
        self._uninitialised.clear()  # every row of every table was just written

    # -- DTensor state dict -------------------------------------------------------------------

    def device_mesh(self):
        """A DeviceMesh over the owner ranks ``0..ep_size-1`` of the default process group.

        DTensor and torch.distributed.checkpoint work only with process groups registered in
        ``torch.distributed``'s global state, which this context's private group is not; so the
        state dict uses the default group, which must be initialized with the same rank and world
        size as this context (torchrun's ``init_process_group()`` gives exactly that). The mesh
        covers the owner ranks only, because DTensor ``Shard(0)`` over that mesh is exactly the
        row layout of :mod:`elastic_emb.sharding`; ranks >= ep_size are outside it and hold
        empty shards.
        """
        self._check_open("device_mesh")
        if not dist.is_initialized():
            raise RuntimeError(
                "state_dict needs torch.distributed's default process group (DTensor and DCP only use "
                "registered groups): call torch.distributed.init_process_group() with the same rank "
                "and world size first"
            )
        if dist.get_rank() != self.topology.rank or dist.get_world_size() != self.topology.world_size:
            raise RuntimeError(
                f"default process group is rank {dist.get_rank()} of {dist.get_world_size()}, but this "
                f"context is rank {self.topology.rank} of {self.topology.world_size}; re-initialize it to match"
            )
        cached = getattr(self, "_mesh", None)
        if cached is not None and cached[0] is dist.group.WORLD:
            return cached[1]
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(self.device.type, list(range(self.topology.ep_size)))
        self._mesh = (dist.group.WORLD, mesh)
        return mesh

    def state_dict(self) -> dict:
        """``{"<table>.weight": DTensor, "<table>.<slot>": DTensor}``, ``Shard(0)`` over the owner
        ranks; local tensors are views of the arena (DCP ``load`` into them writes the arena)."""
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.device_mesh()
        self._materialise()
        out = {}
        a = self._arena
        for name, spec in self.tables.items():
            parts = {"weight": a.weights[name], **a.slots[name]}
            for slot, local in parts.items():
                shape = (spec.num_rows, *local.shape[1:])
                stride = torch.empty(shape, device="meta").stride()
                out[f"{name}.{slot}"] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
                )
        return out

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Copy the local shards of ``state_dict`` (as returned by :meth:`state_dict`, possibly
        loaded by DCP) into the arena."""
        from torch.distributed.tensor import DTensor

        self._check_open("load_state_dict")
        self._settle_lookups()
        self._materialise()  # a state dict may cover only some slots; the rest keep their values
        a = self._arena
        for name in self.tables:
            for slot, dst in {"weight": a.weights[name], **a.slots[name]}.items():
                key = f"{name}.{slot}"
                if key not in state_dict:
                    raise KeyError(f"load_state_dict: missing key {key!r}; have {sorted(state_dict)}")
                src = state_dict[key]
                local = src.to_local() if isinstance(src, DTensor) else src
                if dst.numel() == 0:
                    continue  # ranks outside the owner mesh hold an empty (shapeless) local tensor
                if tuple(local.shape) != tuple(dst.shape):
                    raise ValueError(f"load_state_dict: {key!r} local shape {tuple(local.shape)} != {tuple(dst.shape)}")
                if local.data_ptr() != dst.data_ptr():
                    dst.copy_(local)

    def __repr__(self) -> str:
        t = self.topology
        state = "closed" if self._closed else ("healthy" if self._healthy else "unhealthy")
        return (f"EmbContext(rank={t.rank}, world_size={t.world_size}, ep_size={t.ep_size}, "
                f"backend={t.backend!r}, tables={sorted(self.tables)}, {state})")
