"""The rendezvous in a real etcd: it outlives every node, the first one included.

With torch's c10d rendezvous the store lives in the first agent; killing that node ends the job.
With ``--rdzv-backend=elastic_emb --rdzv-conf inner=etcd-v2`` the state lives in etcd (Debian's
etcd-server on loopback, through elastic_emb.testing.etcd: the fixture here, the drill tool's
store='etcd'), so the issue-7 drill kills node 0, the agent that would have hosted a c10d store,
and the survivor must finish the run with every embedding row and optimizer slot equal, bit for
bit, to a single-process replay.
"""

from __future__ import annotations

import os

import pytest

from elastic_emb.testing.etcd import EtcdServer, command, health
from tests.helpers.drill_report import merge_restart_retries
from tests.helpers.etcd_fixture import (
    etcd_server,  # noqa: F401  (the fixture)
    require_etcd,
)


@pytest.mark.slow
def test_fixture_serves_the_v2_api_and_comes_back_after_a_kill(etcd_server):
    import etcd

    assert health(etcd_server.url) and etcd_server.started_in is not None and etcd_server.started_in < 20
    client = etcd.Client(host=etcd_server.host, port=etcd_server.client_port, read_timeout=5)
    client.write("/elastic_emb/probe", "v1")
    etcd_server.kill()  # the drill fault: SIGKILL, data directory kept
    assert not etcd_server.running and not health(etcd_server.url, timeout=0.2)
    etcd_server.start()  # same ports, same data
    assert client.read("/elastic_emb/probe").value == "v1"


@pytest.mark.slow
def test_server_stops_at_exit_and_its_port_goes_quiet(tmp_path):
    require_etcd()
    with EtcdServer(tmp_path / "etcd") as server:
        pid = server.proc.pid
        assert server.running and health(server.url)
    assert not server.running and server.proc.returncode is not None
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not health(server.url, timeout=0.2)


def test_etcd_command_is_loopback_only_with_the_v2_api(tmp_path):
    cmd = command("etcd", tmp_path, "127.0.0.1", 2379, 2380)
    assert "--enable-v2=true" in cmd
    urls = [cmd[i + 1] for i, a in enumerate(cmd) if a.endswith("-urls")]
    assert urls and all(u.startswith("http://127.0.0.1:") for u in urls)
    with pytest.raises(ValueError, match="loopback"):
        EtcdServer(tmp_path, host="0.0.0.0")


