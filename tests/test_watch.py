"""Worker-side watcher: the restricted decoder, and the watcher against torch's real rendezvous
state in a real TCPStore (written by torch's own C10dRendezvousBackend).

The end-to-end orphan behaviour (a SIGKILLed agent's workers stop themselves) runs with real
torchrun agents in test_rendezvous.py.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_emb.rdzv.keys import round_prefix
from elastic_emb.testing.ports import free_port
from elastic_emb.watch.watcher import (
    MembershipEvent,
    RendezvousReader,
    UnsafeStateError,
    Watcher,
    decode_state,
)


def _state(round_: int, participants: dict, wait=(), complete=True) -> _RendezvousState:
    s = _RendezvousState()
    s.round = round_
    s.complete = complete
    now = datetime.now(timezone.utc)
    for node, rank in participants.items():
        s.participants[node] = rank
        s.last_heartbeats[node] = now
    for node in wait:
        s.wait_list.add(node)
        s.last_heartbeats[node] = now
    return s


def _encode(obj) -> bytes:
    return base64.b64encode(pickle.dumps(obj))


class _RunsCode:
    """Unpickling this runs a shell command (what an attacker with store access would write)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# -- decoder ------------------------------------------------------------------------------------


def test_decoder_reads_torch_state():
    a, b, w = _NodeDesc("10.0.0.1", 11, 0), _NodeDesc("10.0.0.2", 12, 0), _NodeDesc("10.0.0.3", 13, 0)
    view = decode_state(_encode(_state(7, {b: 1, a: 0}, wait=[w])))
    assert view.round == 7 and view.complete and not view.closed
    assert view.nodes == ("10.0.0.1_11_0", "10.0.0.2_12_0")  # group-rank order
    assert [p.pid for p in view.participants] == [11, 12]
    assert view.wait_list == ("10.0.0.3_13_0",)


@pytest.mark.parametrize("where", ["top", "participant_key", "heartbeat_value"])
def test_decoder_refuses_a_payload_that_would_run_code(tmp_path, where):
    marker = tmp_path / "pwned"
    evil = _RunsCode(str(marker))
    if where == "top":
        payload = evil
    else:
        good = _NodeDesc("10.0.0.1", 11, 0)
        state = _state(1, {good: 0})
        if where == "participant_key":
            state.participants[evil] = 1
        else:
            state.last_heartbeats[good] = evil
        payload = state
    raw = _encode(payload)
    # The control: plain pickle would run the command.
    pickle.loads(base64.b64decode(raw))
    assert marker.exists(), "the crafted payload is not live: the test would prove nothing"
    marker.unlink()
    with pytest.raises(UnsafeStateError, match=r"(posix|os)\.system"):
        decode_state(raw)
    assert not marker.exists()


def test_decoder_refuses_builtins_eval_and_non_state(tmp_path):
    class _Eval:
        def __reduce__(self):
            return (eval, ("__import__('os').getpid()",))

    with pytest.raises(UnsafeStateError, match=r"builtins\.eval"):
        decode_state(_encode(_Eval()))
    with pytest.raises(UnsafeStateError, match="not _RendezvousState"):
        decode_state(_encode({"round": 1}))
    with pytest.raises(UnsafeStateError, match="not base64"):
        decode_state(b"!!not base64!!")


# -- watcher against a real store ---------------------------------------------------------------


@pytest.fixture
def rdzv_store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    backend = C10dRendezvousBackend(master, "wtest")
    yield port, master, backend


def _write(backend: C10dRendezvousBackend, state: _RendezvousState) -> None:
    current = backend.get_state()
    token = current[1] if current else None
    result = backend.set_state(pickle.dumps(state), token)
    assert result is not None and result[2], "state write lost a compare-and-set race in a one-writer test"


def _watcher(port, node: _NodeDesc, rank: int, world: int, round_: int, evicted: list, **kw) -> Watcher:
    reader = RendezvousReader("c10d", f"127.0.0.1:{port}", "wtest")
    kw.setdefault("agent_pid", os.getppid())
    return Watcher(
        reader,
        round_=round_,
        rank=rank,
        world_size=world,
        node=f"{node.addr}_{node.pid}_{node.local_id}",
        interval=0.02,
        on_evicted=evicted.append,
        **kw,
    )


def _wait_events(w: Watcher, kinds: set[str], timeout: float = 30.0) -> list[MembershipEvent]:
    seen: list[MembershipEvent] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += w.events()
        if kinds <= {e.kind for e in seen}:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"events {sorted(kinds)} not seen within {timeout}s; got {[e.kind for e in seen]}")


