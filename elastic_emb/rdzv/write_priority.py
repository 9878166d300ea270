"""Agent side: a node that keeps losing the compare-and-set of torch's rendezvous state gets a turn.

torch writes its whole state under one key by compare-and-set, and every agent rewrites it for
each heartbeat, so a slow writer can lose every time. :class:`WritePriority` lets such a node
claim a turn after a few losses in a row; the other agents hold their writes while a live claim
stands, for a bounded time per write, so no live node's heartbeat expires because of a claim.

Design: ``docs/RDZV.md`` (section "Write priority").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic_emb.rdzv.signing import Signer, read_signed

MAX_CLAIM_BYTES = 300  # a node id and a count; anything longer is not a claim


class WritePriority:
    """The priority claim of one agent. :meth:`before_write` and :meth:`after_write` bracket every
    compare-and-set of the rendezvous state (``guarded.py``).

    Args:
        store: the store the rendezvous runs on.
        key: the claim's key (``keys.write_priority_key``).
        node: this agent's node id.
        signer: the job's control-key signer.
        expiry_s: torch's heartbeat expiry in seconds; a write yields at most a quarter of it
            (``yield_max``) and a claim unchanged for half of it is stale (``stale_after``).
        log: a structlog logger (``rendezvous_write_priority_claimed``), or None.
        starve_after: lost writes in a row before this agent claims the priority.
        poll: seconds between looks at the claim while yielding.
        clock: the monotonic clock.
        sleep: the sleep function.
    """

    def __init__(
        self,
        store: Any,
        key: str,
        node: str,
        signer: Signer,
        expiry_s: float,
        log: Any = None,
        *,
        starve_after: int = 3,
        poll: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
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
        """The node whose live claim stands (this node's own included).

        Returns:
            Its node id, or None when there is no claim, or it is empty, too long, malformed,
            not validly signed or unchanged for ``stale_after`` seconds.
        """
        value = read_signed(self._store, self._signer, self._key, self._log)
        now = self._clock()
        if value != self._seen[0]:
            self._seen = (value, now)
        if not value or len(value) > MAX_CLAIM_BYTES or now - self._seen[1] > self.stale_after:
            return None
        node, _, losses = value.decode("utf-8", "replace").rpartition(" ")
        return node if node and (losses.isascii() and losses.isdigit()) else None

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
        """Count a lost write; claim the priority after ``starve_after`` in a row, clear it on a win.

        Args:
            won: whether the compare-and-set wrote.
        """
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