def test_a_missing_etcd_binary_is_named(tmp_path, monkeypatch):
    from elastic_emb.testing.etcd import EtcdUnavailable

    monkeypatch.setenv("ELASTIC_EMB_ETCD", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcd anywhere on PATH
    with pytest.raises(EtcdUnavailable, match="etcd-server"):
        EtcdServer(tmp_path / "etcd").start()


# -- the drill: node 0 dies, etcd survives, nothing is lost ----------------------------------------


@pytest.mark.slow
def test_etcd_v2_drill_loses_node_zero_while_etcd_survives_zero_loss(tmp_path):
    """The issue-7 drill through the drill tool (``elastic-emb drill``): store='etcd', node 0
    SIGKILLed at world 2 (the agent that would host a c10d store), etcd survives, node 0's rows
    come back from its replica on node 1, and every row equals the single-process replay."""
    require_etcd()
    from elastic_emb.drill import Fault, Scenario, run_drill

    scenario = Scenario(
        name="etcd-node0-loss",
        description="inner=etcd-v2; node 0 (the would-be c10d store host) dies at world 2.",
        initial_nodes=2,
        min_nodes=1,
        max_nodes=2,
        store="etcd",
        etcd_api="v2",
        network="loopback",
        steps=40,
        step_delay=0.05,
        faults=(Fault(kind="kill_node", at_step=10, node=0),),
        mode="restart",
    )
    report = run_drill(scenario, tmp_path / "drill", progress="lines", summary=False)
    assert report["ok"], (report.get("error"), report.get("verification"))
    assert report["verification"]["ok"] and report["verification"]["step"] == scenario.steps - 1
    assert report["world_sizes"][0] == 2 and report["world_sizes"][-1] == 1, report["world_sizes"]
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_node" and fault["node"] == 0, fault
    (resize,) = [r for r in report["resizes"] if r["cause"] == "kill_node node0"]
    assert (resize["from_world"], resize["to_world"]) == (2, 1), resize
    print(
        f"\ndrill tool, store=etcd: node0 SIGKILLed at world 2, world 1 stepping after {resize['recovery_seconds']} s, "
        f"restored step {resize['restored_step']} from {resize['source_tiers']}; "
        f"{report['verification']['rows_checked']} rows equal the replay"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_etcd_v3_drill_orphans_join_and_node_zero_loss_zero_loss(tmp_path):
    """inner=etcd-v3 through the drill tool: node 1's agent SIGKILLed alone (its orphaned worker
    reports it through the v3 store: 2 -> 1), a node joins (drained before the scale-up: 1 -> 2),
    then node 0, the first agent, SIGKILLed with its workers (2 -> 1). Every row equals the
    single-process replay, bit for bit."""
    require_etcd()
    import json

    from elastic_emb.drill import Fault, Scenario, run_drill

    scenario = Scenario(
        name="etcd-v3-node0-loss",
        description="inner=etcd-v3: orphan report, join, loss of node 0.",
        initial_nodes=2,
        min_nodes=1,
        max_nodes=2,
        store="etcd",
        etcd_api="v3",
        network="loopback",
        steps=110,
        step_delay=0.05,
        mode="restart",  # the join drains the running world, then torch restarts it
        timeout=180,  # the drill's deadline (its error names the logs) before pytest's 240 s
        faults=(
            Fault(kind="kill_agent", at_step=8, node=1),
            Fault(kind="join", at_step=35),
            Fault(kind="kill_node", at_step=70, node=0),
        ),
    )
    out = tmp_path / "drill"
    report = run_drill(scenario, out, progress="lines", summary=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert report["ok"], (report.get("error"), report.get("verification"), logs)
    assert report["verification"]["ok"] and report["verification"]["step"] == scenario.steps - 1
    # the join takes one round, or two when a node comes after the round's last call (a loaded
    # machine): merged here
    worlds, resizes = merge_restart_retries(report)
    assert worlds == [2, 1, 2, 1], report["world_sizes"]
    causes = [r["cause"] for r in resizes]
    assert causes == ["kill_agent node1", "join node2", "kill_node node0"], causes
    # node 0's rows came back from their replicas on node 2: world 2 had committed (the drill holds the
    # kill back until every rank of world 2 has a commit of it complete).
    assert "replica" in resizes[2]["source_tiers"], resizes[2]
    assert report["orphans_alive_at_end"] == [], report["orphans_alive_at_end"]
    assert json.loads((out / "scenario.json").read_text())["etcd_api"] == "v3"
    print(
        f"\ndrill tool, inner=etcd-v3: world sizes {report['world_sizes']}, recoveries "
        f"{[r['recovery_seconds'] for r in report['resizes']]} s; {report['verification']['rows_checked']} rows "
        f"equal the replay"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_member_etcd_loses_its_leader_mid_join_zero_loss(tmp_path):
    """The ``store-member-loss`` preset: a 3-member etcd cluster (``inner=etcd-v3``, the endpoint
    lists all three members), its leader SIGKILLed as a node joins and restarted 5 s later. The
    two survivors elect a leader and keep serving: the join completes, the job finishes at world
    2, and every row equals the single-process replay."""
    require_etcd()
    import json

    from elastic_emb.drill import PRESETS, run_drill

    scenario = PRESETS["store-member-loss"]
    assert scenario.etcd_members == 3 and scenario.etcd_api == "v3"
    scenario = scenario.model_copy(update={"timeout": 180})  # the drill's deadline before pytest's 240 s
    out = tmp_path / "drill"
    report = run_drill(scenario, out, progress="lines", summary=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert report["ok"], (report.get("error"), report.get("verification"), logs)
    assert report["verification"]["ok"] and report["verification"]["step"] == scenario.steps - 1
    # The join may take two rounds when the leader dies during it (a re-form at world 1 first):
    # what must hold is one node, then two, never fewer, and every row equal to the replay (above).
    sizes = [w for i, w in enumerate(report["world_sizes"]) if i == 0 or w != report["world_sizes"][i - 1]]
    assert sizes == [1, 2], report["world_sizes"]
    kill, join = report["faults"]
    assert kill["kind"] == "kill_store" and join["kind"] == "join", report["faults"]
    assert kill["member"] in (0, 1, 2), kill
    # The store never looked down to the agent: the survivors served every call.
    agent = [
        json.loads(line)
        for line in (out / "logs" / "node0.log").read_text().splitlines()
        if line.startswith('{"component": "rendezvous"')
    ]
    kinds = [e["event"] for e in agent]
    assert "store_outage_exceeded" not in kinds and "rendezvous_failed" not in kinds, kinds
    print(
        f"\nstore-member-loss: member {kill['member']} (the leader) SIGKILLed mid-join; world "
        f"{report['world_sizes']}; {report['verification']['rows_checked']} rows equal the replay"
    )


# -- a store outage: ridden out within the bound, a clear error past it ----------------------------


def _agent_handler(server, tmp_path, monkeypatch, inner="etcd-v2", **conf):
    """An elastic_emb agent-side handler (``inner``) on the real etcd, in this process, one
    node (min=max=1), after its first round. create_handler changes the agent process (env,
    torch's poll pause): monkeypatch undoes that after the test."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elastic_emb.rdzv import keys
    from elastic_emb.rdzv.handler import create_handler

    monkeypatch.setattr(dr, "_delay", dr._delay)
    for key in (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        keys.ENV_GENERATION,
        keys.ENV_RDZV_BACKEND,
        keys.ENV_RDZV_ENDPOINT,
        keys.ENV_NODE_ID,
        keys.ENV_MEMBERSHIP,
        keys.ENV_AGENT_PID,
        keys.ENV_DRAIN,
        keys.ENV_WATCH_INTERVAL,
        keys.ENV_STORE_OUTAGE_TIMEOUT,
        "ELASTIC_EMB_ETCD_OPTIONS",
    ):
        monkeypatch.setenv(key, "")  # recorded with its value before (or none): the undo restores it
        monkeypatch.delenv(key)
    events = tmp_path / "rdzv.jsonl"
    params = RendezvousParameters(
        backend="elastic_emb",
        endpoint=server.endpoint,
        run_id=f"outage{os.getpid()}",
        min_nodes=1,
        max_nodes=1,
        inner=inner,
        event_file=str(events),
        keep_alive_interval="1",
        # heartbeat expiry 2 s: shorter than the outages below (2.5 s and more), so only the credit
        # keeps a node alive through them, and still four beats (every 0.5 s) long: a beat that a
        # loaded machine delays by a few hundred ms does not expire the node by itself
        keep_alive_max_attempt="2",
        read_timeout="5",
        **conf,
    )
    handler = create_handler(params)
    handler.next_rendezvous()
    return handler, events


def _events(path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _close(handler) -> None:
    handler._guard.closing.set()  # the store may be down: no waiting at teardown
    handler._inner._stop_heartbeats()
    handler._closed.set()
    handler._left = True


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["etcd-v2", "etcd-v3"])
def test_agent_rides_out_an_etcd_outage_shorter_than_the_bound(etcd_server, tmp_path, monkeypatch, inner):
    """etcd SIGKILLed for 2.5 s, bound 20 s: num_nodes_waiting (what torch's agent polls while its
    workers train) blocks through the outage and then answers 0, with no membership change, although
    the outage outlasted the heartbeat expiry (1 s x 2): the heartbeats were credited."""
    import threading
    import time

    from elastic_emb.rdzv.decode import node_id

    handler, events = _agent_handler(etcd_server, tmp_path, monkeypatch, inner, store_outage_timeout="20")
    restart = threading.Timer(2.5, etcd_server.start)
    try:
        me = node_id(handler._inner._this_node)
        assert handler.num_nodes_waiting() == 0
        etcd_server.kill()
        start = time.monotonic()  # before the timer starts: etcd is back 2.5 s after this at the earliest
        restart.start()
        assert handler.num_nodes_waiting() == 0
        took = time.monotonic() - start
        restart.join(30)
        assert took >= 2.0, f"num_nodes_waiting returned after {took:.2f} s, before etcd was back"
        deadline = time.monotonic() + 3.0  # a few more polls after the outage: still no change
        while time.monotonic() < deadline:
            assert handler.num_nodes_waiting() == 0
            time.sleep(0.2)
        assert me in [node_id(n) for n in handler._inner._state_holder.state.participants]
        seen = _events(events)
        kinds = [e["event"] for e in seen]
        assert kinds.count("store_unreachable") == 1 and kinds.count("store_reachable") == 1, kinds
        back = next(e for e in seen if e["event"] == "store_reachable")
        assert back["endpoint"] == etcd_server.endpoint and back["outage_s"] >= 2.0, back
        assert "membership_changed" not in kinds and "store_outage_exceeded" not in kinds, kinds
        print(f"\netcd down 2.5 s (+ restart): num_nodes_waiting blocked {took:.2f} s, outage_s {back['outage_s']}")
    finally:
        restart.cancel()  # a failure before the restart fired must not start an etcd after the fixture's stop
        if restart.is_alive():
            restart.join(30)
        _close(handler)


@pytest.mark.slow
def test_agent_fails_naming_endpoint_and_remedy_when_etcd_stays_down_past_the_bound(etcd_server, tmp_path, monkeypatch):
    """etcd stopped for longer than store_outage_timeout=2 s: the retries stop at the bound and
    StoreOutageError names the endpoint, the outage length and the remedy; later calls fail at once."""
    import time

    from elastic_emb.rdzv.outage import StoreOutageError

    handler, events = _agent_handler(etcd_server, tmp_path, monkeypatch, store_outage_timeout="2")
    try:
        etcd_server.kill()
        start = time.monotonic()
        with pytest.raises(StoreOutageError) as info:
            handler.num_nodes_waiting()
        took = time.monotonic() - start
        message = str(info.value)
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        assert isinstance(info.value, RendezvousConnectionError)  # torch's keep-alive timer logs it, lives on
        assert etcd_server.endpoint in message and "store_outage_timeout" in message, message
        assert "unreachable for" in message and "bring the store back" in message, message
        assert 2.0 <= took < 6.0, f"failed after {took:.2f} s; the bound is 2 s"
        start = time.monotonic()
        with pytest.raises(StoreOutageError):
            handler.num_nodes_waiting()  # the outage continues: no second wait
        assert time.monotonic() - start < 1.0
        kinds = [e["event"] for e in _events(events)]
        assert kinds.count("store_unreachable") == 1 and kinds.count("store_outage_exceeded") == 1, kinds
        assert "store_reachable" not in kinds, kinds
        print(f"\netcd down past a 2 s bound: StoreOutageError after {took:.2f} s: {message[:160]}...")
    finally:
        _close(handler)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_store_host_loss_drill_trains_through_an_etcd_outage_zero_loss(tmp_path):
    """The ``store-host-loss`` preset (``elastic-emb drill --scenario store-host-loss``): etcd
    SIGKILLed for 3 s at step 8, a node joins at step 20. The agent rides the outage out (events
    store_unreachable -> store_reachable), the worker keeps committing steps while etcd is down,
    the job finishes at world 2, and every row equals the single-process replay, bit for bit."""
    require_etcd()
    import json
    from datetime import datetime

    from elastic_emb.drill import PRESETS, run_drill

    scenario = PRESETS["store-host-loss"].model_copy(update={"timeout": 180})  # the drill's deadline before pytest's
    out = tmp_path / "drill"
    report = run_drill(scenario, out, progress="lines", summary=False)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert report["ok"], (report.get("error"), report.get("verification"), logs)
    assert report["verification"]["ok"] and report["verification"]["step"] == scenario.steps - 1
    # The join may take two rounds when the leader dies during it (a re-form at world 1 first):
    # what must hold is one node, then two, never fewer, and every row equal to the replay (above).
    sizes = [w for i, w in enumerate(report["world_sizes"]) if i == 0 or w != report["world_sizes"][i - 1]]
    assert sizes == [1, 2], report["world_sizes"]
    # One re-form, the join, losing nothing: the outage itself costs none (a worker that read the
    # store between steps crashed on the outage, and its restart showed here as a second re-form).
    assert [r["steps_lost"] for r in report["resizes"]] == [0], report["resizes"]
    assert [f["kind"] for f in report["faults"]] == ["kill_store", "join"], report["faults"]

    agent = [
        json.loads(line)
        for line in (out / "logs" / "node0.log").read_text().splitlines()
        if line.startswith('{"component": "rendezvous"')
    ]
    kinds = [e["event"] for e in agent]
    assert "store_unreachable" in kinds and "store_reachable" in kinds, kinds
    assert "store_outage_exceeded" not in kinds and "rendezvous_failed" not in kinds, kinds
    down = next(e for e in agent if e["event"] == "store_unreachable")
    back = next(e for e in agent if e["event"] == "store_reachable")
    assert back["outage_s"] >= 2.5, back  # etcd was down 3 s (the first failed call may come late)
    t0, t1 = (datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() for e in (down, back))
    # The first worker of node 0 kept committing steps while the store was unreachable.
    first = min((out / "run" / "events").glob("node0-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    during = [
        e["step"]
        for e in map(json.loads, first.read_text().splitlines())
        if e.get("event") == "step" and t0 < e["t"] < t1
    ]
    assert len(during) >= 3, f"node 0 committed steps {during} during the outage {t0:.2f}..{t1:.2f}"
    print(
        f"\nstore-host-loss: etcd unreachable {back['outage_s']} s, node 0 committed {len(during)} steps "
        f"meanwhile; {report['verification']['rows_checked']} rows equal the replay"
    )


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["etcd-v2", "etcd-v3"])
def test_watcher_treats_an_etcd_outage_as_unknown_for_a_bounded_time(etcd_server, tmp_path, monkeypatch, inner):
    """A worker's watcher during an etcd outage: no departure, eviction or round change is inferred;
    past its bound (3 s here) it says so (store_outage_exceeded), and when etcd is back the outage
    ends (store_outage_s None) with the membership unchanged."""
    import time

    from elastic_emb.watch.watcher import RendezvousReader, Watcher

    handler, _ = _agent_handler(etcd_server, tmp_path, monkeypatch, inner, store_outage_timeout="20")
    evicted: list = []
    try:
        reader = RendezvousReader(inner, etcd_server.endpoint, handler._run_id)
        watcher = Watcher(
            reader,
            round_=handler._round,
            rank=0,
            world_size=1,
            node=handler._node,
            agent_pid=os.getppid(),
            interval=0.05,
            store_outage_timeout=3.0,
            on_evicted=evicted.append,
        )
        with watcher:
            time.sleep(0.3)
            assert watcher.store_outage_s is None and watcher.events() == []
            etcd_server.kill()
            deadline = time.monotonic() + 30.0
            while watcher.store_outage_s is None and time.monotonic() < deadline:  # its first failed read
                time.sleep(0.01)
            # seen at once (within a poll of ours): well inside the 3 s bound
            assert watcher.store_outage_s is not None and not watcher.store_outage_exceeded
            assert watcher.drain_requested(5) is False  # unknown: no drain can be seen
            assert watcher.membership_change_pending(timeout=0.3) is False
            deadline = time.monotonic() + 30.0
            while not watcher.store_outage_exceeded and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watcher.store_outage_exceeded and watcher.store_outage_s >= 3.0
            assert not watcher.evicted and evicted == [] and watcher.events() == []
            etcd_server.start()
            deadline = time.monotonic() + 20.0
            while watcher.store_outage_s is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watcher.store_outage_s is None and not watcher.store_outage_exceeded
            time.sleep(0.5)  # a few polls of the restored state
            assert not watcher.evicted and evicted == [] and watcher.events() == [], watcher.last_state
    finally:
        _close(handler)


@pytest.mark.slow
def test_the_in_process_world_store_on_etcd_v2_has_compare_set(etcd_server):
    """The generations formed in process agree over the etcd-v2 store, and every agreement raises
    the generation mark with compare_set, which torch's EtcdStore lacks: CasEtcdStore adds it with
    TCPStore's semantics (a create that loses, a swap that matches, one that does not)."""
    from datetime import timedelta

    import etcd

    from elastic_emb.rdzv.etcd_v2 import CasEtcdStore

    client = etcd.Client(host=etcd_server.host, port=etcd_server.client_port, read_timeout=5)
    store = CasEtcdStore(client, "/elastic_emb/cas", timeout=timedelta(seconds=5))
    assert store.compare_set("mark", "", "1") == b"1"  # created
    assert store.compare_set("mark", "", "2") == b"1"  # exists: the holder's value, unchanged
    assert store.compare_set("mark", "1", "3") == b"3"  # swapped
    assert store.compare_set("mark", "1", "4") == b"3"  # no match: unchanged
    assert store.get("mark") == b"3"
    assert store.compare_set("missing", "z", "q") == b"z" and not store.check(["missing"])
