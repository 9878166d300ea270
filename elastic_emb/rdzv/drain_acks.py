"""The drain's acknowledgements: one signed key per rank, counted only when it verifies.

- :func:`write_expected`, :func:`keep_expected`, :func:`read_expected`: the signed count to expect;
- :func:`write_local_count`, :func:`read_local_count`: the same count from a node's watchers to
  their own agent through a file, which a store writer cannot delete;
- :func:`write_ack`: a stopped worker's signed ``{round, rank, step}`` record, then the ``acks`` hint;
- :class:`AckCounter`: counts the ranks whose record verifies (the ``acks`` counter only says when to
  look early: the missing ranks' records are read at least every :data:`VERIFY_EVERY_S` whatever
  it holds, so a counter held low or forged delays nothing by more than that);
- :func:`agree_stop_step`: the ranks agree on the last step with one compare-and-set of a signed value.

Design: ``docs/RDZV.md`` (section "The drain").
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastic_emb.rdzv.counters import increment, read_count
from elastic_emb.rdzv.keys import KEY_ACK, KEY_ACKS, KEY_STOP_STEP, KEY_WORLD_SIZE, count_value
from elastic_emb.rdzv.localfile import read_regular, write_replacing
from elastic_emb.rdzv.signing import Signer, read_signed, report_rejected

__all__ = [
    "NO_WATCHERS_GRACE",
    "RESTORE_EVERY_S",
    "VERIFY_EVERY_S",
    "AckCounter",
    "ack_record",
    "agree_stop_step",
    "keep_expected",
    "read_expected",
    "read_local_count",
    "write_ack",
    "write_expected",
    "write_local_count",
]

RESTORE_EVERY_S = 1.0  # rank 0's watcher checks the round's world_size this often at most
VERIFY_EVERY_S = 1.0  # the missing ranks' acknowledgements are read this often at least, whatever the hint
NO_WATCHERS_GRACE = 5.0  # the preStop client's wait for a missing world_size before it answers "no watchers"


STOP_STEP_TIMEOUT = 10.0  # seconds agree_stop_step keeps replacing values it cannot trust
MAX_STEP = 1 << 62  # a stop step above this is not one


def agree_stop_step(store: Any, signer: Signer, prefix: str, proposal: int, log: Any = None) -> int:
    """The round's last step, the same for every rank: the first valid value written wins.

    One compare-and-set writes ``proposal`` (signed) only where no value is; a rank that finds a
    valid value takes it. A value it cannot trust (unsigned or badly signed with a secret, not a
    step) is replaced by the same compare-and-set on exactly that value, so a store writer who
    plants one cannot stall the drain, and there is no claim counter to forge or to leave claimed
    by a rank that died before writing.

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix (``keys.round_prefix``).
        proposal: this rank's stop step (its current step + 1).
        log: a structlog logger for ``control_key_rejected`` events, or None.

    Returns:
        The agreed stop step.

    Raises:
        TimeoutError: when values that cannot be trusted keep replacing this rank's for
            :data:`STOP_STEP_TIMEOUT` seconds (a store writer rewriting the key in a loop).
    """
    key = prefix + KEY_STOP_STEP
    mine = signer.sign(key, str(proposal))
    expected = b""
    deadline = time.monotonic() + STOP_STEP_TIMEOUT
    while True:
        current = store.compare_set(key, expected, mine)
        current = current.encode() if isinstance(current, str) else bytes(current)
        value, reason = signer.verify(key, current)
        text = value.decode("ascii", errors="replace") if value is not None else ""
        if text.isascii() and text.isdigit() and int(text) <= MAX_STEP:
            return int(text)
        report_rejected(signer, key, reason or "not a step", log)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"drain of round prefix {prefix!r}: {key} was rewritten with values that are not signed stop steps "
                f"for {STOP_STEP_TIMEOUT:g} s; find what writes to the rendezvous store (set ELASTIC_EMB_JOB_SECRET)"
            )
        # Replace exactly the value read; when it matched nothing (the key is gone), create it.
        expected = b"" if current == expected else current
        time.sleep(0.005)


def write_expected(store: Any, signer: Signer, prefix: str, world_size: int) -> None:
    """A watcher says how many acknowledgements its round's drain needs (signed).

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix (``keys.round_prefix``).
        world_size: the number of ranks that will acknowledge.
    """
    key = prefix + KEY_WORLD_SIZE
    store.set(key, signer.sign(key, str(int(world_size))))


def keep_expected(store: Any, signer: Signer, prefix: str, world_size: int) -> bytes | None:
    """Rank 0's watcher: write its count when the key is missing (deleted by a store writer) or
    holds another valid one (the world re-formed in process: the same round, a new world size).

    A value that does not verify is left as it is: it is refused by name where it is read.

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix.
        world_size: the count this watcher's world expects.

    Returns:
        What it replaced (``b""`` for a missing key), or None when it left the key as it was.
    """
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
    """The acknowledgements to expect.

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix.

    Returns:
        The count, or None when no watcher wrote it.

    Raises:
        ValueError: naming the key and the value when it is not validly signed (with a secret)
            or not a count in ``[0, MAX_COUNT]``.
    """
    key = prefix + KEY_WORLD_SIZE
    if not store.check([key]):
        return None
    raw = store.get(key)
    value, reason = signer.verify(key, raw)
    if value is None:
        raise ValueError(
            f"store key {key!r} holds {raw!r:.80}, {reason.replace('_', ' ')}: not written with the "
            f"job secret (check who can reach the rendezvous endpoint)"
        )
    return count_value(key, value)


def write_local_count(path: str, round_: int, world_size: int) -> None:
    """A watcher tells its own agent the round's count, off the store (``localfile.write_replacing``).

    Args:
        path: the agent's count file (``ELASTIC_EMB_DRAIN_COUNT_FILE``).
        round_: the rendezvous round.
        world_size: the number of ranks that will acknowledge.

    Raises:
        OSError: when the file cannot be written.
    """
    write_replacing(path, json.dumps({"round": int(round_), "world_size": int(world_size)}).encode())


def read_local_count(path: str | None, round_: int) -> int | None:
    """The agent: the count its workers wrote for ``round_``.

    Args:
        path: the count file, or None (no workers were started with one).
        round_: the round being drained.

    Returns:
        The count, or None when there is no file, it is not a regular file, of another round, or
        not a count.
    """
    found = read_regular(path) if path else None
    if found is None:
        return None
    try:
        record = json.loads(found[0])
        count = record["world_size"]
        if record["round"] != round_ or type(count) is not int:
            return None
        return count_value(path, count) or None
    except (ValueError, KeyError, TypeError):
        return None


def ack_record(round_: int, rank: int, step: int) -> str:
    """The value of one rank's acknowledgement (before signing).

    Args:
        round_: the rendezvous round being drained.
        rank: the acknowledging rank.
        step: the last step the rank committed before it stopped.

    Returns:
        The compact JSON record ``{"round", "rank", "step"}``.
    """
    return json.dumps({"round": int(round_), "rank": int(rank), "step": int(step)}, separators=(",", ":"))


def write_ack(store: Any, signer: Signer, prefix: str, round_: int, rank: int, step: int) -> None:
    """A worker acknowledges: it committed ``step`` and stopped (its key first, then the hint).

    The hint is raised by compare-and-set (``rdzv/counters.py``), never by ``add``: a forged value
    there would make the store drop this worker's connection. A hint that cannot be raised (a
    foreign value) is left: the agent reads the records anyway.

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix.
        round_: the rendezvous round being drained.
        rank: the acknowledging rank.
        step: the last step the rank committed.
    """
    key = prefix + KEY_ACK + str(int(rank))
    store.set(key, signer.sign(key, ack_record(round_, rank, step)))
    try:
        increment(store, prefix + KEY_ACKS)
    except (ValueError, RuntimeError):  # a foreign value, or raced away: only a hint
        pass


def _parse(value: bytes, round_: int, rank: int) -> tuple[int | None, str]:
    """``(step, "")`` when ``value`` is rank ``rank``'s record for round ``round_``, else ``(None, reason)``."""
    try:
        record = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"not an acknowledgement record: {value!r:.80}"
    if (
        not isinstance(record, dict)
        or set(record) != {"round", "rank", "step"}
        or not all(type(record[k]) is int for k in record)
    ):
        return None, f"not an acknowledgement record: {value!r:.80}"
    if record["round"] != round_ or record["rank"] != rank:
        return None, f"names round {record['round']} rank {record['rank']}, not round {round_} rank {rank}"
    if record["step"] < 0:
        return None, f"names step {record['step']}"
    return record["step"], ""


