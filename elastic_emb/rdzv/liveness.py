"""Agent side: who of the running round's members is still alive, and why the others are gone.

:class:`Liveness` sorts each member absent from a fresh rendezvous state into **restarting** (in
the wait list, or between torch's exit and join with a live heartbeat), **departed** (a signed
``left`` mark) or **dead** (reported by its orphaned workers, or its heartbeat expired), and keeps
what that needs between polls: the known dead, the eviction marks written, the newest heartbeat
seen per member. The store outage bound propagates; other store errors are logged and retried.

Design: ``docs/RDZV.md`` (section "Members: restarting, departed, dead").
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from elastic_emb.rdzv.counters import read_count
from elastic_emb.rdzv.decode import RendezvousView
from elastic_emb.rdzv.keys import KEY_DEAD, KEY_EVICTED, KEY_LEFT, round_prefix
from elastic_emb.rdzv.outage import StoreOutageError, reraise_signal
from elastic_emb.rdzv.signing import Signer, read_signed

# The members' signed dead reports are read at least this often, whatever the ``dead`` counter (a
# hint of when to read them early) holds: a store writer who holds it at 0 or deletes it delays a
# report's effect by this much at most (torch's heartbeat expiry still finds the dead too).
DEAD_VERIFY_EVERY_S = 5.0


class Liveness:
    """The agent's judgement of the running round's members.

    Args:
        run_id: the rendezvous run id (store keys are scoped by it and the round).
        node: this agent's node id (the signer of its eviction marks).
        signer: the job's control-key signer; with no secret, no eviction marks are written.
        expiry_s: torch's heartbeat expiry (``keep_alive_interval x keep_alive_max_attempt``).
        log: the handler's structlog logger.
        verify_every: seconds between two reads of the members' dead reports at most, whatever
            the ``dead`` counter holds.
    """

    def __init__(
        self,
        run_id: str,
        node: str,
        signer: Signer,
        expiry_s: float,
        log: Any,
        verify_every: float = DEAD_VERIFY_EVERY_S,
    ) -> None:
        self._run_id = run_id
        self._verify_every = verify_every
        self._dead_hint: tuple[int, int | None] = (-1, 0)  # (round, the dead counter) at the last read
        self._dead_read = float("-inf")  # time.monotonic() of the last read of the reports
        self._node = node
        self._signer = signer
        self._expiry_s = expiry_s
        self._log = log
        self.dead: set[str] = set()  # members known dead in the running round
        self._marked_evicted: set[str] = set()
        self._beats: dict[str, float] = {}  # newest heartbeat seen, members of the running round only

    @property
    def beats(self) -> Mapping[str, float]:
        """The newest heartbeat seen per member (epoch seconds), read-only."""
        return dict(self._beats)

    def new_round(self, members: Iterable[str]) -> None:
        """A round completed: the dead are no members now, and a rejoining node starts clean.

        Args:
            members: the new round's members.
        """
        self.dead.clear()
        self._marked_evicted.clear()
        self.observe({}, members)

    def observe(self, beats: Mapping[str, float], members: Iterable[str]) -> None:
        """Remember the heartbeats of a fresh state and forget those of nodes that are neither
        members nor in that state.

        Args:
            beats: epoch seconds by node id of every node in the state, participants and wait
                list (``torch_compat.heartbeats``).
            members: the running round's members, as the handler now counts them.
        """
        keep = set(members) | set(beats)
        merged = {**self._beats, **beats}
        self._beats = {n: t for n, t in merged.items() if n in keep}

    def change(self, round_: int, members: tuple[str, ...], store: Any, view: RendezvousView) -> dict | None:
        """What differs between the running round and the state ``view``.

        Newly dead members are added to :attr:`dead` and, with a job secret, confirmed with a
        signed ``evicted`` mark.

        Args:
            round_: the running round.
            members: its members, as the handler counts them.
            store: the round-key store (``left`` marks are read, ``evicted`` marks written there).
            view: the fresh rendezvous state.

        Returns:
            None when nothing changed; else a dict with ``reason`` (``round_advanced``,
            ``participant_gone`` or ``peer_restarting``), ``departures`` (left on purpose),
            ``deaths`` (reported dead, or the heartbeat expired), ``restarting`` (absent members
            coming back), ``participants`` (the state's) and ``expected``: who should form the
            next round (the participants, the restarting members and the nodes waiting to join;
            None when the round moved on).

        Raises:
            StoreOutageError: when the store stays unreachable past the outage bound.
        """
        if view.round != round_:
            return {
                "reason": "round_advanced",
                "state_round": view.round,
                "departures": [],
                "deaths": [],
                "restarting": [],
                "participants": list(view.nodes),
                "expected": None,
            }
        absent = [n for n in members if n not in view.nodes]
        if not absent:
            return None
        prefix = round_prefix(self._run_id, round_)
        now = time.time()
        restarting, gone = [], []
        for n in absent:
            if n in view.wait_list:
                restarting.append(n)
            elif n in self.dead or self._said_left(store, prefix, round_, n):
                gone.append(n)
            elif now - self._beats.get(n, float("-inf")) < self._expiry_s:
                restarting.append(n)  # between torch's exit and join: not removed for expiry
            else:
                self.dead.add(n)
                gone.append(n)
        dead = [n for n in gone if n in self.dead]
        self._mark_evicted(store, prefix, round_, dead)
        return {
            "reason": "participant_gone" if gone else "peer_restarting",
            "departures": [n for n in gone if n not in dead],
            "deaths": dead,
            "restarting": restarting,
            "participants": list(view.nodes),
            "expected": sorted(set(view.nodes) | set(restarting) | set(view.wait_list)),
        }

    def take_reported_dead(self, round_: int, members: tuple[str, ...], store: Any) -> list[str]:
        """Members that their orphaned workers newly reported dead in this round (signed ``dead``
        keys); they count as known dead from now on. The report is faster than torch's heartbeat
        expiry, and certain: the reporter saw its own agent vanish.

        The reports are read when the ``dead`` counter (read without ``add``: ``rdzv/counters.py``)
        changed since the last read, and at least every ``verify_every`` seconds whatever it
        holds: a forged counter (held at 0, deleted, not a count, high) neither hides a report for
        longer nor makes one: only a signed report counts.

        Args:
            round_: the running round.
            members: its members.
            store: the round-key store.

        Returns:
            The newly reported node ids (empty when the reports cannot be read: logged as
            ``dead_report_unreadable``).

        Raises:
            StoreOutageError: when the store stays unreachable past the outage bound.
        """
        prefix = round_prefix(self._run_id, round_)
        try:
            hint = (round_, read_count(store, prefix + KEY_DEAD))
            now = time.monotonic()
            if hint == self._dead_hint and now - self._dead_read < self._verify_every:
                return []
            self._dead_hint, self._dead_read = hint, now
            reported = [
                n
                for n in members
                if n not in self.dead
                and read_signed(store, self._signer, prefix + f"{KEY_DEAD}/{n}", self._log) is not None
            ]
        except StoreOutageError:
            raise
        except Exception as exc:  # the store is the rendezvous itself; torch's sync will raise too
            reraise_signal(exc)
            self._log.warning("dead_report_unreadable", round=round_, error=repr(exc))
            return []
        self.dead.update(reported)
        return reported

    def _mark_evicted(self, store: Any, prefix: str, round_: int, nodes: list[str]) -> None:
        """With a job secret, confirm each death with a signed eviction mark: a worker of that node
        that still runs (its agent hung or cut off) stops itself only on such a mark."""
        if not self._signer.enabled:
            return
        for n in nodes:
            if n in self._marked_evicted:
                continue
            key = prefix + KEY_EVICTED + n
            try:
                store.set(key, self._signer.sign(key, self._node))
            except StoreOutageError:
                raise
            except Exception as exc:  # the next poll tries again
                reraise_signal(exc)
                self._log.warning("eviction_mark_failed", round=round_, node=n, error=repr(exc))
                continue
            self._marked_evicted.add(n)

    def _said_left(self, store: Any, prefix: str, round_: int, node: str) -> bool:
        try:
            return read_signed(store, self._signer, prefix + KEY_LEFT + node, self._log) is not None
        except StoreOutageError:
            raise  # the bound passed: the agent fails, naming the store
        except Exception as exc:  # unreadable: call it a departure, the restart is the same
            reraise_signal(exc)
            self._log.warning("left_mark_unreadable", round=round_, node=node, error=repr(exc))
            return True
