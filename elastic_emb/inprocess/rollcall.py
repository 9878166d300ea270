"""Roll call after a failed collective: which member nodes of a generation still answer.

Why: a collective fails at once when a peer's process dies (its TCP connections reset), but the
rendezvous learns of a SIGKILLed node only when its heartbeat expires (``keep_alive_interval x
keep_alive_max_attempt``, seconds). Waiting for that made an in-process re-form after a node kill
take the expiry plus the re-form. The survivors know much sooner: each of them saw its own
collective fail, and a live process can say so.

Protocol (keys under ``rdzv.keys.inproc_prefix(run_id, generation)``, the generation being
formed; the caller raises the run's generation high-water mark first, ``resize.py``):

1. A worker whose collective failed (or that saw another worker's call, below) sets the
   ``failed`` flag and its own signed ``alive/<node>/<local rank>`` mark.
2. Every other worker's watcher reads the flag at its next poll (``Watcher.watch_failures``):
   a worker blocked in a store wait (a commit's exchange with the dead peer) is interrupted, a
   worker at a step boundary re-forms at once; a worker blocked in a collective fails as soon as
   the first survivor aborts its communicator (``InProcessResize.run`` aborts before the call).
3. :meth:`RollCall.absent` waits until every member node either has all ``local_world_size``
   marks, is gone from the rendezvous state, or is proven dead (below); a node still unmarked
   is waited for ``patience`` seconds while its workers are proven alive, ``grace`` seconds when
   nothing is known of it, and then taken as dead. A node with a local worker missing is absent
   as a whole: its agent restarts it (rejoin or restart mode), never half a node.

Between collectives nothing fails: idle workers (or a node killed while the others sleep
between steps) would learn of a dead node only at its heartbeat expiry. So local rank 0 of each
member node probes the workers of the *next* member node (in the generation's order, wrapping)
every ``NEIGHBOUR_EVERY_S`` (:func:`watch_neighbour`, one connection per worker probed: every
node is watched by one other, not by all); at that worker's next step boundary a refusal counts
as a failed collective, and the roll call follows (its flag brings in the others). Not before:
a peer that finished training and exited refuses too. Two adjacent nodes lost at once: the
second is still found by the roll call's own probes or its heartbeat.

Faster and certain where it applies: every worker listens on a TCP socket of its own
(:class:`Prober`, its address signed under the prefix of each generation it is in, so a
crashed worker's stale address is never probed in a later one) that it never closes while it lives. A
connection refused there means no process holds the port: that worker is dead (its host up, as
after a SIGKILL). The roll call takes such a node as absent at once, and a survivor blocked in a
store wait for a peer (a commit's exchange: no collective fails there) probes the members once
the wait has lasted ``PROBE_AFTER_S``, so a node killed then is found without its heartbeat
expiring. A probe accepted proves the worker alive (the kernel accepts for a busy or starved
process too: the roll call waits for its answer); timed out or unreachable proves nothing.

The trade-off, stated: a worker that cannot answer within ``patience`` (proven alive: hung) or
``grace`` (unknown: no socket reachable) is taken for dead; it then finds itself outside the
decision and asks for a restart (``resize_fallback``): slower, never wrong. Nobody answers for nobody: a mark is
signed with the job's secret when it has one.
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
    """The member node after ``me`` in the generation's order (wrapping), as a 1-tuple; empty
    when ``me`` is not a member or is the only one."""
    if me not in members or len(members) < 2:
        return ()
    return (members[(members.index(me) + 1) % len(members)],)


def watch_neighbour(owner, tick: Callable[[object], None], log, every: float = NEIGHBOUR_EVERY_S) -> threading.Thread:
    """Call ``tick(owner)`` every ``every`` seconds in a daemon thread for as long as ``owner``
    lives (held by a weak reference: the thread ends once ``owner`` is collected). An error of one
    tick is reported once per kind and the next tick runs."""
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
    """The roll call of the re-form into ``generation`` (see the module docstring)."""

    def __init__(self, store, run_id: str, generation: int, signer: Signer, log) -> None:
        self._store = store
        self._prefix = inproc_prefix(run_id, generation)
        self._signer = signer
        self._log = log

    @property
    def failed_key(self) -> str:
        return self._prefix + KEY_FAILED

    def _mark(self, node: str, local_rank: int) -> str:
        return f"{self._prefix}{KEY_ALIVE}{node}/{local_rank}"

    def flag(self) -> None:
        """Flag the failure of the generation before this one: every member's watcher sees it."""
        self._store.set(self.failed_key, b"1")

    def answer(self, node: str, local_rank: int) -> None:
        """This worker is alive and re-forming: flag the failure for the others, then answer."""
        self.flag()
        self.present(node, local_rank)

    def present(self, node: str, local_rank: int) -> None:
        """Answer without flagging: a worker that re-forms for a departure it saw in the
        rendezvous (no collective failed) while another member may hold a roll call for the same
        change (its neighbour probe found the departed worker dead first), which would otherwise
        wait ``patience`` for this live worker's answer."""
        key = self._mark(node, local_rank)
        self._store.set(key, self._signer.sign(key, node))

    def _answered(self, node: str, local_world_size: int) -> bool:
        keys = [self._mark(node, r) for r in range(local_world_size)]
        if not self._store.check(keys):
            return False
        if not self._signer.enabled:
            return True
        return all(read_signed(self._store, self._signer, k, self._log) == node.encode() for k in keys)

    def absent(self, nodes: Iterable[str], local_world_size: int, gone: Callable[[], Iterable[str]], grace: float,
               prober: "Prober | None" = None, patience: float = 10.0, poll: float = 0.005) -> tuple[str, ...]:
        """The nodes of ``nodes`` that are gone from the rendezvous (``gone()``) or did not answer,
        in ``nodes``' order. A node that has not answered is waited for: not at all once a worker
        of it refuses the ``prober``'s connection (dead), up to ``patience`` seconds while its
        sockets accept (alive, busy: a long step or commit), up to ``grace`` seconds when nothing
        is known of it (no prober, no address, no connection)."""
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
    """Kernel-level liveness of the workers of one run (module docstring): :meth:`listen` opens
    this worker's socket, :meth:`enter` publishes its address for a generation and probes that
    generation's members from then on; :meth:`dead` probes. ``found`` holds the members the last
    probe of a store wait found dead (cleared by :meth:`enter`)."""

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
        """Listen on the node's address (the one in its rendezvous id, ``addr_pid_localid``) for
        as long as this process lives. A daemon thread accepts and closes every probe, so the
        backlog never fills."""
        host = node.rsplit("_", 2)[0]
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, name="elastic_emb-liveness", daemon=True).start()
        self._me = (node, local_rank)

    def enter(self, generation: int, members: tuple[str, ...], local_world_size: int) -> None:
        """This worker is in ``generation`` (before its agreement): publish its address there
        (signed) and probe ``members`` by their addresses of that generation from now on."""
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
            if not host or not port.isdigit() or host != node.rsplit("_", 2)[0]:
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
        """Per node: False when a worker's socket refused a connection (dead), True when every
        worker's accepted (alive), None when nothing is known."""
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
        """The nodes of ``nodes`` with a worker whose socket refused a connection."""
        return tuple(n for n, v in self.status(nodes, local_world_size).items() if v is False)

    def probe_members(self) -> tuple[str, ...]:
        """During a long store wait: probe the members, at most every ``PROBE_EVERY_S``."""
        now = time.monotonic()
        if not self.found and now - self._probed >= PROBE_EVERY_S:
            self._probed = now
            self.found = self.dead(self.members, self.local_world_size)
            if self.found:
                self._log.warning("liveness_probe_refused", nodes=list(self.found))
        return self.found