def test_watcher_reports_join_departure_and_eviction(rdzv_store):
    port, _, backend = rdzv_store
    a, b, c, j = (_NodeDesc("127.0.0.1", p, 0) for p in (101, 102, 103, 104))
    _write(backend, _state(3, {a: 0, b: 1, c: 2}))
    evicted: list = []
    w = _watcher(port, a, 0, 3, 3, evicted).start()
    try:
        assert w.events() == [] and not w.evicted
        _write(backend, _state(3, {a: 0, b: 1, c: 2}, wait=[j]))
        ev = _wait_events(w, {"join_pending"})
        assert [e.nodes for e in ev if e.kind == "join_pending"] == [("127.0.0.1_104_0",)]
        _write(backend, _state(3, {a: 0, b: 1}))  # c's heartbeat expired
        ev = _wait_events(w, {"departure"})
        assert [e.nodes for e in ev if e.kind == "departure"] == [("127.0.0.1_103_0",)]
        assert not w.evicted
        _write(backend, _state(3, {b: 1}))  # our own node was removed: we are outside the membership
        ev = _wait_events(w, {"evicted"})
        assert w.evicted and len(evicted) == 1 and evicted[0].nodes == ("127.0.0.1_101_0",)
    finally:
        w.stop()


def test_watcher_ignores_a_poisoned_state(rdzv_store, tmp_path):
    port, master, backend = rdzv_store
    a = _NodeDesc("127.0.0.1", 101, 0)
    _write(backend, _state(2, {a: 0}))
    evicted: list = []
    w = _watcher(port, a, 0, 1, 2, evicted).start()
    try:
        marker = tmp_path / "pwned"
        master.set("torch.rendezvous.wtest", _encode(_RunsCode(str(marker))))
        time.sleep(0.3)  # ~15 polls
        assert not marker.exists() and not w.evicted
        assert w.last_state is not None and w.last_state.round == 2  # kept the last good view
    finally:
        w.stop()


def test_with_a_secret_a_crafted_state_does_not_evict_without_a_signed_mark(rdzv_store):
    """A state made only of allowed classes that leaves this worker's node out (what a store
    writer can forge: torch's state carries no signature). With a job secret the worker does not
    stop itself on it (a departure hint only); an agent's signed eviction mark does stop it, and
    a mark signed with another secret does not."""
    from elastic_emb.rdzv.keys import KEY_EVICTED
    from elastic_emb.rdzv.signing import Signer

    port, master, backend = rdzv_store
    a, b = _NodeDesc("127.0.0.1", 101, 0), _NodeDesc("127.0.0.1", 102, 0)
    _write(backend, _state(4, {a: 0, b: 1}))
    evicted: list = []
    signer = Signer(b"s" * 32)
    w = _watcher(port, a, 0, 2, 4, evicted, signer=signer).start()
    try:
        _write(backend, _state(4, {b: 0}))  # crafted: our node is gone
        ev = _wait_events(w, {"departure"})
        time.sleep(0.3)  # ~15 more polls
        assert not w.evicted and evicted == [] and "evicted" not in {e.kind for e in ev + w.events()}
        key = round_prefix("wtest", 4) + KEY_EVICTED + "127.0.0.1_101_0"
        master.set(key, Signer(b"x" * 32).sign(key, "127.0.0.1_102_0"))  # wrong secret
        time.sleep(0.3)
        assert not w.evicted
        master.set(key, signer.sign(key, "127.0.0.1_102_0"))
        _wait_events(w, {"evicted"})
        assert w.evicted and len(evicted) == 1
    finally:
        w.stop()


def test_without_a_secret_the_state_alone_evicts(rdzv_store):
    port, _, backend = rdzv_store
    a, b = _NodeDesc("127.0.0.1", 101, 0), _NodeDesc("127.0.0.1", 102, 0)
    _write(backend, _state(4, {a: 0, b: 1}))
    evicted: list = []
    from elastic_emb.rdzv.signing import Signer

    w = _watcher(port, a, 0, 2, 4, evicted, signer=Signer(None)).start()
    try:
        _write(backend, _state(4, {b: 0}))
        _wait_events(w, {"evicted"})
        assert w.evicted
    finally:
        w.stop()


def test_drain_ranks_agree_on_the_last_step(rdzv_store):
    """Two ranks one step apart both stop after the same step, and both acknowledge."""
    port, master, backend = rdzv_store
    a, b = _NodeDesc("127.0.0.1", 101, 0), _NodeDesc("127.0.0.1", 102, 0)
    _write(backend, _state(5, {a: 0, b: 1}))
    ev: list = []
    w0 = _watcher(port, a, 0, 2, 5, ev).start()
    w1 = _watcher(port, b, 1, 2, 5, ev).start()
    try:
        p = round_prefix("wtest", 5)
        assert master.get(p + "world_size") == b"2"
        assert not w0.drain_requested(10) and not w1.drain_requested(9)
        master.set(p + "drain", "{}")
        # Rank 0 committed step 10 and sees the request first: last step = 11.
        assert w0.drain_requested(10) is False
        assert w1.drain_requested(10) is False  # rank 1 was one step behind
        assert w1.drain_requested(11) and w0.drain_requested(11)
        assert w0.stop_step == w1.stop_step == 11
        w0.ack_drain(11)
        w1.ack_drain(11)
        w1.ack_drain(11)  # idempotent
        assert int(master.add(p + "acks", 0)) == 2
        for rank in (0, 1):  # each rank's own acknowledgement (no secret here: unsigned)
            assert json.loads(master.get(p + f"ack/{rank}")) == {"round": 5, "rank": rank, "step": 11}
    finally:
        w0.stop()
        w1.stop()


