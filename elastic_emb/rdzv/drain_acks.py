"""The drain's acknowledgements: one signed key per rank, counted only when it verifies.

A drain (``drain.py``, the preStop hook; ``rdzv/handler.py``, the agent before a scale-up) ends
when every worker of the running round has committed the agreed last step and stopped. Each
worker's watcher says how many acknowledgements to expect (``world_size``) and, once stopped,
acknowledges. The drain must not end before that: the preStop hook's return lets kubelet send
SIGTERM, and a worker still in its step would lose the rows it was committing.

**Why not a counter.** A counter (``acks``, an atomic ``add``) cannot be signed, and a store
writer who sets it to the expected number, a value every range check accepts, ends the drain at
once, before any worker has stopped. So the count comes from keys that can be signed:

- each worker writes ``ack/<rank>`` under the round's prefix: the record
  ``{"round": r, "rank": k, "step": s}``, signed with the job's secret (``rdzv/signing.py``; the
  MAC covers the key, so an acknowledgement can be neither made without the secret nor moved to
  another rank or round), and then adds 1 to ``acks``;
- ``world_size``, the count to expect, is signed too (a forged 0 or 1 would end a drain as
  surely as a forged ``acks``);
- a reader (:class:`AckCounter`) counts rank ``k`` of ``0 .. expected-1`` only when ``ack/<k>``
  verifies and its record names rank ``k`` and the reader's round. Anything else is ignored and
  reported once per key: ``control_key_rejected`` (no valid signature) or
  ``drain_ack_rejected`` (a record naming another rank or round, or no record at all).

``acks`` stays, as a hint of *when* to look, never of what to conclude (as every counter in
``rdzv/signing.py``): the reader verifies the per-rank keys only once ``acks`` claims the count
is reached (one store read per missing rank, not one per rank on every poll), and once more when
it gives up, so a counter held low by a store writer delays a drain to its timeout, no more.
A counter that claims more than the keys show is reported once (``drain_acks_unverified``).

Mixed versions (a rolling change): a worker from before this format writes a bare step under
``ack/<rank>`` and an unsigned ``world_size``, which a reader here does not count (and, with a
secret, reports as unreadable); an older reader cannot parse a signed ``world_size``. Either way
that drain ends by its timeout, never early.

Without a secret nothing is signed and the record checks are all there is (the trust model the
README states: whoever can reach the store can steer the job). What no signature prevents: a
store writer can delete keys, as it can delete torch's own state. A deleted ``world_size`` would
read as "no watchers" and end a drain at once, before any commit: rank 0's watcher writes a missing
one back (:func:`keep_expected`, every :data:`RESTORE_EVERY_S` at most; it also writes the new
count after an in-process re-form, which keeps the round), and the preStop client
(``drain.py``) that finds none looks again for :data:`NO_WATCHERS_GRACE` seconds before it answers
"no watchers" (a fresh round's watchers may not have written it yet either). The agent's drain
before a scale-up does not wait: a deletion less than :data:`RESTORE_EVERY_S` before it starts
still reads as "no watchers" there.
"""

from __future__ import annotations

import json
from typing import Any

from elastic_emb.rdzv.keys import KEY_ACK, KEY_ACKS, KEY_WORLD_SIZE, count_value
from elastic_emb.rdzv.signing import Signer, read_signed

__all__ = ["NO_WATCHERS_GRACE", "RESTORE_EVERY_S", "AckCounter", "ack_record", "keep_expected", "read_expected",
           "write_ack", "write_expected"]

RESTORE_EVERY_S = 1.0  # rank 0's watcher checks the round's world_size this often at most
NO_WATCHERS_GRACE = 5.0  # the preStop client's wait for a missing world_size before it answers "no watchers"


def write_expected(store: Any, signer: Signer, prefix: str, world_size: int) -> None:
    """A watcher says how many acknowledgements its round's drain needs (signed)."""
    key = prefix + KEY_WORLD_SIZE
    store.set(key, signer.sign(key, str(int(world_size))))


def keep_expected(store: Any, signer: Signer, prefix: str, world_size: int) -> bytes | None:
    """Rank 0's watcher: write its count when the key is missing (deleted by a store writer) or
    holds another valid one (the world re-formed in process: the same round, a new world size).
    Returns what it replaced (``b""`` for a missing key), or None when it left the key as it was.
    A value that does not verify is left as it is: it is refused by name where it is read."""
    key = prefix + KEY_WORLD_SIZE
    replaced = b""
    if store.check([key]):
        value, _ = signer.verify(key, store.get(key))
        if value is None or value == str(int(world_size)).encode():
            return None
        replaced = bytes(value)
    write_expected(store, signer, prefix, world_size)
    return replaced


