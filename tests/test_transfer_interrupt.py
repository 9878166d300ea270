"""A state transfer blocked on a peer that is gone ends when the peer is made known, not at gloo's
timeout (``work_wait.py``, ``Comm.abort``, ``Committer.interrupt``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastic_emb.testing.ports import free_port

# Rank 1 of a two-rank state communicator (its own gloo group, as ``Committer.comm_for`` forms for
# a context without a process group): it forms the group, passes a store barrier, then stops
# (SIGSTOP) without posting any send or receive: alive, its connections open, silent, as a node
# that hangs or is cut off. Gloo ends no wait on such a peer before its timeout.
PEER = """
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist
from elastic_emb.state.comm import Comm
from elastic_emb.topology import Topology
port, timeout = int(sys.argv[1]), float(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True)
topo = Topology(run_id="tx", generation=1, rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1,
                num_nodes=2, ep_size=2, backend="gloo", master_addr="127.0.0.1", master_port=port)
comm = Comm(topo, store, None, timeout=timeout)
comm.barrier("formed")
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_point_to_point_transfer_from_a_stopped_peer_ends_at_the_interrupt(tmp_path):
    """Restore's point-to-point row move (``P2PTransport``) receives a block from rank 1 and sends
    it 64 MiB (far more than the loopback buffers hold: the send stays queued), but rank 1 is
    stopped. Another thread learns that the peer is gone and calls ``Committer.interrupt`` (what
    ``Lifecycle.interrupt`` calls, from the in-process resize's neighbour probe): the transfer's
    wait ends with ``TransferInterrupted`` (both a ``_CommAborted`` and a ``CommunicationError``,
    what an interrupted collective raises) within half the (long) transfer timeout, the margin for
    a loaded machine, while the peer is still stopped (nothing else ended it); every later transfer
    of that generation raises at once; the communicator's release does not block. Without the
    interrupt the wait lasts the whole timeout (60 s)."""
    from elastic_emb import LifecycleConfig
    from elastic_emb.errors import CommunicationError, TransferInterrupted, _CommAborted
    from elastic_emb.lifecycle.committer import Committer
    from elastic_emb.state.transport import Move, P2PTransport
    from elastic_emb.topology import Topology

    timeout = 60.0  # also bounds the peer's start (a torch import) at load
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=timeout), use_libuv=True)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(master.port), str(timeout)])
    try:
        topo = Topology(
            run_id="tx",
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
        config = LifecycleConfig(state_dir=str(tmp_path), node_id="A", transfer_timeout=timeout)
        ctx = SimpleNamespace(process_group=None)  # the state layer forms a gloo group of its own
        committer = Committer(config, topo, master, lambda: ctx)
        comm = committer.comm_for(ctx)
        comm.barrier("formed")
        deadline = time.monotonic() + timeout
        while _state(peer.pid) != "T" and time.monotonic() < deadline:  # stopped
            time.sleep(0.05)
        assert _state(peer.pid) == "T", "the peer did not stop"
        received = torch.zeros(1024, 4, dtype=torch.float64)
        queued = torch.ones(8 << 20, dtype=torch.float64)  # 64 MiB
        reason = "node B refused its liveness connection (dead)"
        threading.Timer(0.5, committer.interrupt, args=(reason,)).start()
        t0 = time.monotonic()
        with pytest.raises(TransferInterrupted, match="refused its liveness connection") as raised:
            P2PTransport().move(comm, [Move(1, 0, [received]), Move(0, 1, [queued])])
        ended = time.monotonic() - t0
        assert isinstance(raised.value, _CommAborted) and isinstance(raised.value, CommunicationError)
        assert _state(peer.pid) == "T", "the peer ran again: the interrupt is not what ended the wait"
        assert ended < timeout / 2, f"the transfer's wait ended after {ended:.1f} s (timeout {timeout:g} s)"
        t1 = time.monotonic()
        with pytest.raises(TransferInterrupted):  # the replicas' all-to-all of this generation
            comm.all_to_all([torch.zeros(1, dtype=torch.uint8)] * 2, [1, 1])
        committer.close_comm()  # the aborted group is released in the background
        later = time.monotonic() - t1
        assert later < timeout / 2, f"a later transfer and the release took {later:.1f} s"
        print(
            f"\npoint-to-point transfer out of its wait {ended:.2f} s after it began (interrupted at 0.5 s; "
            f"timeout {timeout:g} s); a later transfer and the release {later:.3f} s"
        )
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait(10)


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _three_rank_comms(store, port: int, generation: int, timeout: float):
    """Three ranks' state communicators of one generation over one real TCPStore on loopback,
    store exchanges only (a process group that is never used: no gloo group to form)."""
    from elastic_emb.state.comm import Comm
    from elastic_emb.topology import Topology

    comms = []
    for rank in range(3):
        topo = Topology(
            run_id="gone",
            generation=generation,
            rank=rank,
            world_size=3,
            local_rank=0,
            local_world_size=1,
            node_rank=rank,
            num_nodes=3,
            ep_size=2,
            backend="gloo",
            master_addr="127.0.0.1",
            master_port=port,
        )
        comms.append(Comm(topo, store, object(), timeout=timeout, purpose="commit", interruptible=True))
    return comms


def _exchange_in_thread(comm, name: str) -> dict:
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["values"] = comm.exchange(name, comm.rank)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc
        out["ended_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return {"thread": thread, "out": out}


def _ends_when_rank_1_is_given_up_on(waiting: dict, give_up_on, timeout: float) -> dict:
    """``waiting`` (an exchange missing rank 1's part) still runs; ``give_up_on([1], ...)`` ends
    it with :class:`_CommAborted` naming the rank and the reason. Returns the thread's out."""
    from elastic_emb.errors import _CommAborted

    time.sleep(0.3)
    assert waiting["thread"].is_alive(), "the exchange ended before rank 1 was given up on"
    give_up_on([1], "node B left the rendezvous")
    waiting["thread"].join(timeout / 2)
    out = waiting["out"]
    assert isinstance(out.get("error"), _CommAborted), out
    assert "ranks [1] will never publish (node B left the rendezvous)" in str(out["error"])
    return out


def test_an_exchange_missing_a_gone_rank_ends_and_one_it_completed_still_completes():
    """The in-process resize gives up on the ranks of nodes that left (``Comm.give_up_on``, from
    ``Resize.run`` through ``Lifecycle.give_up_on``): a commit's exchange still waiting for one of
    them ends at once (seen: a survivor waited ``transfer_timeout`` for the orphan that was told
    not to commit the step), while an exchange they had published their part of waits for the
    live ranks and completes (a drained node: the graceful resize loses no step)."""
    from elastic_emb.errors import _CommAborted

    timeout = 60.0
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=timeout))
    # 1. rank 1 never publishes (it died, or was evicted before its part); rank 2 does.
    c0, _c1, c2 = _three_rank_comms(store, port, 1, timeout)
    other = _exchange_in_thread(c2, "snap10")
    waiting = _exchange_in_thread(c0, "snap10")
    out = _ends_when_rank_1_is_given_up_on(waiting, c0.give_up_on, timeout)
    assert out["ended_s"] < timeout / 2
    # Rank 2 still waits for rank 1: end it, so that no thread is left polling the store when the
    # test process exits (a store call returning during interpreter teardown aborts the process).
    c2.abort("the test is over")
    other["thread"].join(timeout / 2)
    assert isinstance(other["out"].get("error"), _CommAborted), other["out"]
    # 2. rank 1 published its part before it left (a drain); rank 2 publishes after the give-up.
    c0, c1, c2 = _three_rank_comms(store, port, 2, timeout)
    keys = store.num_keys()
    first = _exchange_in_thread(c1, "snap11")  # publishes, then waits for the others
    deadline = time.monotonic() + timeout / 2
    while store.num_keys() == keys and time.monotonic() < deadline:  # its part is in the store (its first write)
        time.sleep(0.01)
    assert store.num_keys() > keys, "rank 1 never published its part"
    later = _exchange_in_thread(c0, "snap11")
    c0.give_up_on([1], "node B left the rendezvous")
    time.sleep(0.3)
    assert later["thread"].is_alive(), "rank 0's exchange ended without rank 2's part"
    last = _exchange_in_thread(c2, "snap11")
    later["thread"].join(timeout / 2)
    last["thread"].join(timeout / 2)
    first["thread"].join(timeout / 2)
    assert first["out"].get("values") == [0, 1, 2], first["out"]
    assert later["out"].get("values") == [0, 1, 2], later["out"]
    assert last["out"].get("values") == [0, 1, 2], last["out"]


def test_the_durable_threads_exchange_ends_when_its_peer_is_given_up_on(tmp_path):
    """The durable tier's communicator (``Committer._durable_comm``: the durable thread's store
    exchanges, around DCP's save) polls the store like the writer's, so a checkpoint waiting for a
    rank that left ends on ``give_up_on`` (or ``interrupt``) instead of at ``transfer_timeout``: a
    blocking ``store.wait`` already under way ignored both (its thread stayed alive here for the
    whole 60 s)."""
    from elastic_emb import LifecycleConfig
    from elastic_emb.lifecycle.committer import Committer
    from elastic_emb.topology import Topology

    timeout = 60.0
    master = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=timeout))
    topo = Topology(
        run_id="dur",
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
    config = LifecycleConfig(
        state_dir=str(tmp_path / "shm"), node_id="A", transfer_timeout=timeout, durable_dir=str(tmp_path / "durable")
    )
    committer = Committer(config, topo, master, lambda: SimpleNamespace(process_group=None))
    comm = committer._durable_comm(object())  # DCP's group stands in: the exchanges use only the store
    waiting = _exchange_in_thread(comm, "durable-layout")  # rank 1 never publishes
    _ends_when_rank_1_is_given_up_on(waiting, committer.give_up_on, timeout)