def test_watcher_from_env_without_endpoint_is_none():
    assert Watcher.from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None


def test_watcher_stop_is_bounded(rdzv_store):
    port, _, backend = rdzv_store
    a = _NodeDesc("127.0.0.1", 101, 0)
    _write(backend, _state(1, {a: 0}))
    earlier = {x for x in threading.enumerate() if x.name == "elastic_emb-watch"}  # other tests' (stopping)
    w = _watcher(port, a, 0, 1, 1, []).start()
    t0 = time.monotonic()
    w.stop(timeout=30.0)
    # its thread ended (not just the join timing out) at its next wake (every 0.02 s); half the
    # join's bound is the margin for a loaded machine
    mine = [x for x in threading.enumerate() if x.name == "elastic_emb-watch" and x not in earlier]
    assert not [x for x in mine if x.is_alive()], mine
    assert time.monotonic() - t0 < 15.0


def test_rdzv_state_cli_prints_the_decoded_state(rdzv_store):
    import json
    import subprocess
    import sys

    port, _, backend = rdzv_store
    a, w = _NodeDesc("127.0.0.1", 101, 0), _NodeDesc("127.0.0.1", 102, 0)
    _write(backend, _state(4, {a: 0}, wait=[w]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_emb.cli.main",
            "rdzv-state",
            "--endpoint",
            f"127.0.0.1:{port}",
            "--run-id",
            "wtest",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    view = json.loads(out.stdout.strip().splitlines()[-1])
    assert view["round"] == 4 and [p["node"] for p in view["participants"]] == ["127.0.0.1_101_0"]
    assert view["wait_list"] == ["127.0.0.1_102_0"]


def test_agent_death_behind_a_wrapper_is_reported(rdzv_store):
    """The agent is not our parent (a wrapper in between): its pid vanishing still makes the
    watcher report the node dead under the round's keys and evict itself."""
    import subprocess
    import sys

    port, master, backend = rdzv_store
    a = _NodeDesc("127.0.0.1", 101, 0)
    _write(backend, _state(3, {a: 0}))
    fake_agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    evicted: list = []
    w = _watcher(port, a, 0, 1, 3, evicted, agent_pid=fake_agent.pid).start()
    try:
        time.sleep(0.2)
        assert not w.evicted  # alive agent, unchanged parent: nothing happens
        fake_agent.kill()
        fake_agent.wait(10)
        _wait_events(w, {"agent_lost"})
        p = round_prefix("wtest", 3)
        assert w.evicted and evicted[0].kind == "agent_lost"
        assert int(master.add(p + "dead", 0)) == 1 and master.check([p + "dead/127.0.0.1_101_0"])
        assert w.drain_requested(5) is False  # outside the membership: no drain, no ack
        w.ack_drain(5)
        assert int(master.add(p + "acks", 0)) == 0
    finally:
        w.stop()
        if fake_agent.poll() is None:
            fake_agent.kill()


def test_worker_side_imports_only_the_wire_contract_decoder_and_outage_tracker():
    """watch/watcher.py and cli/drain.py import nothing from the agent-side handler (nor torch_compat, which
    imports torch's private rendezvous layer): only rdzv.keys, rdzv.decode, rdzv.outage,
    rdzv.signing (which imports keys alone) and the etcd store clients."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "elastic_emb"
    for name in ("watch/watcher.py", "cli/drain.py"):
        tree = ast.parse((root / name).read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        rdzv = {m for m in mods if m.startswith("elastic_emb.rdzv")}
        allowed = {
            "elastic_emb.rdzv.keys",
            "elastic_emb.rdzv.counters",  # counters read and raised without add (keys only)
            "elastic_emb.rdzv.decode",
            "elastic_emb.rdzv.outage",
            "elastic_emb.rdzv.signing",
            "elastic_emb.rdzv.reader",  # the store reader (imports the two below)
            "elastic_emb.rdzv.drain_acks",  # the drain's signed acknowledgements (keys and signing only)
            "elastic_emb.rdzv.etcd_v3",  # the inner=etcd-v3 client (torch's public interfaces only)
            "elastic_emb.rdzv.etcd_v2",
        }  # torch's public EtcdStore plus compare_set
        assert rdzv <= allowed, (name, rdzv)
        assert "elastic_emb.rdzv.keys" in rdzv, name
