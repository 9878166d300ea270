"""The cross-memory-attach row transport (elastic_emb/state/cma.py) with real rank processes.

Each case starts one process per rank (tests/cma_worker.py: real TCPStore, real gloo group),
hands each rank some old-layout shards as live pieces, restores into a new layout of uneven
owners, and checks every byte of every row, optimizer slot and table on every rank against the
value it must hold. The sabotaged cases make the probe or the pull fail for one sender: its rows
must arrive over gloo instead, as exactly, and the fallback must be logged. The single-process
tests pin the probe's refusals and the transport setting's error.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_emb.state import cma
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT as REPO
from elastic_emb.testing.procs import run_ranks, torchrun_env

CODE = "from tests.helpers import cma_worker; cma_worker.main()"

# name -> (world size of the new world, its owners (ELASTIC_EMB_EP_SIZE), old shards, holders)
CASES = {
    # 4 old shards, 3 ranks with 2 owners: rank 0 also keeps old shard 3 (its departed
    # neighbour's rows), rank 2 owns nothing and only sends.
    "4to3": (3, 2, 4, {3: 0}),
    # 3 old shards, one owner: ranks 1 and 2 send everything they hold to rank 0.
    "3to1": (3, 1, 3, {}),
    # 2 old shards held by ranks 0 and 1, four owners: ranks 2 and 3 only receive.
    "2to4": (4, 4, 2, {}),
}


def _run(tmp_path, case: str, transport: str | None = None, sabotage: list | None = None):
    world, ep, old, holders = CASES[case]
    port = free_port()
    spec = {"old": old, "holders": {str(k): v for k, v in holders.items()}, "sabotage": sabotage}
    extra = {
        "ELASTIC_EMB_EP_SIZE": str(ep),
        "CMAW_SPEC": json.dumps(spec),
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    if transport:
        extra["ELASTIC_EMB_TRANSPORT"] = transport
    results = run_ranks(CODE, [torchrun_env(r, world, port, extra=extra) for r in range(world)], timeout=90)
    for r in results:
        assert r.returncode == 0, (
            f"rank {r.rank} rc={r.returncode}\nstdout:{r.stdout[-2000:]}\nstderr:{r.stderr[-4000:]}"
        )
    values = [r.value for r in results]
    for v in values:
        assert v["step"] == 5, v
        assert v["bad"] == [], f"rank {v['rank']}: rows differ from what was sent: {v['bad']}"
    # Every row of every table has exactly one owner among the ranks.
    for t, n in (("items", 203), ("users", 61)):
        spans = sorted(tuple(v["rows"][t]) for v in values if v["rows"][t][1] > v["rows"][t][0])
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert sum(v["bytes_moved"] for v in values) > 0
    fallbacks = [
        json.loads(line)
        for r in results
        for line in r.stderr.splitlines()
        if line.startswith("{") and '"cma_fallback"' in line
    ]
    return values, fallbacks


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cma_restores_every_byte(tmp_path, case):
    values, fallbacks = _run(tmp_path, case)
    assert {v["transport"] for v in values} == {"cma"}, values  # the default on CPU, no pair fell back
    assert fallbacks == []


@pytest.mark.slow
def test_forced_p2p_never_tries_cma(tmp_path):
    values, fallbacks = _run(tmp_path, "4to3", transport="p2p")
    assert {v["transport"] for v in values} == {"p2p"}
    assert fallbacks == []


@pytest.mark.slow
def test_wrong_token_falls_back_to_gloo_for_that_sender(tmp_path):
    """Rank 1 publishes a token that its memory does not hold (as a recycled pid or another pid
    namespace would look): readers refuse to pull from it and take its rows over gloo; the other
    senders' rows still come by cma."""
    values, fallbacks = _run(tmp_path, "4to3", sabotage=["token", 1])
    assert {v["transport"] for v in values} == {"cma+p2p"}, values
    assert fallbacks and all("token mismatch" in f["reason"] and f["peer"] == 1 for f in fallbacks), fallbacks


@pytest.mark.slow
def test_failed_pull_falls_back_to_gloo(tmp_path):
    """Rank 0 publishes unmapped row addresses: the probe passes, the pull fails (EFAULT) half way
    through a receiver's blocks; that pair's rows then come over gloo, overwriting whatever the
    failed pull left."""
    values, fallbacks = _run(tmp_path, "2to4", sabotage=["addr", 0])
    assert {v["transport"] for v in values} == {"cma+p2p"}, values
    assert fallbacks and all("pull failed" in f["reason"] and f["peer"] == 0 for f in fallbacks), fallbacks


