"""The roll call after a failed collective (elastic_emb/inprocess/rollcall.py) on a real TCPStore: who
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

from elastic_emb.inprocess.rollcall import Prober, RollCall, next_node, watch_neighbour
from elastic_emb.rdzv.signing import Signer
from elastic_emb.testing.ports import free_port

LOG = structlog.get_logger("test")
# A worker of node "127.0.0.1_<pid>_0": publish its liveness socket, then wait to be killed.
CHILD = """
import sys, time
from datetime import timedelta
import structlog, torch.distributed as dist
from elastic_emb.rdzv.signing import Signer
from elastic_emb.inprocess.rollcall import Prober
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


@pytest.mark.slow
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
        # no wait on the stopped one (its kernel accepts): bounded by half the store's 10 s timeout
        # (the probe's reads of the published addresses), the margin for a loaded machine
        assert time.monotonic() - t0 < 5.0
        assert prober.probe_members() == (killed,) and prober.found == (killed,)
    finally:
        for p in procs.values():
            os.kill(p.pid, signal.SIGCONT) if p.poll() is None else None
            p.kill()
            p.wait(10)


@pytest.mark.slow
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
    assert time.monotonic() - t0 < 15.0  # not the 30 s grace (half of it: the margin for a loaded machine)
    # a node whose worker's socket refuses is absent without waiting out the grace
    killed = _child(store, nodes[2])
    killed.kill()
    killed.wait(10)
    t0 = time.monotonic()
    prober = Prober(store, "rc", signer, LOG)
    prober.enter(5, nodes, 1)
    assert roll.absent(nodes[:1] + nodes[2:], 1, lambda: (), grace=30.0, prober=prober) == (nodes[2],)
    assert time.monotonic() - t0 < 15.0
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
        assert time.monotonic() - t0 < 15.0 and not store.check([roll3.failed_key])  # not the 30 s patience
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


# A peer of a two-rank gloo group: post an all-to-all that receives ``n`` bytes from rank 0, let its
# announcement reach rank 0, then stop (SIGSTOP) before reading them: rank 0's send is left queued on
# the connection, the case gloo never fails when the connection breaks (its waiter sleeps until the
# group's timeout).
PEER = """
import os, signal, sys, time
from datetime import timedelta
import structlog, torch, torch.distributed as dist
from elastic_emb.context.group import Group
from elastic_emb.rdzv.signing import Signer
from elastic_emb.inprocess.rollcall import Prober
from elastic_emb.topology import Topology
port, node, n, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
prober = Prober(store, "rc", Signer(None), structlog.get_logger())
prober.listen(node, 0)
prober.enter(1, (), 1)
topo = Topology(run_id="rc", generation=1, rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1,
                num_nodes=2, ep_size=2, backend="gloo", master_addr="127.0.0.1", master_port=port)
group = Group.form(topo, store, torch.device("cpu"), timeout, False, structlog.get_logger())
work = group.alltoall(torch.empty(n + 1, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), [n, 1], [1, 1])
time.sleep(0.5)  # its send of one byte and its receive announcement are on the wire
store.set("posted", "1")
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Wait (bounded) until ``pid`` is stopped (state ``T`` in /proc): the peer stops itself right
    after its ``posted``, but nothing orders that before our read of the key."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"the peer (pid {pid}) did not stop within {timeout:g} s"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_collective_blocked_on_a_killed_peer_ends_at_the_liveness_probe_not_the_timeout():
    """Issue 18: a survivor whose all-to-all send to a peer was in flight when the peer was
    SIGKILLed waited out gloo's timeout (10 s in the bench): gloo does not fail a send queued on a
    broken connection, and aborting the group does not wake the waiter. The neighbour probe
    (``watch_neighbour`` + ``Prober``, as ``InProcessResize._probe_neighbour`` wires them) finds
    the peer's socket refusing and interrupts the group: the wait ends, and the group is released,
    well within half the (long) timeout, the margin for a loaded machine. A real gloo group, a
    real SIGKILL, the peer stopped first so the send is queued on the connection every time.
    The group's destructor blocks until the abandoned send times out, so whoever drops the last
    reference waits for it: another holder dropping its reference after the release thread has
    aborted must not (3 of 16 runs took 30 s when the caller's own reference happened to be last)."""
    import torch

    from elastic_emb.context import group as group_module
    from elastic_emb.context.group import Group
    from elastic_emb.errors import CommunicationError
    from elastic_emb.topology import Topology

    timeout, n = 30.0, 64 << 20  # 64 MiB: far more than the loopback socket buffers hold
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
    peer_node = "127.0.0.1_2_0"
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(master.port), peer_node, str(n), str(timeout)])
    try:
        topo = Topology(
            run_id="rc",
            generation=1,
            rank=0,
            world_size=2,
            local_rank=0,
            local_world_size=1,
            node_rank=0,
            num_nodes=2,
            ep_size=2,
            backend="gloo",
            master_addr="127.0.0.1",
            master_port=master.port,
        )
        group = Group.form(topo, master, torch.device("cpu"), timeout, False, LOG)
        master.wait(["posted"], timedelta(seconds=30))
        _wait_stopped(peer.pid)
        work = group.alltoall(torch.empty(2, dtype=torch.uint8), torch.zeros(n + 1, dtype=torch.uint8), [1, 1], [1, n])
        prober = Prober(master, "rc", Signer(None), LOG)
        prober.enter(1, ("127.0.0.1_1_0", peer_node), 1)

        class Neighbour:  # InProcessResize._probe_neighbour's tick, on this group
            found = False

            def tick(self):
                if not self.found and prober.dead(next_node(prober.members, "127.0.0.1_1_0"), 1):
                    self.found = True
                    group.interrupt(f"node {peer_node} refused its liveness connection (dead)")

        owner = Neighbour()
        watch_neighbour(owner, Neighbour.tick, LOG, every=0.1)
        threading.Timer(0.5, peer.kill).start()  # mid-transfer: 64 MiB cannot have left rank 0
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match="refused its liveness connection"):
            group.wait(work, None, "the test's all-to-all")
        held = group.pg  # another holder of the group, as the committer's state communicator
        group.release(abort=True, wait=False)  # as the context's close on a resize: gloo's abort
        # in a thread; it holds the group while the send runs
        assert group_module._RELEASES[-1].released.wait(timeout / 2)
        del held  # dropped while the abandoned send runs: the group's destructor must not run here
        ended = time.monotonic() - t0
        assert owner.found and not group.healthy
        assert ended < timeout / 2, f"the survivor left the collective after {ended:.1f} s (timeout {timeout:g} s)"
        print(
            f"\nsurvivor out of the collective and the group released {ended:.2f} s after the wait began "
            f"(the peer killed at 0.5 s; gloo's timeout {timeout:g} s)"
        )
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)


