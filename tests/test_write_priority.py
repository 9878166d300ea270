"""elastic_emb.rdzv.write_priority on a real TCPStore (loopback): a node that keeps losing the
compare-and-set of torch's rendezvous state claims a turn, the others yield to a live claim for
a bounded time only, and a late agent whose read-to-write window outlasts the gap between the
running agents' heartbeats gets into torch's wait list (it lost every write for 30 s without)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastic_emb.rdzv import torch_compat as tc
from elastic_emb.rdzv.guarded import GuardedBackend
from elastic_emb.rdzv.keys import DISABLE_SHARED_STORE
from elastic_emb.rdzv.outage import OutageGuard
from elastic_emb.rdzv.signing import Signer
from elastic_emb.rdzv.write_priority import WritePriority
from elastic_emb.testing.ports import free_port

LOG = structlog.get_logger("test")
KEY = "elastic_emb/wp/state_write_priority"


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10), use_libuv=True)


class Clock:
    """A clock that only the waits move: every bound below is exact."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_a_starving_node_claims_and_the_others_yield_only_to_a_live_claim(store):
    clock, signer = Clock(), Signer(b"k" * 32)
    late = WritePriority(store, KEY, "late", signer, 8.0, LOG, clock=clock, sleep=clock.sleep)
    other = WritePriority(store, KEY, "other", signer, 8.0, LOG, clock=clock, sleep=clock.sleep)
    assert (other.yield_max, other.stale_after) == (2.0, 4.0)  # a quarter and half the expiry
    other.before_write()
    assert other.yielded_s == 0.0  # nobody claims: no wait
    late.after_write(False)
    late.after_write(False)
    assert other.claimant() is None  # two losses are no starvation
    late.after_write(False)
    assert other.claimant() == "late" and late.claimant() == "late"
    late.before_write()
    assert late.yielded_s == 0.0  # the claimer never waits for its own claim
    start = clock.now
    other.before_write()  # the claim stands for the whole wait: bounded by yield_max, then writes
    assert clock.now - start == pytest.approx(2.0, abs=0.06)
    late.after_write(False)  # still losing: the claim's value changes, so it stays live
    other.before_write()
    assert other.yielded_s == pytest.approx(4.0, abs=0.12)
    late.after_write(True)  # it won: the claim is cleared
    assert other.claimant() is None
    other.before_write()
    assert other.yielded_s == pytest.approx(4.0, abs=0.12)
    for _ in range(3):
        late.after_write(False)
    assert other.claimant() == "late"
    late.after_write(True)  # cleared, and the other does not look before the next claim:
    clock.sleep(5.0)
    for _ in range(3):
        late.after_write(False)
    assert other.claimant() == "late"  # live all the same (no two claims read the same)


def test_an_abandoned_forged_or_unsigned_claim_is_ignored(store):
    clock, signer = Clock(), Signer(b"k" * 32)
    other = WritePriority(store, KEY, "other", signer, 8.0, LOG, clock=clock, sleep=clock.sleep)
    store.set(KEY, signer.sign(KEY, "dead 3"))  # its node died right after claiming
    assert other.claimant() == "dead"
    clock.sleep(4.1)  # unchanged for longer than stale_after
    assert other.claimant() is None
    other.before_write()
    assert other.yielded_s == 0.0
    store.set(KEY, signer.sign(KEY, "x" * 400 + " 3"))  # longer than any claim
    assert other.claimant() is None
    store.set(KEY, signer.sign(KEY, "late three"))  # not a count of losses
    assert other.claimant() is None
    store.set(KEY, b"late 3")  # not signed with the job's secret
    assert other.claimant() is None


@pytest.mark.slow
def test_a_late_agent_with_a_slow_window_gets_into_the_wait_list(store, monkeypatch):
    """Three agents of a complete round keep their heartbeats fresh every 0.25 s (this backend's
    FreshHeartbeat), a fourth comes late and needs 0.6 s between reading the state and writing it
    (a starved process): with the write priority it enters torch's wait list."""
    monkeypatch.setenv(DISABLE_SHARED_STORE, "1")  # as the backend's agents (handler.create_handler)
    tc.shorten_rendezvous_polls(0.1)
    port = store.port
    conf = dict(join_timeout=60, last_call_timeout=1, close_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=8)
    late_writes = {"won": 0, "lost": 0}

    class SlowBackend(C10dRendezvousBackend):
        def set_state(self, state, token=None):
            time.sleep(0.6)
            out = super().set_state(state, token)
            late_writes["won" if out and out[2] else "lost"] += 1
            return out

    def handler(i, backend_cls=C10dRendezvousBackend):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), use_libuv=True)
        # min_nodes 3: the round waits for all three running agents (with 2 it could complete at
        # its last call without a third that a loaded machine delayed, which then sat in the wait list)
        params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "wp", 3, 4, local_addr=f"10.0.0.{i}", **conf)
        inner = tc.create_inner_handler(client, backend_cls(client, "wp"), params)
        tc.set_cache_duration(inner, 0.1)
        priority = WritePriority(client, KEY, f"node{i}", Signer(None), 8.0, LOG)
        tc.wrap_state_backend(
            inner,
            lambda b: GuardedBackend(
                b, OutageGuard("test", 30.0, LOG), timedelta(seconds=8), log=LOG, priority=priority
            ),
        )
        return inner

    running = [handler(i) for i in range(3)]
    joins = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in running]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    assert not any(t.is_alive() for t in joins)
    stop = threading.Event()

    def beat(inner):
        while not stop.wait(0.25):
            tc.run_op(inner, tc.FreshHeartbeat(0.25), 5.0)

    beats = [threading.Thread(target=beat, args=(h,), daemon=True) for h in running]
    for t in beats:
        t.start()
    late = handler(3, SlowBackend)
    ended = []

    def join_late():
        try:
            late.next_rendezvous()
        except Exception as exc:  # the rendezvous closed below: the join ends
            ended.append(type(exc).__name__)

    joiner = threading.Thread(target=join_late, daemon=True)
    joiner.start()
    t0 = time.monotonic()
    try:
        while running[0].num_nodes_waiting() == 0 and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        waited = time.monotonic() - t0
        waiting = running[0].num_nodes_waiting()
    finally:
        stop.set()
        for t in beats:
            t.join(10)
        running[0].set_closed()  # the late agent's join ends: nothing runs on after the test
        joiner.join(15)
        for h in running + [late]:
            tc.stop_heartbeats(h)
    assert waiting == 1, f"the late agent is not in the wait list after {waited:.1f} s: {late_writes}"
    assert not joiner.is_alive() and ended == ["RendezvousClosedError"]
    assert late_writes["won"] >= 1
    print(f"\nthe late agent entered the wait list after {waited:.1f} s ({late_writes['lost']} writes lost first)")