def read_expected(store: Any, signer: Signer, prefix: str) -> int | None:
    """The acknowledgements to expect, or None when no watcher wrote the count. Raises
    ValueError naming the key and the value when it is not validly signed (with a secret) or
    not a count in range."""
    key = prefix + KEY_WORLD_SIZE
    if not store.check([key]):
        return None
    raw = store.get(key)
    value, reason = signer.verify(key, raw)
    if value is None:
        raise ValueError(f"store key {key!r} holds {raw!r:.80}, {reason.replace('_', ' ')}: not written with the "
                         f"job secret (check who can reach the rendezvous endpoint)")
    return count_value(key, value)


def ack_record(round_: int, rank: int, step: int) -> str:
    """The value of one rank's acknowledgement (before signing)."""
    return json.dumps({"round": int(round_), "rank": int(rank), "step": int(step)}, separators=(",", ":"))


def write_ack(store: Any, signer: Signer, prefix: str, round_: int, rank: int, step: int) -> None:
    """A worker acknowledges: it committed ``step`` and stopped (its key first, then the hint)."""
    key = prefix + KEY_ACK + str(int(rank))
    store.set(key, signer.sign(key, ack_record(round_, rank, step)))
    store.add(prefix + KEY_ACKS, 1)


def _parse(value: bytes, round_: int, rank: int) -> tuple[int | None, str]:
    """``(step, "")`` when ``value`` is rank ``rank``'s record for round ``round_``, else ``(None, reason)``."""
    try:
        record = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"not an acknowledgement record: {value!r:.80}"
    if not isinstance(record, dict) or set(record) != {"round", "rank", "step"} or not all(
            type(record[k]) is int for k in record):
        return None, f"not an acknowledgement record: {value!r:.80}"
    if record["round"] != round_ or record["rank"] != rank:
        return None, f"names round {record['round']} rank {record['rank']}, not round {round_} rank {rank}"
    if record["step"] < 0:
        return None, f"names step {record['step']}"
    return record["step"], ""


class AckCounter:
    """Counts the verified acknowledgements of one round's drain (see the module docstring)."""

    def __init__(self, store: Any, signer: Signer, prefix: str, round_: int, log: Any = None) -> None:
        self.store, self.signer, self.prefix, self.round, self.log = store, signer, prefix, round_, log
        self.steps: dict[int, int] = {}  # rank -> the step it stopped after (verified)
        self._rejected: set[str] = set()
        self._unverified_reported = False

    def hint(self) -> int:
        """The ``acks`` counter (untrusted: ValueError for anything outside ``[0, MAX_COUNT]``)."""
        return count_value(self.prefix + KEY_ACKS, self.store.add(self.prefix + KEY_ACKS, 0))

    def count(self, expected: int, *, final: bool = False) -> int:
        """The ranks of ``0 .. expected-1`` whose acknowledgement verifies. Reads their keys only
        when the ``acks`` hint claims ``expected`` or ``final`` is set (the last look before a
        timeout); otherwise answers what was verified before."""
        if len(self.steps) >= expected:
            return len(self.steps)
        claimed = self.hint()
        if claimed < expected and not final:
            return len(self.steps)
        for rank in range(expected):
            if rank not in self.steps:
                self._verify(rank)
        verified = sum(1 for rank in self.steps if rank < expected)
        if claimed >= expected and verified < expected and not self._unverified_reported and self.log is not None:
            self._unverified_reported = True
            missing = [r for r in range(expected) if r not in self.steps]
            self.log.warning("drain_acks_unverified", key=self.prefix + KEY_ACKS, claimed=claimed, verified=verified,
                             missing_ranks=missing[:16],
                             reason="the acks counter claims more acknowledgements than the per-rank keys show: "
                             "waiting for the missing ranks (a foreign write, or acks still arriving)")
        return verified

    def _verify(self, rank: int) -> None:
        key = self.prefix + KEY_ACK + str(rank)
        value = read_signed(self.store, self.signer, key, self.log)  # logs a bad signature once per key
        if value is None:
            return
        step, reason = _parse(value, self.round, rank)
        if step is not None:
            self.steps[rank] = step
        elif key not in self._rejected and self.log is not None:
            self._rejected.add(key)
            self.log.warning("drain_ack_rejected", key=key, reason=reason,
                             remedy="an acknowledgement that is not this rank's for this round was written to the "
                             "store: check who can reach the rendezvous endpoint")
