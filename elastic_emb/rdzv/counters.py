"""Counters in an untrusted store, read and raised without the store's own ``add``.

``TCPStore.add`` on a value that is not a decimal integer makes the server drop the client's
connection, so one forged value would cut the reader off the rendezvous. Instead:

- :func:`peek`: a value without waiting or parsing it in the server (a sentinel ``compare_set``);
- :func:`read_count`: a counter's value, or None when it is not a count;
- :func:`increment`: raise a counter by compare-and-set, refusing a value that is not a count
  (over a ``SignedStore`` the counter is signed too).

What each counter may still decide: ``docs/OPERATIONS.md`` (section "Trust model").
"""

from __future__ import annotations

from typing import Any

from elastic_emb.rdzv.keys import MAX_COUNT

__all__ = ["ABSENT", "increment", "parse_count", "peek", "read_count"]

# Never stored by the job: compare_set(key, ABSENT, ABSENT) leaves a missing key missing and returns
# ABSENT, and returns a present key's value unchanged.
ABSENT = b"\x00elastic_emb:absent\x00"
INCREMENT_ATTEMPTS = 256  # compare-and-set races lost before increment gives up


def _compare_set(store: Any) -> Any:
    """``store.compare_set``, or None where the store has none that works (torch's etcd-v2
    ``EtcdStore``, under the agent's wrappers; ``CasEtcdStore`` adds one)."""
    inner = store
    while hasattr(inner, "_inner"):
        inner = inner._inner
    if type(inner).__name__ == "EtcdStore":
        return None
    return getattr(store, "compare_set", None)


def peek(store: Any, key: str) -> bytes | None:
    """The value under ``key`` now, or None when it is absent; never waits, never parses it.

    Args:
        store: a store with TCPStore's ``compare_set`` semantics (TCPStore, HashStore, etcd-v3,
            ``CasEtcdStore``, a SignedStore over one); a store without ``compare_set`` is read
            with ``check`` then ``get``.
        key: the key.

    Returns:
        The value's bytes, or None.

    Raises:
        UnsafeStateError: through a SignedStore, when the value is not signed by the job.
    """
    compare_set = _compare_set(store)
    if compare_set is None:
        return bytes(store.get(key)) if store.check([key]) else None
    value = bytes(compare_set(key, ABSENT, ABSENT))
    return None if value == ABSENT else value


def parse_count(raw: Any) -> int | None:
    """A counter's bytes as a count in ``[0, MAX_COUNT]``, or None for anything else.

    Args:
        raw: the value (bytes or str).

    Returns:
        The count, or None.
    """
    if isinstance(raw, str):
        raw = raw.encode("ascii", "replace")
    if not isinstance(raw, (bytes, bytearray)) or not 0 < len(raw) <= 8 or not raw.isdigit():
        return None
    value = int(raw)
    return value if value <= MAX_COUNT else None


def read_count(store: Any, key: str) -> int | None:
    """A counter's value: 0 when absent, None when the key holds anything but a count.

    Args:
        store: the store (see :func:`peek`).
        key: the counter's key.

    Returns:
        The count, or None for a foreign value.
    """
    raw = peek(store, key)
    return 0 if raw is None else parse_count(raw)


def increment(store: Any, key: str, by: int = 1) -> int:
    """Add ``by`` to the counter ``key`` by compare-and-set (created at 0).

    Two callers that raise the same value at once may both return it (the count then ends ``by``
    lower), so use it where only one process raises the key or where the count is a hint whose
    readers look again whenever it changes (every raise changes it after the raiser's own record
    was written).

    Args:
        store: the store (see :func:`peek`); a store without ``compare_set`` uses its ``add``.
        key: the counter's key.
        by: the amount (at least 1).

    Returns:
        The counter's new value.

    Raises:
        ValueError: the key holds a value that is not a count in ``[0, MAX_COUNT]`` (a foreign
            write), or the count would pass ``MAX_COUNT``.
        RuntimeError: every one of :data:`INCREMENT_ATTEMPTS` compare-and-sets lost a race.
    """
    if _compare_set(store) is None:
        return int(store.add(key, by))
    for _ in range(INCREMENT_ATTEMPTS):
        raw = peek(store, key)
        now = 0 if raw is None else parse_count(raw)
        if now is None or now + by > MAX_COUNT:
            raise ValueError(
                f"store key {key!r} holds {raw!r:.80}, not a count in [0, {MAX_COUNT - by}]: a foreign "
                f"write to the store (check who can reach it)"
            )
        desired = str(now + by).encode()
        if bytes(store.compare_set(key, b"" if raw is None else raw, desired)) == desired:
            return now + by
    raise RuntimeError(f"store key {key!r}: {INCREMENT_ATTEMPTS} compare-and-sets lost a race; not raised")