class AckCounter:
    """Counts the verified acknowledgements of one round's drain.

    The missing ranks' keys are read when the ``acks`` hint claims enough, when it changed since
    the last look (every acknowledgement changes it after its key was written), at the last look,
    and at least every ``verify_every`` seconds whatever it holds: a store writer holding the
    counter at 0, deleting it, or writing anything there delays the count by ``verify_every`` at
    most, and a counter forged high only makes the keys be read sooner.

    Rejected keys are reported once each (``control_key_rejected``, ``drain_ack_rejected``), a
    counter that claims more than the keys show once (``drain_acks_unverified``), and a counter
    that is not a count once (``drain_acks_hint_foreign``).

    Args:
        store: the rendezvous store of the round keys.
        signer: the job's control-key signer.
        prefix: the round's key prefix.
        round_: the round being drained (a record naming another round does not count).
        log: a structlog logger for the rejection events, or None.
        verify_every: seconds between two reads of the missing ranks' keys at most.
    """

    def __init__(
        self,
        store: Any,
        signer: Signer,
        prefix: str,
        round_: int,
        log: Any = None,
        verify_every: float = VERIFY_EVERY_S,
    ) -> None:
        self.store, self.signer, self.prefix, self.round, self.log = store, signer, prefix, round_, log
        self.verify_every = verify_every
        self.steps: dict[int, int] = {}  # rank -> the step it stopped after (verified)
        self._rejected: set[str] = set()
        self._unverified_reported = False
        self._foreign_reported = False
        self._last_hint: int | None = 0  # the hint at the last look
        self._last_look = float("-inf")  # time.monotonic() of the last look

    def hint(self) -> int | None:
        """The ``acks`` counter, untrusted: a hint of when to look (read without ``add``).

        Returns:
            The counter's value (0 when absent), or None when it holds anything but a count in
            ``[0, MAX_COUNT]`` (reported once, ``drain_acks_hint_foreign``).
        """
        claimed = read_count(self.store, self.prefix + KEY_ACKS)
        if claimed is None and not self._foreign_reported and self.log is not None:
            self._foreign_reported = True
            self.log.warning(
                "drain_acks_hint_foreign",
                key=self.prefix + KEY_ACKS,
                reason="the acks counter holds a value that is not a count (a foreign write): the "
                f"acknowledgements are read every {self.verify_every:g} s instead",
            )
        return claimed

    def count(self, expected: int, *, final: bool = False) -> int:
        """The ranks of ``0 .. expected-1`` whose acknowledgement verifies.

        Reads the missing ranks' keys when the ``acks`` hint claims ``expected`` or changed since
        the last look, when ``final`` is set, or when ``verify_every`` seconds passed since the
        last look; otherwise answers what was verified before.

        Args:
            expected: the acknowledgements the drain needs.
            final: the last look before a timeout: read the missing ranks' keys whatever the hint.

        Returns:
            The number of verified acknowledgements.
        """
        if len(self.steps) >= expected:
            return len(self.steps)
        claimed = self.hint()
        now = time.monotonic()
        look = (
            final
            or (claimed is not None and (claimed >= expected or claimed != self._last_hint))
            or now - self._last_look >= self.verify_every
        )
        if not look:
            return len(self.steps)
        self._last_hint, self._last_look = claimed, now
        for rank in range(expected):
            if rank not in self.steps:
                self._verify(rank)
        verified = sum(1 for rank in self.steps if rank < expected)
        if (
            claimed is not None
            and claimed >= expected
            and verified < expected
            and not self._unverified_reported
            and self.log is not None
        ):
            self._unverified_reported = True
            missing = [r for r in range(expected) if r not in self.steps]
            self.log.warning(
                "drain_acks_unverified",
                key=self.prefix + KEY_ACKS,
                claimed=claimed,
                verified=verified,
                missing_ranks=missing[:16],
                reason="the acks counter claims more acknowledgements than the per-rank keys show: "
                "waiting for the missing ranks (a foreign write, or acks still arriving)",
            )
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
            self.log.warning(
                "drain_ack_rejected",
                key=key,
                reason=reason,
                remedy="an acknowledgement that is not this rank's for this round was written to the "
                "store: check who can reach the rendezvous endpoint",
            )
