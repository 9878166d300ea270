"""The communicator state transfer runs on: one world's process group for tensors, its store for JSON.

:class:`Comm` exchanges small JSON objects through the store (:meth:`Comm.exchange`) and moves
bytes over the context's process group, or a gloo group of its own (:meth:`Comm.all_to_all`,
:meth:`Comm.wait_works`). Every wait is bounded by its timeout; :meth:`Comm.abort` and
:meth:`Comm.give_up_on` end waits for peers known gone. :func:`thread_store` gives a background
thread a store client of its own.

Design: ``docs/COMMIT.md`` (section "The communicator").
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from elastic_emb import config
from elastic_emb.errors import _CommAborted, _MemberGone
from elastic_emb.events import get_logger
from elastic_emb.native_calls import exiting, native_call
from elastic_emb.rdzv.counters import increment
from elastic_emb.topology import Topology
from elastic_emb.work_wait import WorkWaits, hold_then_drop

log = get_logger("elastic_emb.state")

# Interruptible waits: the first poll after this many seconds, doubling up to the last (the latency a
# wait adds at most once the keys are there, against store round trips while it waits).
POLL_FIRST, POLL_MAX = 0.0005, 0.01

TRANSPORTS = ("cma", "p2p", "alltoall")  # ELASTIC_EMB_TRANSPORT values (see elastic_emb.state.transport)


def thread_store(store):
    """A client of ``store`` of its own, for a communicator used from a background thread.

    A TCPStore client serves one request at a time: a thread blocked in ``wait()`` on a shared
    client stalls every ``set()`` of the other threads, and two ranks whose threads each wait for
    a key the other rank's stalled thread would set never wake (for example the durable thread
    and the training thread).

    Args:
        store: a c10d store.

    Returns:
        ``store.clone()`` (torch >= 2.8: a connection of its own), or ``store`` itself when it
        cannot be cloned (a Python store).
    """
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.debug("store_not_cloned", store=type(store).__name__, error=str(exc)[:200])
        return store


class Comm:
    """The collective operations state transfer needs, on one world's process group and store.

    Args:
        topology: the generation's topology (rank, world size, backend).
        store: the rendezvous store; this communicator's keys go under a prefix of their own.
        process_group: the context's process group; None: form a gloo group of its own.
        timeout: seconds every wait (store or transfer) is bounded by.
        device: where tensors are moved; None: the current CUDA device on NCCL, else the CPU.
        purpose: names the store prefix, so communicators of different purposes never pair.
        interruptible: wait on the store by polling, so :meth:`abort` from another thread ends it.

    Raises:
        ValueError: if ``ELASTIC_EMB_TRANSPORT`` names a CPU-only transport on a CUDA device.
    """

    def __init__(
        self,
        topology: Topology,
        store,
        process_group=None,
        *,
        timeout: float = 300.0,
        device: torch.device | str | None = None,
        purpose: str = "state",
        interruptible: bool = False,
    ) -> None:
        import torch.distributed as dist

        from elastic_emb.store import generation_store

        self.topology = topology
        self.rank = topology.rank
        self.size = topology.world_size
        self.timeout = timeout
        gen_store = generation_store(store, topology, purpose)
        # this rank's count of communicators of the generation and purpose: every rank counts its
        # own, so their n-th pair up. By compare-and-set, never add (rdzv/counters.py): signed with
        # the job's secret (SignedStore), and a forged value fails the construction naming its key
        self.instance = increment(gen_store, f"instances/rank{self.rank}")
        self.store = dist.PrefixStore(f"c{self.instance}/", gen_store)
        self._own_pg = process_group is None
        if process_group is None:
            pg_store = dist.PrefixStore(f"c{self.instance}/pg/", gen_store)
            process_group = dist.ProcessGroupGloo(pg_store, self.rank, self.size, timedelta(seconds=timeout))
        self.pg = process_group
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if topology.backend == "nccl" else torch.device("cpu")
            )
        self.device = torch.device(device)
        # How rows travel (elastic_emb.state.transport): "cma" (CPU, pull from same-host senders'
        # memory, gloo p2p for any peer that cannot be read), "p2p" (CPU, gloo send/recv) or
        # "alltoall" (one collective over a packed buffer: the only safe way for NCCL).
        self.transport = config.load(None, "transport").transport or (
            "cma" if self.device.type == "cpu" else "alltoall"
        )
        if self.transport != "alltoall" and self.device.type != "cpu":
            raise ValueError(
                f"ELASTIC_EMB_TRANSPORT={self.transport!r}: use 'alltoall' (any device), or 'cma' or "
                f"'p2p' on CPU only; unset it for the default ('cma' on CPU, 'alltoall' on CUDA)"
            )
        self._op = 0
        self.interruptible = interruptible
        self._aborted = threading.Event()
        self._gone: tuple[frozenset[int], str] = (frozenset(), "")  # give_up_on: ranks known gone, why
        self._waits = WorkWaits(f"rank {self.rank} (generation {topology.generation}, state communicator {purpose})")

    def exchange(self, name: str, obj: Any) -> list[Any]:
        """All-gather a JSON-able object through the store (collective).

        Args:
            name: what is exchanged (part of the keys and of error messages).
            obj: this rank's JSON-able value.

        Returns:
            Every rank's value, decoded, in rank order.

        Raises:
            TimeoutError: if some rank did not publish within the timeout.
            _CommAborted: if the wait was ended by :meth:`abort`, the exit, or a rank given up on.
        """
        with native_call():  # store calls, maybe on a background thread: the exit waits for them
            return self._exchange(name, obj)

    def _exchange(self, name: str, obj: Any) -> list[Any]:
        self._op += 1
        if self.size == 1:  # nobody to hear from: no store round trips (the background writer exchanges per commit)
            return [json.loads(json.dumps(obj))]
        base = f"x{self._op}-{name}"
        self.store.set(f"{base}/{self.rank}", json.dumps(obj))
        keys = [f"{base}/{r}" for r in range(self.size)]
        try:
            if self.interruptible or self._aborted.is_set() or self._gone[0]:  # aborted: missing keys raise now
                self._poll(keys, name)
            else:
                self.store.wait(keys, timedelta(seconds=self.timeout))
        except (_CommAborted, _MemberGone):  # ended on purpose: a peer is gone (not a timeout)
            raise
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise TimeoutError(
                f"state exchange {name!r} (generation {self.topology.generation}): ranks {missing} did "
                f"not publish within {self.timeout}s; they died or are stuck: restart the workers"
            ) from exc
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def _poll(self, keys: list[str], name: str) -> None:
        """Wait for ``keys`` (``keys[r]``: rank r's) by polling (bounded by the timeout), ending
        early on :meth:`abort`, or when a key of a rank given up on (:meth:`give_up_on`) is missing."""
        deadline = time.monotonic() + self.timeout
        pause = POLL_FIRST
        while not self.store.check(keys):
            if self._aborted.wait(pause):
                raise _CommAborted(
                    f"state exchange {name!r} (generation {self.topology.generation}) abandoned: "
                    f"the communicator was aborted (a peer died)"
                )
            if exiting():
                raise _CommAborted(
                    f"state exchange {name!r} (generation {self.topology.generation}) abandoned: the process is exiting"
                )
            gone, why = self._gone
            missing = [r for r in sorted(gone) if r < len(keys) and not self.store.check([keys[r]])]
            if missing:
                raise _CommAborted(
                    f"state exchange {name!r} (generation {self.topology.generation}) abandoned: "
                    f"ranks {missing} will never publish ({why})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout}s for {len(keys)} keys")
            pause = min(2 * pause, POLL_MAX)

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """Send ``send[d]`` to rank ``d`` and receive from every rank (collective).

        Args:
            send: one uint8 tensor per rank (empty for none); a single non-empty contiguous one on
                this device is sent without a copy.
            recv_sizes: the bytes to receive from each rank.

        Returns:
            The byte buffers received, one per rank, as views of one buffer.
        """
        in_splits = [int(t.numel()) for t in send]
        full = [t for t in send if t.numel()]
        if len(full) == 1 and full[0].device == self.device and full[0].is_contiguous():
            inp = full[0].view(-1)  # one peer gets bytes (a replica to the neighbour): sent as they are, no copy
        elif send:
            inp = torch.cat([t.to(self.device) for t in send])
        else:
            inp = torch.empty(0, dtype=torch.uint8, device=self.device)
        return self.all_to_all_flat(inp, in_splits, recv_sizes)

    def all_to_all_flat(
        self, inp: torch.Tensor, in_splits: list[int], recv_sizes: list[int], out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """One ``alltoall_base`` of a flat uint8 buffer; every rank calls it, even with nothing to move.

        Args:
            inp: the bytes to send, one split per rank back to back.
            in_splits: the bytes for each rank.
            recv_sizes: the bytes to receive from each rank.
            out: a buffer of ``sum(recv_sizes)`` bytes to receive into; None: a new one.

        Returns:
            The received bytes, split per rank (views of ``out``).

        Raises:
            ValueError: if ``out`` has the wrong size.
            TransferInterrupted: if the communicator was aborted before or during the transfer.
            RuntimeError: if the transfer failed or did not complete within the timeout.
        """
        import torch.distributed as dist

        if out is None:
            out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        elif out.numel() != sum(recv_sizes):
            raise ValueError(f"all_to_all_flat: out has {out.numel()} bytes, expected {sum(recv_sizes)}")
        opts = dist.AllToAllOptions()
        opts.timeout = timedelta(seconds=self.timeout)
        self.check(f"all-to-all of {sum(in_splits)} bytes")
        work = self.pg.alltoall_base(out, inp, list(recv_sizes), list(in_splits), opts)
        self.wait_works([work], f"all-to-all of {sum(in_splits)} bytes")
        return list(torch.split(out, list(recv_sizes)))

    def check(self, what: str) -> None:
        """Refuse to post a transfer that could only be abandoned.

        Args:
            what: the transfer, for the error message.

        Raises:
            TransferInterrupted: if :meth:`abort` was called.
        """
        self._waits.check(what)

    def wait_works(self, works: list, what: str) -> None:
        """Wait for transfers posted on :attr:`pg`, bounded by the timeout.

        On gloo, :meth:`abort` ends the wait at once; transfers left behind are held by a daemon
        thread until they end. On NCCL the wait only orders the current stream.

        Args:
            works: the work objects of the posted transfers.
            what: the transfers, for messages.

        Raises:
            TransferInterrupted: if :meth:`abort` ended the wait (gloo).
            RuntimeError: naming ``what``, if a transfer failed or the time ran out.
        """
        if self.device.type != "cpu":  # NCCL: wait() orders the current stream, the host does not block
            ok = all(w.wait() for w in works)
        else:
            try:
                ok = self._waits.wait(works, self.timeout, what)
            finally:
                abandoned = self._waits.take_abandoned()
                if abandoned:  # interrupted or timed out: a thread holds the group until they end
                    bound = self.timeout + 1.0  # gloo fails them at its timeout
                    pending = functools.partial(
                        log.warning, "state_abandoned_work_pending", works=len(abandoned), seconds=bound
                    )
                    threading.Thread(
                        target=hold_then_drop,
                        args=([self.pg], abandoned, bound, pending),
                        name="elastic_emb-comm-hold",
                        daemon=True,
                    ).start()
        if not ok:
            raise RuntimeError(
                f"{what} failed on rank {self.rank} (generation {self.topology.generation}): not "
                f"complete within {self.timeout}s; a peer died or is stuck: re-form the world"
            )

    def formed_on(self, process_group) -> bool:
        """Whether this communicator was made for ``process_group``.

        Args:
            process_group: a context's process group, or None.

        Returns:
            True for the same group, or for None when this communicator formed a gloo group of its
            own.
        """
        return process_group is None if self._own_pg else self.pg is process_group

    def barrier(self, name: str) -> None:
        """Wait until every rank reached this point (an :meth:`exchange` of nothing).

        Args:
            name: the barrier's name (part of its keys).
        """
        self.exchange(name, 0)

    def abort(self, reason: str = "the communicator was aborted (a peer died)") -> None:
        """A peer died (callable from any thread): end this communicator's waits now.

        An interruptible wait on the store raises :class:`_CommAborted` now instead of at its
        timeout, a wait on a gloo transfer raises :class:`~elastic_emb.errors.TransferInterrupted`
        (a ``_CommAborted``), and so does every later one. The transfer itself is abandoned: it
        runs out on its own thread, holding its tensors, until it completes, fails or times out.

        Args:
            reason: why, for the errors raised.
        """
        self._aborted.set()
        self._waits.interrupt(reason)

    def give_up_on(self, ranks, reason: str) -> None:
        """Ranks of this generation left the rendezvous (callable from any thread).

        An exchange that still misses one of their keys raises :class:`_CommAborted` now, since
        they will never write it; one whose gone ranks had all published (a node that drained
        after its part of the commit) still waits for the live ranks and completes. Unlike
        :meth:`abort`, a transfer in flight is not ended: it cannot tell which peer it waits for,
        and a gloo transfer from a process that exited fails on its own.

        Args:
            ranks: the ranks gone (added to those given before).
            reason: why, for the errors raised.
        """
        gone = frozenset(int(r) for r in ranks)
        self._gone = (self._gone[0] | gone, reason)

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def close(self) -> None:
        """Release the process group this communicator formed (not a context's). After
        :meth:`abort`, gloo's ``abort`` (its connections close: a transfer abandoned on a live
        peer fails there too; it returns at once) and the communicator drops the group: a gloo
        group's destructor joins its worker threads, so it is dropped last by the thread that
        holds it for an abandoned transfer (``hold_then_drop``), never by the re-form."""
        if not self._own_pg or self.pg is None:
            return
        if self._aborted.is_set() and hasattr(self.pg, "abort"):
            pg, self.pg = self.pg, None
            _release(pg, "abort")
        elif hasattr(self.pg, "shutdown"):
            _release(self.pg, "shutdown")


def _release(pg, method: str) -> None:
    try:
        getattr(pg, method)()
    except Exception as exc:  # teardown of a broken world: report, do not mask the caller's error
        log.warning("state_comm_close_failed", method=method, error=repr(exc))
