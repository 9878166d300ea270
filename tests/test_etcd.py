"""The rendezvous in a real etcd: it outlives every node, the first one included.

With torch's c10d rendezvous the store lives in the first agent; killing that node ends the job.
With ``--rdzv-backend=elastic_emb --rdzv-conf inner=etcd-v2`` the state lives in etcd (Debian's
etcd-server on loopback, through elastic_emb.etcd_server: the fixture here, the drill tool's
store='etcd'), so the issue-7 drill kills node 0, the agent that would have hosted a c10d store,
and the survivor must finish the run with every embedding row and optimizer slot equal, bit for
bit, to a single-process replay.
"""

from __future__ import annotations

import os

import pytest

from elastic_emb.etcd_server import EtcdServer, command, health
from etcd_fixture import etcd_server  # noqa: F401  (the fixture)
from etcd_fixture import require_etcd


def test_fixture_serves_the_v2_api_and_comes_back_after_a_kill(etcd_server):
    import etcd

    assert health(etcd_server.url) and etcd_server.started_in is not None and etcd_server.started_in < 20
    client = etcd.Client(host=etcd_server.host, port=etcd_server.client_port, read_timeout=5)
    client.write("/elastic_emb/probe", "v1")
    etcd_server.kill()  # the drill fault: SIGKILL, data directory kept
    assert not etcd_server.running and not health(etcd_server.url, timeout=0.2)
    etcd_server.start()  # same ports, same data
    assert client.read("/elastic_emb/probe").value == "v1"


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
    from elastic_emb.etcd_server import EtcdUnavailable

    monkeypatch.setenv("ELASTIC_EMB_ETCD", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcd anywhere on PATH
    with pytest.raises(EtcdUnavailable, match="etcd-server"):
        EtcdServer(tmp_path / "etcd").start()


# -- the drill: node 0 dies, etcd survives, nothing is lost ----------------------------------------


def test_etcd_v2_drill_loses_node_zero_while_etcd_survives_zero_loss(tmp_path):
    """The issue-7 drill through the drill tool (``elastic-emb drill``): store='etcd', node 0
    SIGKILLed at world 2 (the agent that would host a c10d store), etcd survives, node 0's rows
    come back from its replica on node 1, and every row equals the single-process replay."""
    require_etcd()
    from elastic_emb.drill import Fault, Scenario, run_drill

    scenario = Scenario(
        name="etcd-node0-loss", description="inner=etcd-v2; node 0 (the would-be c10d store host) dies at world 2.",
        initial_nodes=2, min_nodes=1, max_nodes=2, store="etcd", network="loopback", steps=70, step_delay=0.05,
        faults=(Fault(kind="kill_node", at_step=10, node=0),),
    )
    report = run_drill(scenario, tmp_path / "drill", progress="lines", summary=False)
    assert report["ok"], (report.get("error"), report.get("verification"))
    assert report["verification"]["ok"] and report["verification"]["step"] == scenario.steps - 1
    assert report["world_sizes"][0] == 2 and report["world_sizes"][-1] == 1, report["world_sizes"]
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_node" and fault["node"] == 0, fault
    (resize,) = [r for r in report["resizes"] if r["cause"] == "kill_node node0"]
    assert (resize["from_world"], resize["to_world"]) == (2, 1), resize
    print(f"\ndrill tool, store=etcd: node0 SIGKILLed at world 2, world 1 stepping after {resize['recovery_seconds']} s, "
          f"restored step {resize['restored_step']} from {resize['source_tiers']}; "
          f"{report['verification']['rows_checked']} rows equal the replay")
