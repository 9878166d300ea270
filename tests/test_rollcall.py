"""The roll call after a failed collective (elastic_emb/rollcall.py) on a real TCPStore: who
answers, who is silent, and the liveness sockets: a SIGKILLed process's socket refuses at once,
a live (even stopped) process's is accepted by the kernel, so a probe never calls it dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist

from elastic_emb.rdzv.signing import Signer
from elastic_emb.rollcall import Prober, RollCall, next_node, watch_neighbour
from elastic_emb.testing.ports import free_port

LOG = structlog.get_logger("test")
# A worker of node "127.0.0.1_<pid>_0": publish its liveness socket, then wait to be killed.
CHILD = """
import sys, time
from datetime import timedelta
import structlog, torch.distributed as dist
from elastic_emb.rdzv.signing import Signer
from elastic_emb.rollcall import Prober
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10), use_libuv=True)
prober = Prober(store, "rc", Signer(None), structlog.get_logger())
prober.listen(sys.argv[2], 0)
prober.enter(5, (), 1)  # publishes its address for generation 5
print("listening", flush=True)
time.sleep(60)
"""


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10), use_libuv=True)


def _child(store, node):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), node], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def test_a_killed_workers_socket_refuses_and_a_stopped_ones_is_accepted(store):
    live, killed = "127.0.0.1_1_0", "127.0.0.1_2_0"
    procs = {n: _child(store, n) for n in (live, killed)}
    try:
        prober = Prober(store, "rc", Signer(None), LOG)
        prober.enter(4, (live, killed), 1)
        assert prober.dead([live, killed], 1) == ()  # no address published for generation 4: no evidence
        prober.enter(5, (live, killed), 1)
        assert prober.dead([live, killed, "127.0.0.1_3_0"], 1) == ()  # the third never published: no evidence
        os.kill(procs[live].pid, signal.SIGSTOP)  # alive but not running: the kernel still accepts
        procs[killed].kill()
        procs[killed].wait(10)
        t0 = time.monotonic()
        assert prober.dead([live, killed], 1) == (killed,)
        assert time.monotonic() - t0 < 2.0
        assert prober.probe_members() == (killed,) and prober.found == (killed,)
    finally:
        for p in procs.values():
            os.kill(p.pid, signal.SIGCONT) if p.poll() is None else None
            p.kill()
            p.wait(10)


def test_the_roll_call_takes_the_silent_and_the_refusing_as_absent(store):
    nodes = ("127.0.0.1_1_0", "127.0.0.1_2_0", "127.0.0.1_3_0")
    signer = Signer(None)
    roll = RollCall(store, "rc", 5, signer, LOG)
    roll.answer(nodes[0], 0)
    roll.answer(nodes[0], 1)
    roll.answer(nodes[1], 0)  # node 1's second local worker stays silent: the node is absent
    t0 = time.monotonic()
    assert roll.absent(nodes, 2, lambda: (), grace=0.3) == (nodes[1], nodes[2])
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert store.check([roll.failed_key])
    # gone from the rendezvous counts at once, answered or not; all accounted for ends the wait early
    t0 = time.monotonic()
    assert roll.absent(nodes[:1] + nodes[2:], 2, lambda: (nodes[2],), grace=30.0) == (nodes[2],)
    assert time.monotonic() - t0 < 5.0
    # a node whose worker's socket refuses is absent without waiting out the grace
    killed = _child(store, nodes[2])
    killed.kill()
    killed.wait(10)
    t0 = time.monotonic()
    prober = Prober(store, "rc", signer, LOG)
    prober.enter(5, nodes, 1)
    assert roll.absent(nodes[:1] + nodes[2:], 1, lambda: (), grace=30.0, prober=prober) == (nodes[2],)
    assert time.monotonic() - t0 < 5.0
    # a node proven alive (its socket accepts) that does not answer is waited for up to patience,
    # not grace (a long step: it answers when it gets there)
    busy = _child(store, nodes[1])
    try:
        t0 = time.monotonic()
        silent = RollCall(store, "rc", 8, signer, LOG)
        assert silent.absent(nodes[1:2], 1, lambda: (), grace=0.05, prober=prober, patience=0.8) == (nodes[1],)
        assert time.monotonic() - t0 >= 0.8
        roll2 = RollCall(store, "rc", 6, signer, LOG)
        threading.Timer(0.5, roll2.answer, args=(nodes[1], 0)).start()
        assert roll2.absent(nodes[1:2], 1, lambda: (), grace=0.05, prober=prober, patience=30.0) == ()
        # a worker re-forming for a departure it saw in the rendezvous answers without flagging a
        # failure (present): a roll call held by another member for the same change ends at once
        roll3 = RollCall(store, "rc", 9, signer, LOG)
        roll3.present(nodes[1], 0)
        t0 = time.monotonic()
        assert roll3.absent(nodes[1:2], 1, lambda: (), grace=0.05, prober=prober, patience=30.0) == ()
        assert time.monotonic() - t0 < 5.0 and not store.check([roll3.failed_key])
    finally:
        busy.kill()
        busy.wait(10)


def test_a_signed_roll_call_ignores_unsigned_answers(store):
    signer = Signer(b"s" * 32)
    roll = RollCall(store, "rc", 7, signer, LOG)
    node = "127.0.0.1_1_0"
    store.set(roll._mark(node, 0), node)  # forged: not signed with the job's secret
    assert roll.absent((node,), 1, lambda: (), grace=0.2) == (node,)
    roll.answer(node, 0)
    assert roll.absent((node,), 1, lambda: (), grace=5.0) == ()


def test_each_node_probes_the_next_one_and_the_probe_lives_as_long_as_its_owner():
    nodes = ("a", "b", "c")
    assert [next_node(nodes, n) for n in nodes] == [("b",), ("c",), ("a",)]  # every node watched by one other
    assert next_node(("a",), "a") == () and next_node(nodes, "z") == ()

    class Owner:
        ticks = 0

        def tick(self):
            self.ticks += 1
            if self.ticks == 2:
                raise OSError("store down")  # reported, and the next tick still runs

    owner = Owner()
    thread = watch_neighbour(owner, Owner.tick, LOG, every=0.01)
    deadline = time.monotonic() + 10
    while owner.ticks < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.ticks >= 4
    del owner  # the thread holds only a weak reference: it ends with its owner
    thread.join(10)
    assert not thread.is_alive()
