"""Signed values agreed by compare-and-set, where the job used counters before.

- :func:`claim_signed`: the first valid signed value under a key wins (the in-process decision); a
  value that does not verify (a store writer's) is replaced, never obeyed;
- :func:`raise_mark` / :func:`read_mark`: a signed high-water mark, raised by compare-and-set (the
  in-process generations' mark, ``keys.KEY_GENERATION_MARK``): a store writer can neither raise
  it (unsigned) nor lower it by writing; deleting it or putting back an older signed value is
  what remains (``docs/OPERATIONS.md``, section "Trust model", says what that can do).

No ``add``: a forged counter value makes a TCPStore drop its client's connection
(``rdzv/counters.py``).
"""

from __future__ import annotations

import time
from typing import Any

from elastic_emb.errors import ElasticEmbError
from elastic_emb.rdzv.counters import peek
from elastic_emb.rdzv.signing import Signer, report_rejected

__all__ = ["claim_signed", "parse_mark", "raise_mark", "read_mark"]

MARK_DIGITS = 18  # a mark is a decimal below 10**18


def parse_mark(value: bytes | None) -> int | None:
    """A verified mark's value, or None when it is not a non-negative decimal of at most 18 digits.

    Args:
        value: the verified value, or None.

    Returns:
        The mark, or None.
    """
    if value is None or not 0 < len(value) <= MARK_DIGITS or not value.isdigit():
        return None
    return int(value)


def read_mark(store: Any, signer: Signer, key: str, log: Any = None) -> int:
    """The signed mark under ``key``: 0 when absent, unsigned, badly signed or not a mark.

    Args:
        store: the store.
        signer: the job's control-key signer.
        key: the mark's key.
        log: a structlog logger for ``control_key_rejected`` (once per key), or None.

    Returns:
        The mark.
    """
    raw = peek(store, key)
    if raw is None:
        return 0
    value, reason = signer.verify(key, raw)
    mark = parse_mark(value)
    if mark is None:
        report_rejected(signer, key, reason or "not a mark", log)
        return 0
    return mark


def raise_mark(store: Any, signer: Signer, key: str, value: int, timeout: float = 10.0, log: Any = None) -> int:
    """Raise the signed mark under ``key`` to at least ``value``.

    A value that does not verify is replaced by the same compare-and-set; a higher valid one is
    left.

    Args:
        store: the store.
        signer: the job's control-key signer.
        key: the mark's key.
        value: the least value the mark must hold.
        timeout: seconds to keep losing compare-and-sets (a writer racing every one) before giving up.
        log: a structlog logger for ``control_key_rejected``, or None.

    Returns:
        The mark afterwards (at least ``value``).

    Raises:
        ElasticEmbError: every compare-and-set lost for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    desired = signer.sign(key, str(int(value)))
    while True:
        raw = peek(store, key)
        if raw is not None:
            verified, reason = signer.verify(key, raw)
            now = parse_mark(verified)
            if now is not None and now >= value:
                return now
            if now is None:
                report_rejected(signer, key, reason or "not a mark", log)
        if bytes(store.compare_set(key, b"" if raw is None else raw, desired)) == desired:
            return int(value)
        if time.monotonic() >= deadline:
            raise ElasticEmbError(
                f"could not raise {key!r} to {value} within {timeout:g} s: every compare-and-set lost "
                "(a store writer replacing the value in a loop?)"
            )
        time.sleep(0.001)


def claim_signed(store: Any, signer: Signer, key: str, value: str, timeout: float = 10.0, log: Any = None) -> bool:
    """Write ``value`` (signed) under ``key`` unless a valid signed value is there first.

    Args:
        store: the store.
        signer: the job's control-key signer.
        key: the key.
        value: the value to claim it with.
        timeout: seconds to keep replacing values that do not verify before giving up.
        log: a structlog logger for ``control_key_rejected``, or None.

    Returns:
        True when this call wrote ``value``; False when a valid signed value (another writer's)
        was there first, or when a value that does not verify kept coming back for ``timeout``
        seconds (the waiters' own bound then applies).
    """
    deadline = time.monotonic() + timeout
    desired = signer.sign(key, value)
    while True:
        raw = peek(store, key)
        if raw is not None:
            verified, reason = signer.verify(key, raw)
            if verified is not None:
                return raw == desired
            report_rejected(signer, key, reason, log)
        if bytes(store.compare_set(key, b"" if raw is None else raw, desired)) == desired:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