# The survivor of the killed-peer case in a process of its own, as a worker after an in-process
# re-form: its wait is interrupted, it releases the group as ``EmbContext.reset`` does for an
# unhealthy one (abort, waited), and exits (the context package's exit hook runs).
SURVIVOR = """
import os, signal, sys, threading, time
from datetime import timedelta
import structlog, torch, torch.distributed as dist
import elastic_emb.context  # its exit hook waits for the releases in flight
from elastic_emb.context import group as group_module
from elastic_emb.context.group import Group
from elastic_emb.errors import CommunicationError
from elastic_emb.topology import Topology
port, peer_pid, n, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
topo = Topology(run_id="rc", generation=1, rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                num_nodes=2, ep_size=2, backend="gloo", master_addr="127.0.0.1", master_port=port)
group = Group.form(topo, store, torch.device("cpu"), timeout, False, structlog.get_logger())
store.wait(["posted"], timedelta(seconds=30))
deadline = time.monotonic() + 30
while open(f"/proc/{peer_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":  # the peer is stopped
    if time.monotonic() > deadline:
        raise SystemExit("the peer did not stop within 30 s")
    time.sleep(0.01)
work = group.alltoall(torch.empty(2, dtype=torch.uint8), torch.zeros(n + 1, dtype=torch.uint8), [1, 1], [1, n])
time.sleep(0.5)
os.kill(peer_pid, signal.SIGKILL)  # mid-transfer: 64 MiB cannot have left rank 0
threading.Timer(0.3, group.interrupt, ("the peer was killed",)).start()  # as the liveness probe does
try:
    group.wait(work, None, "the test's all-to-all")
    raise SystemExit("the all-to-all completed: the peer took the bytes")
except CommunicationError:
    pass
t0 = time.monotonic()
group.release(abort=True)  # as EmbContext.reset releases an unhealthy group: waited
released = time.monotonic() - t0
holding = group_module._RELEASES[-1].holding() if group_module._RELEASES else False
print(f"released {released:.3f} holding {holding} exit_at {time.time():.3f}", flush=True)
"""


@pytest.mark.slow
def test_a_waited_release_and_the_exit_after_an_abandoned_transfer_do_not_wait_for_it():
    """A gloo group's destructor joins its worker threads, so it waits for a transfer abandoned
    to a dead peer until the group's timeout. ``release(abort=True)`` waited (as
    ``EmbContext.reset`` releases an unhealthy group on a same-size re-form) blocked the caller
    for that long, and so did the exit of a process with such a group in a release thread (the
    context package's exit hook waited for the group to be dropped): 30 s each. Now a thread
    holds the group until the transfer ends and the exit hook waits only for the abort. The
    survivor runs in a process of its own; it must still hold the group (the transfer runs),
    and both its release and its exit must end within half the timeout (the margin for a
    loaded machine; without the fix each takes the whole timeout)."""
    timeout, n = 30.0, 64 << 20
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(master.port), "127.0.0.1_2_0", str(n), str(timeout)])
    survivor = subprocess.Popen(
        [sys.executable, "-c", SURVIVOR, str(master.port), str(peer.pid), str(n), str(timeout)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = survivor.communicate(timeout=120)
        exited = time.time()
        assert survivor.returncode == 0, f"the survivor failed (rc {survivor.returncode}): {out!r}"
        line = [ln for ln in out.splitlines() if ln.startswith("released ")][-1].split()
        released, holding, exit_at = float(line[1]), line[3] == "True", float(line[5])
        assert released < timeout / 2, f"release(abort=True) waited {released:.1f} s for the abandoned transfer"
        assert holding, "the abandoned transfer had ended before the release: the case was not exercised"
        assert exited - exit_at < timeout / 2, (
            f"the survivor took {exited - exit_at:.1f} s to exit after its release (timeout {timeout:g} s)"
        )
        print(f"\nrelease {released:.3f} s, exit {exited - exit_at:.2f} s (gloo's timeout {timeout:g} s)")
    finally:
        for p in (survivor, peer):
            if p.poll() is None:
                p.kill()
            p.wait(10)
