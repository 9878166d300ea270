"""A store whose waits end as soon as a member of the generation is gone.

:class:`InterruptibleStore` wraps the world's store and polls instead of blocking, asking its
``interrupted`` callable between polls; :class:`WaitGuard` is that callable for the in-process
resize (the watcher's view, then the members' liveness sockets); :func:`interruptible_store`
wraps a first generation's store in ``resize=in_process`` mode. A wait that ends this way raises
:class:`~elastic_emb.errors._MemberGone`, which the in-process resize turns into a re-form.

Design: ``docs/RESIZE.md`` (section "The interruptible store").
"""

from __future__ import annotations

import time

import torch.distributed as dist

from elastic_emb import config
from elastic_emb.errors import _MemberGone
from elastic_emb.inprocess.rollcall import PROBE_AFTER_S
from elastic_emb.store import ForwardingStore


class InterruptibleStore(ForwardingStore):
    """A store whose waits (and blocking gets) end as soon as ``interrupted()`` says so.

    Wraps any ``torch.distributed.Store``; used by ``PrefixStore`` and by gloo process groups like
    the store it wraps. A wait polls ``check`` (1 ms, doubling to 10 ms) instead of blocking in
    the store's client, so a survivor never waits out a timeout for a peer that is gone.
    ``multi_get``/``multi_set`` are torch's defaults (a loop over ``get``/``set``), not the inner
    store's, so a ``multi_get`` waits interruptibly too.

    Args:
        inner: the store to wrap.
        interrupted: called between polls; True ends the wait.
    """

    def __init__(self, inner, interrupted) -> None:
        super().__init__(inner)
        self._interrupted = interrupted

    multi_get = dist.Store.multi_get
    multi_set = dist.Store.multi_set

    def get(self, key):
        """The value of ``key``, waiting (interruptibly) until it is set.

        Args:
            key: the key to read.

        Returns:
            The value, as the inner store returns it.

        Raises:
            _MemberGone: ``interrupted()`` said so while waiting.
            TimeoutError: the key was not set within the inner store's timeout.
        """
        self.wait([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        """Wait until every key of ``keys`` is set, polling, or until ``interrupted()``.

        Args:
            keys: the keys to wait for.
            timeout: a ``timedelta``; None uses the inner store's timeout.

        Raises:
            _MemberGone: ``interrupted()`` said so: a member of this generation is gone.
            TimeoutError: the keys were not all set within the timeout.
        """
        limit = (timeout or self._inner.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.001
        while not self._inner.check(keys):
            if self._interrupted():
                raise _MemberGone(
                    f"store wait for {list(keys)[:4]} ended: a member of this generation left the "
                    f"rendezvous (the in-process resize re-forms without it)"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"store wait for {list(keys)[:4]} timed out after {limit:g} s")
            time.sleep(pause)
            pause = min(0.01, pause * 2)


class WaitGuard:
    """The ``interrupted`` callable of the in-process stores.

    True when the watcher's view shows a member gone or a peer's collective failed, or, once one
    wait has lasted ``PROBE_AFTER_S``, when a member's liveness socket refuses
    (``rollcall.Prober``): a SIGKILLed peer that a survivor waits on in the store (a commit's
    exchange) fails no collective, and its heartbeat takes seconds to expire.

    Args:
        watcher: the worker's :class:`~elastic_emb.watch.watcher.Watcher`.
    """

    def __init__(self, watcher) -> None:
        self._watcher = watcher
        self._last = self._since = 0.0

    def __call__(self) -> bool:
        if self._watcher.interrupted():
            return True
        prober = self._watcher.prober
        if prober is None:
            return False
        now = time.monotonic()
        if now - self._last > 0.05:  # InterruptibleStore asks every <= 10 ms: a gap is a new wait
            self._since = now
        self._last = now
        return now - self._since >= PROBE_AFTER_S and bool(prober.probe_members())


def interruptible_store(store, watcher):
    """``store`` with waits that end when ``watcher`` sees a member of the generation gone.

    Pass the result to ``Lifecycle.start(store=...)`` for the first generation; the generations
    formed in process get such a store automatically.

    Args:
        store: the world's store.
        watcher: the worker's watcher, or None.

    Returns:
        An :class:`InterruptibleStore` over ``store`` in ``resize=in_process`` mode with a
        watcher; ``store`` itself otherwise.

    Raises:
        ConfigError: ``ELASTIC_EMB_RESIZE`` is malformed.
    """
    if watcher is None or config.load(None, "resize").resize != "in_process":
        return store
    return InterruptibleStore(store, WaitGuard(watcher))
