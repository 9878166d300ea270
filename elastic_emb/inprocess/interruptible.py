"""A store whose waits end as soon as a member of the generation is gone.

In ``resize=in_process`` mode a survivor blocked in a store wait (a commit's exchange, an
agreement, a gloo group forming) when its peer dies would otherwise wait out the store's full
timeout before the in-process resize (``resize.py``) could re-form without that peer.
:class:`InterruptibleStore` wraps the world's store and polls instead of blocking in the store's
client; its ``interrupted`` callable, :class:`WaitGuard`, says "a member is gone" from the
watcher's view (``watch.py``: a departure in the rendezvous state, a peer's failed collective)
and, for a wait that lasts, from the members' liveness sockets (``rollcall.py``). A wait that
ends this way raises :class:`~elastic_emb.errors._MemberGone`, which the lifecycle's caller turns
into a re-form.
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
    """

    def __init__(self, inner, interrupted) -> None:
        super().__init__(inner)
        self._interrupted = interrupted

    multi_get = dist.Store.multi_get
    multi_set = dist.Store.multi_set

    def get(self, key):
        self.wait([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        limit = (timeout or self._inner.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.001
        while not self._inner.check(keys):
            if self._interrupted():
                raise _MemberGone(f"store wait for {list(keys)[:4]} ended: a member of this generation left the "
                                 f"rendezvous (the in-process resize re-forms without it)")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"store wait for {list(keys)[:4]} timed out after {limit:g} s")
            time.sleep(pause)
            pause = min(0.01, pause * 2)


class WaitGuard:
    """The ``interrupted`` callable of the in-process stores: the watcher's view (a member gone, a
    peer's collective failed) and, once one wait has lasted ``PROBE_AFTER_S``, the members'
    liveness sockets (``rollcall.Prober``): a SIGKILLed peer that a survivor waits on in the store
    (a commit's exchange) fails no collective, and its heartbeat takes seconds to expire."""

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
    """``store`` with waits that end when ``watcher`` sees a member of the generation gone (for
    ``Lifecycle.start(store=...)`` in ``resize=in_process`` mode; ``store`` itself otherwise)."""
    if watcher is None or config.load(None, "resize").resize != "in_process":
        return store
    return InterruptibleStore(store, WaitGuard(watcher))
