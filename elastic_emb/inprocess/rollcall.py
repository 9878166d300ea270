"""Roll call after a failed collective: which member nodes of a generation still answer.

The rendezvous learns of a SIGKILLed node only when its heartbeat expires; the survivors know
sooner. :class:`RollCall`: the survivors flag the failure and answer with signed marks, and
:meth:`RollCall.absent` says which member nodes did not. :class:`Prober`: each worker's liveness
socket, whose refused connection proves a worker dead. :func:`watch_neighbour`: local rank 0 of
each node probes the next member node between collectives.

Design: ``docs/RESIZE.md`` (section "The roll call").
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from elastic_emb.native_calls import exiting, native_call
from elastic_emb.rdzv.keys import inproc_prefix
from elastic_emb.rdzv.signing import Signer, read_signed

KEY_FAILED = "failed"  # a collective of the generation before this one failed [flag]
KEY_ALIVE = "alive/"  # + node + "/" + local rank: that worker answered the roll call [control]
KEY_PROBE = "probe/"  # under inproc_prefix: + node + "/" + local rank: its liveness socket HOST:PORT [control]
PROBE_AFTER_S = 0.2  # a store wait this long probes the members (a healthy exchange takes milliseconds)
PROBE_EVERY_S = 0.1
NEIGHBOUR_EVERY_S = 0.1  # local rank 0 of each node probes the next node's workers this often


def next_node(members: tuple[str, ...], me: str) -> tuple[str, ...]:
    """The member node after ``me`` in the generation's order, wrapping.

    Args:
        members: the generation's nodes, in order.
        me: this worker's node.

    Returns:
        A 1-tuple of the next node; empty when ``me`` is not a member or is the only one.
    """
    if me not in members or len(members) < 2:
        return ()
    return (members[(members.index(me) + 1) % len(members)],)


def watch_neighbour(owner, tick: Callable[[object], None], log, every: float = NEIGHBOUR_EVERY_S) -> threading.Thread:
    """Call ``tick(owner)`` every ``every`` seconds in a daemon thread for as long as ``owner`` lives.

    The thread holds ``owner`` by a weak reference and ends once it is collected, or when the
    process starts to exit. An error of one tick is logged once per kind and the next tick runs.

    Args:
        owner: the object the ticks are for.
        tick: called with ``owner`` at each tick.
        log: the logger for a failed tick.
        every: seconds between ticks.

    Returns:
        The started thread.
    """
    ref = weakref.ref(owner)
    del owner

    def run() -> None:
        reported: set[str] = set()
        while True:
            time.sleep(every)
            target = ref()
            if target is None or exiting():
                return
            try:
                with native_call():  # store reads: the process's exit waits for one in flight
                    tick(target)
            except Exception as exc:  # the heartbeat and the collectives still find the dead
                if type(exc).__name__ not in reported:
                    reported.add(type(exc).__name__)
                    log.warning("liveness_neighbour_probe_failed", error=repr(exc)[:300])
            del target

    thread = threading.Thread(target=run, name="elastic_emb-neighbour-probe", daemon=True)
    thread.start()
    return thread


class RollCall:
    """The roll call of the re-form into ``generation``: who of the previous one still answers.

    Its keys live under ``inproc_prefix(run_id, generation)``; the caller raises the run's
    generation high-water mark before any of them is written.

    Args:
        store: the rendezvous store.
        run_id: the run.
        generation: the generation being formed.
        signer: signs the answers (when the job has a secret) and verifies them.
        log: the logger for rejected marks.
    """

    def __init__(self, store, run_id: str, generation: int, signer: Signer, log) -> None:
        self._store = store
        self._prefix = inproc_prefix(run_id, generation)
        self._signer = signer
        self._log = log

    @property
    def failed_key(self) -> str:
        """The key of the failure flag that every member's watcher reads."""
        return self._prefix + KEY_FAILED

    def _mark(self, node: str, local_rank: int) -> str:
        return f"{self._prefix}{KEY_ALIVE}{node}/{local_rank}"

    def flag(self) -> None:
        """Flag the failure of the generation before this one: every member's watcher sees it."""
        self._store.set(self.failed_key, b"1")

    def answer(self, node: str, local_rank: int) -> None:
        """This worker is alive and re-forming: flag the failure for the others, then answer.

        Args:
            node: this worker's node.
            local_rank: this worker's rank on its node.
        """
        self.flag()
        self.present(node, local_rank)

    def present(self, node: str, local_rank: int) -> None:
        """Answer without flagging the failure.

        For a worker that re-forms for a departure it saw in the rendezvous (no collective
        failed) while another member may hold a roll call for the same change, which would
        otherwise wait ``patience`` for this live worker's answer.

        Args:
            node: this worker's node.
            local_rank: this worker's rank on its node.
        """
        key = self._mark(node, local_rank)
        self._store.set(key, self._signer.sign(key, node))

    def _answered(self, node: str, local_world_size: int) -> bool:
        keys = [self._mark(node, r) for r in range(local_world_size)]
        if not self._store.check(keys):
            return False
        if not self._signer.enabled:
            return True
        return all(read_signed(self._store, self._signer, k, self._log) == node.encode() for k in keys)

    def absent(
        self,
        nodes: Iterable[str],
        local_world_size: int,
        gone: Callable[[], Iterable[str]],
        grace: float,
        prober: "Prober | None" = None,
        patience: float = 10.0,
        poll: float = 0.005,
    ) -> tuple[str, ...]:
        """The member nodes that are gone or did not answer the roll call.

        A node that has not answered is waited for: not at all once a worker of it refuses the
        ``prober``'s connection (dead), up to ``patience`` seconds while its sockets accept
        (alive, busy: a long step or commit), up to ``grace`` seconds when nothing is known of it
        (no prober, no address, no connection). A node answers only when all its workers have.

        Args:
            nodes: the generation's member nodes, in order.
            local_world_size: workers per node.
            gone: returns the nodes gone from the rendezvous state.
            grace: seconds to wait for a node nothing is known of.
            prober: the liveness prober, or None.
            patience: seconds to wait for a node proven alive.
            poll: seconds between looks.

        Returns:
            The absent nodes, in ``nodes``' order.
        """
        nodes = tuple(nodes)
        start = time.monotonic()
        answered: set[str] = set()
        dead: set[str] = set()
        alive: set[str] = set()
        probed = float("-inf")
        while True:
            now = time.monotonic()
            if prober is not None and now - probed >= 0.05:
                probed = now
                status = prober.status([n for n in nodes if n not in answered and n not in dead], local_world_size)
                dead |= {n for n, v in status.items() if v is False}
                alive = {n for n, v in status.items() if v is True}
            left = set(gone()) | dead
            for n in nodes:
                if n not in answered and n not in left and self._answered(n, local_world_size):
                    answered.add(n)
            missing = [n for n in nodes if n not in answered and n not in left]
            waited = time.monotonic() - start
            if all(waited >= (patience if n in alive else grace) for n in missing):
                return tuple(n for n in nodes if n not in answered or n in left)
            time.sleep(poll)


