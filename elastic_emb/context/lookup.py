"""The pipelined lookup: ids in, rows out, with the exchange overlapped by the gathers.

:class:`LookupEngine` serves one context's lookups for one communicator and arena: dedup and
count exchange (the one host sync), one id exchange unless the ids rode with the counts, then
the rows piece by piece, each piece's gather overlapping the previous piece's all-to-all, and
the result assembled on a side stream (CUDA) or in ``wait()`` (CPU). A world of one rank is one
gather from the shard. :class:`LookupHandle` is a lookup in flight.

Design: ``docs/CONTEXT.md`` (section "Lookups").
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch

from elastic_emb.context.arena import Staging, staging_need
from elastic_emb.context.dedup import check_ids
from elastic_emb.context.exchange import OP_LOOKUP, call_tag, header_words, range_error
from elastic_emb.context.gather import gather_ids, gather_rows
from elastic_emb.context.parts import OpParts
from elastic_emb.errors import ContextClosed, InvalidIds
from elastic_emb.protocol import TableSpec
from elastic_emb.sharding import owned_range


class LookupEngine:
    """Runs the lookups of one context over one group and arena; tracks the ones in flight.

    Args:
        parts: what the lookups and the gradients share.
        pipeline_chunks: pieces per lookup.
        log_: the context's logger.
    """

    def __init__(self, parts: OpParts, pipeline_chunks: int, log_):
        self.parts = parts  # shared with the gradient router (context/parts.py)
        self.pipeline_chunks = pipeline_chunks
        self.log = log_
        self.retired: str | None = None  # why handles can no longer be waited on
        self.pending: weakref.WeakSet[LookupHandle] = weakref.WeakSet()
        self._side: torch.cuda.Stream | None = None

    def side_stream(self) -> "torch.cuda.Stream":
        """The stream lookups assemble their results on (CUDA), made at first use.

        Returns:
            The engine's side stream.
        """
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.parts.device)
        return self._side

    def settle(self) -> None:
        """Before the context writes rows: lookups in flight read their own rank's rows first."""
        for handle in list(self.pending):
            handle._settle()

    def drain(self) -> None:
        """Let lookups that were started but never waited finish their exchanges (every rank
        started them, so they complete), so that no collective is in flight at teardown."""
        for handle in list(self.pending):
            handle._drain(self.parts.group.timeout)
        self.pending.clear()

    def retire(self, why: str) -> None:
        """Stop serving: the engine's handles refuse ``wait()`` from now on, as ``why`` says.

        Args:
            why: "closed" (every handle refuses) or "reset" (the context moved to another
                group: handles whose rows were not assembled refuse).
        """
        self.retired = why

    def lookup(self, spec: TableSpec, ids, what: str) -> "LookupHandle":
        """Start a lookup: every collective it needs is issued here, in program order.

        Args:
            spec: the table.
            ids: the caller's ids.
            what: the call, for messages.

        Returns:
            The :class:`LookupHandle`.

        Raises:
            InvalidIds: for ids that fail the host checks, or (more than one rank, or the CPU)
                ids out of range on this rank.
            PeerLookupError: when another rank's ids are bad.
            CollectiveMismatch: when the ranks are in different calls.
            CommunicationError: when an exchange fails or times out.
        """
        if self.parts.topology.world_size == 1:
            return self._local(spec, ids, what)
        return self._pipelined(spec, ids, what)

    def _local(self, spec: TableSpec, ids, what: str) -> "LookupHandle":
        """A world of one rank: one gather straight from the shard, nothing else. On CUDA the
        range check runs inside the gather kernel (:func:`gather_ids`) and is read by ``wait()``
        (:mod:`elastic_emb.context.checks`): no host synchronisation. The gather runs on the
        engine's side stream, after the work queued so far on the caller's stream (which may
        compute the ids or write the rows), so the caller's stream can run other work meanwhile
        (a prefetching loop hides the lookup behind the dense part of the model); ``wait()``
        orders the caller's stream after it. No CUDA graph: the work is one kernel writing into
        a fresh result (a graph would fix the result's address, and callers keep results across
        lookups), plus a 32-byte memset and copy for the check. On the CPU the ids are checked
        here."""
        checked, reason = check_ids(ids, self.parts.device)
        if checked is None:
            raise InvalidIds(f"{what} on rank 0: {reason}")
        weight = self.parts.arena.weights[spec.name]
        if self.parts.device.type != "cuda":
            if checked.numel():
                lo, hi = torch.stack(torch.aminmax(checked)).tolist()  # host memory: no sync
                reason = range_error(spec, lo, hi)
                if reason:
                    raise InvalidIds(f"{what} on rank 0: {reason}")
            return LookupHandle(self, spec.name, [], weight.index_select(0, checked), None, False)
        out = torch.empty(checked.numel(), spec.dim, dtype=spec.torch_dtype, device=self.parts.device)
        slot, record = self.parts.checks.record()
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream(self.parts.device))
        gather_ids(out, weight, checked, record, stream=side)
        check = self.parts.checks.post(what, spec, slot, checked, stream=side)
        out.record_stream(side)  # made on the caller's stream, written on the side stream
        checked.record_stream(side)
        handle = LookupHandle(self, spec.name, [], out, None, False, bounds=[0, checked.numel()])
        handle._check, handle._queued = check, (out, check.done)
        self.pending.add(handle)
        return handle

    def _pipelined(self, spec: TableSpec, ids, what: str) -> "LookupHandle":
        """The batch is cut into ``pipeline_chunks`` consecutive pieces; one sort deduplicates
        them all, one count exchange and (unless the ids came with the counts) one id exchange
        serve all pieces; then the rows move piece by piece. The receive buffer holds the
        received rows piece by piece, each piece's peers in rank order, as the all-to-alls
        write them."""
        parts = self.parts
        table = spec.name
        world, me = parts.topology.world_size, parts.topology.rank
        chunks = self.pipeline_chunks
        tag = call_tag(parts.names, OP_LOOKUP, table, chunks)
        n = ids.numel() if isinstance(ids, torch.Tensor) else 0
        d = parts.deduper.dedup(spec, ids, what, tag, chunks)
        uniq, inverse, sent, got, graph, pos = d.uniq, d.inverse, d.sent, d.got, d.graph, d.pos
        rows = spec.num_rows
        start = owned_range(rows, parts.topology.ep_size, me).start
        dev = parts.device

        # Where each piece's unique keys start, and where each peer's keys start within a piece.
        size = [sum(sent[p][k] for p in range(world)) for k in range(chunks)]
        base = [sum(size[:k]) for k in range(chunks + 1)]
        starts = [[sum(sent[q][k] for q in range(p)) for k in range(chunks)] for p in range(world)]

        in_tot = [0 if p == me else sum(sent[p]) for p in range(world)]
        out_tot = [0 if p == me else sum(got[p]) for p in range(world)]
        if d.keys is not None:
            # The keys came with the counts, as my own row numbers: peer p's at the start of its
            # block, after the header.
            hw = header_words(d.keys.dtype)
            got_keys = [d.keys[1, p, hw : hw + out_tot[p]] for p in range(world) if out_tot[p]]
            asked_rows = got_keys[0] if len(got_keys) == 1 else (torch.cat(got_keys) if got_keys else uniq[:0])
        else:
            # One id exchange for every piece: to peer p go its keys of piece 0, then of piece 1, ...
            pieces = [
                uniq[base[k] + starts[p][k] : base[k] + starts[p][k] + sent[p][k]]
                for p in range(world)
                if p != me
                for k in range(chunks)
                if sent[p][k]
            ]
            send_keys = pieces[0] if len(pieces) == 1 else (torch.cat(pieces) if pieces else uniq[:0])
            recv_keys = torch.empty(sum(out_tot), dtype=uniq.dtype, device=dev)
            parts.group.wait(
                parts.group.alltoall(recv_keys, send_keys, out_tot, in_tot), None, f"{what} id exchange", host=False
            )
            # My row number of every key asked of me (piece k's keys are k * rows + id).
            asked_rows = (recv_keys.remainder(rows) if chunks > 1 else recv_keys) - start

        weight = parts.arena.weights[table]
        n_serve = [sum(got[p][k] for p in range(world) if p != me) for k in range(chunks)]
        n_local = [sent[me][k] for k in range(chunks)]
        n_remote = [size[k] - n_local[k] for k in range(chunks)]
        rbase = [sum(n_remote[:k]) for k in range(chunks + 1)]  # where piece k's received rows start
        # CUDA: my own rows are read from my shard when the result is assembled (one pass, a
        # Triton kernel). The CPU has no such kernel and torch ops would take two passes over
        # them, so there they are gathered once, behind the received rows, and the result is one
        # index_select.
        own_behind = dev.type != "cuda"
        n_recv = rbase[-1] + (sum(n_local) if own_behind else 0)
        need = staging_need(
            [((n_serve[k], spec.dim), spec.torch_dtype) for k in range(chunks)]
            + [((n_recv, spec.dim), spec.torch_dtype)]
        )
        buf, leased = parts.arena.lease(need)
        staging = Staging(buf)
        got_rows = staging.take((n_recv, spec.dim), spec.torch_dtype)
        peer_at = [sum(out_tot[:p]) for p in range(world)]  # where peer p's keys start in asked_rows
        if own_behind:
            pos = _own_rows_behind(
                uniq, inverse, d.n_unique, weight, got_rows, base, size, starts[me], n_local, rbase, rows, start
            )
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
                asked = [
                    asked_rows[peer_at[p] + sum(got[p][:k]) : peer_at[p] + sum(got[p][: k + 1])]
                    for p in range(world)
                    if p != me and got[p][k]
                ]
                if asked:
                    torch.index_select(weight, 0, asked[0] if len(asked) == 1 else torch.cat(asked), out=serve)
                out_splits = [0 if p == me else sent[p][k] for p in range(world)]
                in_splits = [0 if p == me else got[p][k] for p in range(world)]
                works.append(parts.group.alltoall(got_rows[rbase[k] : rbase[k + 1]], serve, out_splits, in_splits))
                serves.append(serve)
        except Exception:
            if leased:
                parts.arena.release()
            raise
        bounds = [n * k // chunks for k in range(chunks + 1)]
        handle = LookupHandle(
            self, table, works, got_rows, pos, leased, keep=tuple(serves), bounds=bounds, own_in_recv=own_behind
        )
        if dev.type == "cuda":
            handle._reorder_on_side_stream(ready, result)
        return handle


def _own_rows_behind(
    uniq, inverse, n_unique: int, weight, got_rows, base, size, before, n_local, rbase, rows: int, start: int
) -> torch.Tensor:
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
            torch.index_select(
                weight, 0, uniq[b + bf : b + bf + mine] - (k * rows + start), out=got_rows[own_at : own_at + mine]
            )
            own_at += mine
        if size[k] > bf + mine:
            torch.arange(rbase[k] + bf, rbase[k + 1], out=src[b + bf + mine : b + size[k]])
    return src.index_select(0, inverse)


class LookupHandle:
    """An in-flight lookup. ``wait()`` completes the row exchanges and returns the rows in the
    order of the ids passed to ``lookup``. Waiting twice returns the same tensor.

    On CUDA the assembly is queued at once on the engine's side stream, and ``wait()`` orders
    the caller's stream after it. On the CPU (gloo) ``wait()`` assembles.

    Args:
        engine: the engine that started it.
        table: the table's name.
        works: one work object per pipeline piece (none for a world of one rank).
        recv_rows: the receive buffer (or the finished result, for a world of one rank).
        pos: per position of the batch, where its row is: >= 0 in the receive buffer, < 0 in
            the shard, from its end.
        leased: whether the buffers are the arena's leased staging.
        keep: send buffers that must outlive the exchange.
        bounds: the pieces' positions in the ids.
        own_in_recv: CPU: this rank's own rows were copied behind the received ones.
    """

    def __init__(
        self,
        engine: LookupEngine,
        table: str,
        works,
        recv_rows,
        pos,
        leased: bool,
        keep: tuple = (),
        bounds: list[int] | None = None,
        own_in_recv: bool = False,
    ):
        self._engine = engine
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
        self._check = None  # one rank on CUDA: the device's verdict on the ids (checks.Check)
        self._drained = False
        self._delivered = False  # wait() returned the rows once: later waits return them again
        if works:
            engine.pending.add(self)

    @property
    def done(self) -> bool:
        return self._result is not None

    def _empty_result(self) -> torch.Tensor:
        spec = self._engine.parts.tables[self._table]
        return torch.empty(self._bounds[-1], spec.dim, dtype=spec.torch_dtype, device=self._engine.parts.device)

    def _reorder(self, k: int, result: torch.Tensor) -> None:
        """Piece k's rows into the caller's order (duplicates expanded), in ``result``."""
        lo, hi = self._bounds[k], self._bounds[k + 1]
        if hi <= lo:
            return
        if self._own_in_recv:
            torch.index_select(self._recv, 0, self._pos[lo:hi], out=result[lo:hi])
        else:
            gather_rows(result[lo:hi], self._engine.parts.arena.weights[self._table], self._recv, self._pos[lo:hi])

    def _reorder_on_side_stream(self, ready, result: torch.Tensor) -> None:
        """``ready``: an event on the caller's stream after the positions are computed and
        ``result`` allocated."""
        side = self._engine.side_stream()
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
        engine = self._engine
        for work in self._works:
            try:
                work.wait(timedelta(seconds=timeout)) if engine.parts.topology.backend != "nccl" else work.wait()
            except Exception as exc:  # the context is going away; report, do not raise
                engine.log.warning("context.pending_lookup_failed", table=self._table, error=str(exc)[:200])
                break
        if self._queued is not None:
            torch.cuda.current_stream(engine.parts.device).wait_event(self._queued[1])
        self._works = []
        self._drained = True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows. On CUDA the host first waits (bounded) for this lookup's id check and every
        older check record, a small device-to-host read that waits for the lookup's kernels but
        not for later work; then, without ``timeout``, it only orders the caller's stream after
        the row exchange (CUDA semantics: the rows are ready for any later work on that stream).

        Args:
            timeout: seconds; given, the host waits until the rows are ready, at most that long.

        Returns:
            ``[len(ids), dim]`` rows, in the order of the ids.

        Raises:
            ContextClosed: once the context was closed, or reset before the rows were assembled.
            InvalidIds: bad ids of this lookup, found on the device (or an older call's error;
                also :class:`~elastic_emb.errors.NonFiniteGradients`).
            CommunicationError: when the exchange fails, or ``timeout`` passes.
        """
        if self._delivered:
            return self._result  # type: ignore[return-value]
        engine = self._engine
        if engine.retired == "closed" or (
            engine.retired and self._result is None and not (self._drained and self._queued is not None)
        ):
            # After close also for a one-rank world, whose rows were gathered at lookup time: a
            # handle not waited on before close() behaves the same whatever the world size. After
            # a reset, a CPU exchange of the old communicator was drained, never assembled.
            raise ContextClosed(
                f"lookup of table {self._table!r} was waited on after its context "
                f"(generation {engine.parts.topology.generation}) was {engine.retired}; look up again on the "
                f"{'new' if engine.retired == 'closed' else 'reset'} context"
            )
        if self._result is not None:  # a one-rank CPU world gathered the rows at lookup time
            self._delivered = True
            return self._result
        if self._check is not None:  # raises InvalidIds for bad ids (bounded wait for the check)
            engine.parts.checks.raise_through(self._check, timeout)
        what = f"lookup({self._table!r}) row exchange"
        group = engine.parts.group
        try:
            if self._queued is not None:
                result, done = self._queued
                if timeout is not None:
                    group.wait_event(done, timeout, what)
                torch.cuda.current_stream(engine.parts.device).wait_event(done)
            else:
                result = self._empty_result()
                for k, work in enumerate(self._works):
                    group.wait(work, timeout, what, host=timeout is not None)
                    self._reorder(k, result)
            self._result = result
        finally:
            if self._leased:
                engine.parts.arena.release()
                self._leased = False
            self._works = []
            self._keep = ()
            self._queued = None
            engine.pending.discard(self)
        self._delivered = True
        return self._result

    def _settle(self) -> None:
        """The context is about to write rows while this lookup is in flight. On CUDA the lookup
        reads the rows its own rank owns from the shard when it assembles the result, so the
        caller's stream waits for that assembly (no host wait). The CPU path copied them at
        ``lookup()``."""
        if self._queued is not None:
            torch.cuda.current_stream(self._engine.parts.device).wait_event(self._queued[1])