# -- one process ------------------------------------------------------------------------------------


def test_read_remote_copies_and_probe_accepts_only_the_same_process(monkeypatch):
    monkeypatch.setattr(cma, "job_member", lambda pid: None)  # pytest itself is no job worker: see below
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(1000, dtype=torch.float32)
    cma.read_remote(os.getpid(), [(dst.data_ptr(), src.data_ptr(), 4000)])
    assert torch.equal(dst, src)
    me = cma.identity()
    assert cma._probe(me, me) is None
    for key, what in (("boot", "boot id"), ("host", "host name"), ("pidns", "pid namespace")):
        assert what in cma._probe(me, {**me, key: "elsewhere"})
    assert "token mismatch" in cma._probe(me, {**me, "token": [me["token"][0], "ff" * 16]})
    unmapped = {**me, "token": [4096, me["token"][1]]}
    assert "probe read failed" in cma._probe(me, unmapped)
    with pytest.raises(cma._PullError):
        cma.read_remote(os.getpid(), [(dst.data_ptr(), 4096, 16)])


def test_job_member_accepts_only_siblings_of_the_same_run():
    """Three children of this test process: A and C of run "job", B of run "other". C accepts A
    only: B has another run id, and this test process (C's parent) is not a sibling."""
    import subprocess
    import sys

    def start(run_id, code):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(TORCHELASTIC_RUN_ID=run_id, PYTHONPATH=REPO)
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)

    sleeper = "import time; time.sleep(60)"
    a, b = start("job", sleeper), start("other", sleeper)
    try:
        check = (
            "import json, sys; from elastic_emb.state.cma import job_member; "
            f"print(json.dumps([job_member(p) for p in ({a.pid}, {b.pid}, {os.getpid()}, 999999999)]))"
        )
        c = start("job", check)
        out, _ = c.communicate(timeout=60)
        same, other_run, parent, gone = json.loads(out)
        assert same is None
        assert "TORCHELASTIC_RUN_ID='other'" in other_run
        assert "has parent" in parent and "not a process of this job" in gone
    finally:
        for p in (a, b):
            p.kill()
            p.wait(timeout=10)


@pytest.mark.slow
def test_forged_offer_naming_a_process_outside_the_job_is_refused(tmp_path):
    """Issue case 9: rank 1 rewrites its offer in the store to name another process (one it
    started, holding a known pattern at the published addresses, token included, so the old
    probe passed). Every receiver refuses it before reading a byte (not a worker of this job) and
    takes rank 1's rows over gloo: every row is exact (the pattern never lands in a row)."""
    values, fallbacks = _run(tmp_path, "4to3", sabotage=["forge", 1])
    assert {v["transport"] for v in values} == {"cma+p2p"}, values
    assert fallbacks and all(f["peer"] == 1 and "not a process of this job" in f["reason"] for f in fallbacks), (
        fallbacks
    )


def test_touch_writes_only_inside_the_destination():
    buf = torch.full((3 * cma.PAGE * 20,), 9, dtype=torch.uint8)
    inner = buf[cma.PAGE * 5 + 17 : cma.PAGE * 45 + 3]
    cma._touch(inner)
    assert bool((buf[: cma.PAGE * 5 + 17] == 9).all()) and bool((buf[cma.PAGE * 45 + 3 :] == 9).all())


def test_bad_transport_setting_names_the_value_and_the_fix(monkeypatch):
    import torch.distributed as dist

    from elastic_emb.state import Comm
    from elastic_emb.topology import Topology

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    topo = Topology.build(
        run_id="unit",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )
    monkeypatch.setenv("ELASTIC_EMB_TRANSPORT", "shm")
    with pytest.raises(ValueError, match=r"ELASTIC_EMB_TRANSPORT.*shm"):
        Comm(topo, store, None, timeout=10)
    monkeypatch.setenv("ELASTIC_EMB_TRANSPORT", "cma")
    assert Comm(topo, store, None, timeout=10).transport == "cma"
    monkeypatch.setenv("ELASTIC_EMB_TRANSPORT", "p2p")
    with pytest.raises(ValueError, match=r"ELASTIC_EMB_TRANSPORT='p2p'.*'cma' or 'p2p' on CPU only"):
        Comm(topo, store, None, timeout=10, device="meta")