class Prober:
    """Kernel-level liveness of the workers of one run, through a TCP socket per worker.

    :meth:`listen` opens this worker's socket, :meth:`enter` publishes its address for a
    generation and probes that generation's members from then on; :meth:`status` and :meth:`dead`
    probe. A refused connection proves a worker dead; an accepted one proves it alive; a timeout
    proves nothing. ``found`` holds the members the last probe of a store wait found dead
    (cleared by :meth:`enter`).

    Args:
        store: the rendezvous store, where the addresses are published.
        run_id: the run.
        signer: signs and verifies the addresses.
        log: the logger for rejected addresses and refused probes.
        timeout: seconds a probe's connection may take.
    """

    def __init__(self, store, run_id: str, signer: Signer, log, timeout: float = 0.1) -> None:
        self._store = store
        self._run_id = run_id
        self._signer = signer
        self._log = log
        self._timeout = timeout
        self._addrs: dict[tuple[str, int], tuple[str, int]] = {}  # of ``generation``
        self._sock: socket.socket | None = None
        self._me: tuple[str, int] | None = None
        self.generation = -1
        self.members: tuple[str, ...] = ()
        self.local_world_size = 1
        self.found: tuple[str, ...] = ()
        self._probed = 0.0

    def listen(self, node: str, local_rank: int) -> None:
        """Listen on the node's address for as long as this process lives.

        A daemon thread accepts and closes every probe, so the backlog never fills.

        Args:
            node: this worker's node, a rendezvous id ``addr_pid_localid`` whose address is used.
            local_rank: this worker's rank on its node.

        Raises:
            OSError: the socket cannot be bound on the node's address.
        """
        host = node.rsplit("_", 2)[0]
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, name="elastic_emb-liveness", daemon=True).start()
        self._me = (node, local_rank)

    def enter(self, generation: int, members: tuple[str, ...], local_world_size: int) -> None:
        """This worker is in ``generation``: publish its address there and probe its members.

        Call it before the generation's agreement. The address is signed; the members are probed
        by their addresses of that generation from now on.

        Args:
            generation: the generation this worker is in.
            members: the generation's nodes, in order.
            local_world_size: workers per node.
        """
        self.generation, self.members, self.local_world_size = generation, tuple(members), local_world_size
        self._addrs, self.found = {}, ()
        if self._me is not None and self._sock is not None:
            node, local_rank = self._me
            key = f"{inproc_prefix(self._run_id, generation)}{KEY_PROBE}{node}/{local_rank}"
            host = node.rsplit("_", 2)[0]
            self._store.set(key, self._signer.sign(key, f"{host}:{self._sock.getsockname()[1]}"))

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def _addr(self, node: str, local_rank: int) -> tuple[str, int] | None:
        if (node, local_rank) not in self._addrs:
            key = f"{inproc_prefix(self._run_id, self.generation)}{KEY_PROBE}{node}/{local_rank}"
            if not self._store.check([key]):
                return None
            value = read_signed(self._store, self._signer, key, self._log)
            host, _, port = (value or b"").decode().rpartition(":")
            if not host or not (port.isascii() and port.isdigit()) or host != node.rsplit("_", 2)[0]:
                self._log.warning("liveness_address_rejected", node=node, value=(value or b"")[:80])
                return None
            self._addrs[(node, local_rank)] = (host, int(port))
        return self._addrs[(node, local_rank)]

    def _probe(self, addr: tuple[str, int]) -> bool | None:
        """True: accepted (alive); False: refused (dead); None: timed out or unreachable."""
        try:
            with socket.create_connection(addr, timeout=self._timeout):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:  # proves nothing
            return None

    def status(self, nodes: Iterable[str], local_world_size: int) -> dict[str, bool | None]:
        """Probe the workers of ``nodes``.

        Args:
            nodes: the nodes to probe.
            local_world_size: workers per node.

        Returns:
            Per node: False when a worker's socket refused a connection (dead), True when every
            worker's accepted (alive), None when nothing is known.
        """
        out: dict[str, bool | None] = {}
        for n in nodes:
            seen = []
            for r in range(local_world_size):
                addr = self._addr(n, r)
                seen.append(None if addr is None else self._probe(addr))
                if seen[-1] is False:
                    break
            out[n] = False if False in seen else (True if all(v is True for v in seen) else None)
        return out

    def dead(self, nodes: Iterable[str], local_world_size: int) -> tuple[str, ...]:
        """The nodes with a worker whose socket refused a connection.

        Args:
            nodes: the nodes to probe.
            local_world_size: workers per node.

        Returns:
            The dead nodes, in ``nodes``' order.
        """
        return tuple(n for n, v in self.status(nodes, local_world_size).items() if v is False)

    def probe_members(self) -> tuple[str, ...]:
        """During a long store wait: probe the members, at most every ``PROBE_EVERY_S``.

        Returns:
            The members found dead (kept in ``found``; no new probe once some are).
        """
        now = time.monotonic()
        if not self.found and now - self._probed >= PROBE_EVERY_S:
            self._probed = now
            self.found = self.dead(self.members, self.local_world_size)
            if self.found:
                self._log.warning("liveness_probe_refused", nodes=list(self.found))
        return self.found
