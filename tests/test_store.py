"""The store wrappers' forwarding base (``store.ForwardingStore``) and what each wrapper changes,
on a real TCPStore on loopback, called both from Python and through a ``PrefixStore`` (C++
calling the wrapper back through torch's trampoline, as gloo and the lifecycle do)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_emb.errors import _MemberGone
from elastic_emb.inprocess.interruptible import InterruptibleStore
from elastic_emb.store import ForwardingStore
from elastic_emb.testing.ports import free_port


@pytest.fixture(scope="module")
def tcp():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    yield store


class Recording(ForwardingStore):
    """Counts the calls that reach the inner store's ``get``: a forwarded ``multi_get`` does not."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gets = 0

    def get(self, key):
        self.gets += 1
        return super().get(key)


@pytest.mark.parametrize("prefixed", [False, True], ids=["python", "through-prefixstore"])
def test_forwarding_store_passes_every_operation_through(tcp, prefixed):
    inner = dist.PrefixStore(f"fwd-{prefixed}/", tcp)
    wrapper = Recording(inner)
    s = dist.PrefixStore("p/", wrapper) if prefixed else wrapper
    key = (lambda k: "p//" + k) if prefixed else (lambda k: k)  # where the key lands in `inner`
    s.set("a", b"1")
    assert inner.get(key("a")) == b"1" and s.get("a") == b"1"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5 and inner.add(key("n"), 0) == 5
    assert s.compare_set("a", b"1", b"2") == b"2" and inner.get(key("a")) == b"2"
    assert s.check(["a"]) and not s.check(["missing"])
    s.wait(["a"])
    s.wait(["a"], timedelta(seconds=1))
    with pytest.raises(Exception, match="(?i)timeout|wait"):
        s.wait(["missing"], timedelta(milliseconds=100))
    gets = wrapper.gets
    s.multi_set(["x", "y"], [b"10", b"20"])
    assert s.multi_get(["x", "y"]) == [b"10", b"20"] and inner.get(key("y")) == b"20"
    assert wrapper.gets == gets  # the inner store's own multi_get, not a loop over get
    assert s.delete_key("x") and not inner.check([key("x")])
    assert s.num_keys() == inner.num_keys() > 0
    wrapper.set_timeout(timedelta(seconds=7))
    assert inner.timeout == wrapper.timeout == timedelta(seconds=7)
    wrapper.set_timeout(timedelta(seconds=30))


@pytest.mark.parametrize("prefixed", [False, True], ids=["python", "through-prefixstore"])
def test_interruptible_multi_get_waits_through_its_own_get(tcp, prefixed):
    """``InterruptibleStore`` keeps torch's ``multi_get``/``multi_set`` (loops over its ``get``/
    ``set``): a ``multi_get`` of a missing key ends with _MemberGone once interrupted, where the
    inner store's own ``multi_get`` would block until its 30 s timeout."""
    inner = dist.PrefixStore(f"intr-{prefixed}/", tcp)
    gone = threading.Event()
    wrapper = InterruptibleStore(inner, gone.is_set)
    s = dist.PrefixStore("p/", wrapper) if prefixed else wrapper
    s.multi_set(["a", "b"], [b"1", b"2"])
    assert s.multi_get(["a", "b"]) == [b"1", b"2"]
    assert s.add("n", 1) == 1 and s.compare_set("a", b"1", b"3") == b"3" and s.check(["a", "b"])
    assert wrapper.timeout == inner.timeout == timedelta(seconds=30)
    timer = threading.Timer(0.3, gone.set)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(_MemberGone, match="a member of this generation left"):
            s.multi_get(["a", "never-written"])
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 15.0  # ended by the interruption, not by the 30 s timeout
    with pytest.raises(_MemberGone):
        s.get("never-written")
    with pytest.raises(TimeoutError, match=r"timed out after 0.2 s"):
        InterruptibleStore(inner, lambda: False).wait(["never-written"], timedelta(seconds=0.2))
