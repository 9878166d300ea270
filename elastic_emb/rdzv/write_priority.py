"""Agent side: a node that keeps losing the compare-and-set of torch's rendezvous state gets a turn.

torch's dynamic rendezvous keeps its whole state under one store key and writes it by
compare-and-set; every agent rewrites it for each heartbeat (``keep_alive_interval``, and this
backend's fresher heartbeat, ``handler.py``). A write succeeds only if nobody wrote between the
writer's read and its write. A node whose read-to-write window is longer than the gap between the
others' writes (a starved process on a loaded host) loses every time, for as long as the others
beat. Seen in the 4-agent drills at load 15-22: an agent that came 1 s before round 0 closed
never got into the participants nor the wait list (``RendezvousTimeoutError`` after the 90 s
join timeout), and then could not even close the rendezvous in 5 s; measured on loopback, a
window of 0.6 s against three agents beating every 0.5 s lost 48 writes in 48 over 30 s.

:class:`WritePriority` gives it a turn. After ``starve_after`` lost writes in a row a node claims
the priority key (``rdzv.keys.write_priority_key``: its node id and its count of losses ever, so
no two claims read the same; signed with the job's secret when it has one). Before each write of
the state, every other agent waits while a live claim of another node stands, at most
``yield_max`` seconds per write (then it writes anyway: a heartbeat is never held past that); the
claimer's next write finds the state quiet and wins, and it clears the claim. A claim whose value
has not changed for ``stale_after`` seconds (its node died, or stopped writing) is ignored. The
bounds follow the heartbeat expiry (``yield_max`` a quarter of it, ``stale_after`` half), so no
live node's heartbeat ages past its expiry because of a claim.

The claim is untrusted input like every store value: it is only compared with this node's id;
a forged or foreign value can delay this agent's writes by ``yield_max`` each for at most
``stale_after`` seconds, never stop them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic_emb.rdzv.signing import Signer, read_signed

MAX_CLAIM_BYTES = 300  # a node id and a count; anything longer is not a claim


class WritePriority:
    """The priority claim of one agent (see the module docstring). ``before_write`` and
    ``after_write`` bracket every compare-and-set of the rendezvous state (``guarded.py``)."""

    def __init__(self, store: Any, key: str, node: str, signer: Signer, expiry_s: float, log: Any = None, *,
                 starve_after: int = 3, poll: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._store = store
        self._key = key
        self._node = node
        self._signer = signer
        self._log = log
        self.yield_max = expiry_s / 4
        self.stale_after = expiry_s / 2
        self._starve_after = starve_after
        self._poll = poll
        self._clock = clock
        self._sleep = sleep
        self._lost = 0  # lost in a row
        self._lost_total = 0  # ever: each claim's value differs from every earlier one
        self._claimed = False
        self._seen: tuple[bytes | None, float] = (None, 0.0)  # a claim's value and when it last changed
        self.yielded_s = 0.0  # total time this agent's writes waited for another node's claim

    def claimant(self) -> str | None:
        """The node whose live claim stands (this node's own included), or None."""
        value = read_signed(self._store, self._signer, self._key, self._log)
        now = self._clock()
        if value != self._seen[0]:
            self._seen = (value, now)
        if not value or len(value) > MAX_CLAIM_BYTES or now - self._seen[1] > self.stale_after:
            return None
        node, _, losses = value.decode("utf-8", "replace").rpartition(" ")
        return node if node and losses.isdigit() else None

    def before_write(self) -> None:
        """Wait while another node's live claim stands, at most ``yield_max`` seconds. The
        claimer itself writes at once (no read: its window is what it must keep short). The
        wait holds torch's heartbeat lock, so this agent's ``num_nodes_waiting`` waits too."""
        if self._claimed:
            return
        start = self._clock()
        while True:
            holder = self.claimant()
            if holder is None or holder == self._node:
                break
            if self._clock() - start >= self.yield_max:
                break
            self._sleep(self._poll)
        self.yielded_s += self._clock() - start

    def after_write(self, won: bool) -> None:
        """Count a lost write; claim the priority after ``starve_after`` in a row, clear it on a win."""
        if won:
            self._lost = 0
            if self._claimed:
                self._claimed = False
                self._store.set(self._key, self._signer.sign(self._key, ""))
            return
        self._lost += 1
        self._lost_total += 1
        if self._lost >= self._starve_after:
            if not self._claimed and self._log is not None:
                self._log.warning("rendezvous_write_priority_claimed", lost_writes=self._lost)
            self._claimed = True
            self._store.set(self._key, self._signer.sign(self._key, f"{self._node} {self._lost_total}"))
