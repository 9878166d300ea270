"""State tiers below the lifecycle: the reshard plan, replica placement, snapshot files with
manifests and checksums, restore's choice of commit, and its refusal to invent rows.

The multi-rank behaviour (live transfer, replicas across nodes, DCP at another world size) is
exercised with real processes in test_lifecycle.py; here a one-rank world (a real TCPStore and
gloo group in this process) drives the same code paths on files that the tests then damage.
"""

from __future__ import annotations

import json
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_emb.testing.ports import free_port
from elastic_emb.errors import ChecksumMismatch, RestoreError
from elastic_emb.protocol import ShardData
from elastic_emb.sharding import owned_range
from elastic_emb.state import (
    Comm,
    CommitId,
    Piece,
    SnapshotTier,
    plan_assignments,
    read_snapshot,
    replica_holders,
    restore,
)
from elastic_emb.topology import Topology

SPEC = [["float32", [3]], ["float32", []]]  # weight [rows, 3] + one per-row slot


# -- pure planning ------------------------------------------------------------------------------


C = CommitId(1, 0, "c")


def _piece(table, start, stop, tier="snapshot", commit=C, handle=0, spec=SPEC):
    return Piece(table=table, start=start, stop=stop, tier=tier, commit=commit, handle=handle, spec=spec)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), old=st.integers(1, 7), new=st.integers(1, 7), data=st.data())
def test_plan_partitions_every_row_once(n, old, new, data):
    """Pieces are the old owners' shards, held by random ranks (own or replica); the plan must
    deliver every row of the new layout exactly once, from a rank that holds it."""
    world = max(old, new)
    invs = [[] for _ in range(world)]
    for src in range(old):
        rr = owned_range(n, old, src)
        if len(rr):
            holder = data.draw(st.integers(0, world - 1))
            invs[holder].append(_piece("t", rr.start, rr.stop, handle=len(invs[holder])))
    plan, missing = plan_assignments(invs, C, {"t": n}, new, {"t": SPEC})
    assert missing == []
    for dst in range(new):
        want = owned_range(n, new, dst)
        got = sorted((a.start, a.stop) for a in plan if a.dst == dst)
        flat = [r for a, b in got for r in range(a, b)]
        assert flat == list(range(want.start, want.stop))
    for a in plan:
        p = invs[a.src][a.handle]
        assert p.start <= a.start < a.stop <= p.stop


def test_plan_prefers_live_then_local_and_names_missing_rows():
    invs = [
        [_piece("t", 0, 50, "snapshot", handle=0), _piece("t", 50, 100, "replica", handle=1)],
        [_piece("t", 0, 50, "live", handle=0)],
    ]
    plan, missing = plan_assignments(invs, C, {"t": 150}, 2, {"t": SPEC})
    by_range = {(a.start, a.stop): (a.src, a.tier) for a in plan}
    assert by_range[(0, 50)] == (1, "live")  # live memory beats a file, even on another rank
    assert by_range[(50, 75)] == (0, "replica")
    assert missing == [("t", 100, 150)]
    # Another commit's pieces never mix in; a different slot layout never fills a table.
    invs[1].append(_piece("t", 100, 150, commit=CommitId(2, 0, "other"), handle=1))
    invs[0].append(_piece("t", 100, 150, handle=2, spec=[["float64", [3]], ["float32", []]]))
    assert plan_assignments(invs, C, {"t": 150}, 2, {"t": SPEC})[1] == [("t", 100, 150)]


def test_replica_holders_are_on_other_nodes():
    # nodes: 0 -> ranks 0,1 ; 1 -> ranks 2,3 ; 2 -> rank 4
    recs = [{"rank": r, "node_rank": n, "local_rank": lr} for r, (n, lr) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])]
    node_of = {r["rank"]: r["node_rank"] for r in recs}
    for r in range(5):
        hs = replica_holders(recs, r, 1)
        assert len(hs) == 1 and node_of[hs[0]] != node_of[r]
        hs2 = replica_holders(recs, r, 5)  # capped at the other nodes
        assert len(hs2) == 2 and len({node_of[h] for h in hs2} | {node_of[r]}) == 3
    assert replica_holders(recs, 1, 0) == []
    assert replica_holders(recs[:2], 0, 1) == []  # one node: nowhere else to put a replica


# -- one-rank world: files, manifests, checksums ----------------------------------------------------


class TinyContext:
    """The smallest ShardedContext: one table held in plain tensors."""

    owner_ranks = None  # rows laid out over the topology's ep_size (the contract's row_owners reads it)

    def __init__(self, topology, n=40):
        self.topology = topology
        self.rows = owned_range(n, topology.ep_size, topology.rank)
        self.w = torch.zeros(len(self.rows), 3)
        self.acc = torch.zeros(len(self.rows))

    def export_shard(self):
        return {"t": ShardData("t", self.rows, self.w.clone(), {"acc": self.acc.clone()})}

    def import_shard(self, shards):
        self.w.copy_(shards["t"].weight)
        self.acc.copy_(shards["t"].slots["acc"])

    def reset(self, rank, world_size):
        raise AssertionError("not used")

    def close(self):
        pass


@pytest.fixture
def world1(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    gen = [0]

    def make():
        gen[0] += 1
        topo = Topology.build(run_id="unit", generation=gen[0], rank=0, world_size=1, local_rank=0, local_world_size=1,
                              node_rank=0, num_nodes=1, ep_size=1, backend="gloo", master_addr="127.0.0.1", master_port=port)
        return topo, Comm(topo, store, None, timeout=30)

    return make


def _commit(tier, ctx, comm, step, value):
    ctx.w.fill_(value)
    ctx.acc.fill_(value + 0.5)
    return tier.commit(step, ctx.export_shard(), comm, {"t": 40})


def test_snapshot_round_trip_and_torn_commit_is_invisible(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=1, keep=3)
    ctx = TinyContext(topo)
    written, replicated = _commit(tier, ctx, comm, 0, 7.0)
    assert written == 40 * 3 * 4 + 40 * 4 and replicated == 0  # one node: no replica
    [(path, m)] = tier.manifests()
    assert m.step == 0 and m.fingerprint == topo.fingerprint() and not m.replica
    assert [(s.table, s.start, s.stop) for s in m.shards] == [("t", 0, 40)]
    got = read_snapshot(path, m)
    assert torch.equal(got["t"]["weight"], torch.full((40, 3), 7.0)) and torch.equal(got["t"]["acc"], torch.full((40,), 7.5))
    # A data file without its manifest (a crash in between) is not a commit.
    cdir = path.parent.with_name(path.parent.name.replace("000000000000", "000000000001"))
    cdir.mkdir()
    (cdir / "rank0.bin").write_bytes(path.read_bytes())
    assert [m.step for _, m in tier.manifests()] == [0]
    ctx.w.zero_()
    report = restore(ctx, comm, snapshot=tier, durable=None)
    assert report.step == 0 and report.source_tiers == ["snapshot"]
    assert torch.equal(ctx.w, torch.full((40, 3), 7.0))


def test_corrupt_snapshot_is_rejected_and_older_commit_used(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=3)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)
    _commit(tier, ctx, comm, 1, 2.0)
    newest = max(tier.manifests(), key=lambda pm: pm[1].step)
    raw = bytearray(newest[0].read_bytes())
    raw[5] ^= 0xFF  # one flipped byte in the weights
    newest[0].write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch, match="CRC32"):
        read_snapshot(*newest)
    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    report = restore(ctx2, comm2, snapshot=tier, durable=None)
    assert report.step == 0 and report.fallback and "step 1 " in report.fallback
    assert torch.equal(ctx2.w, torch.full((40, 3), 1.0)) and torch.equal(ctx2.acc, torch.full((40,), 1.5))


def test_missing_rows_raise_restore_error_never_fresh_rows(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 3, 4.0)
    # Rewrite the manifest as if it held only rows [0, 25): rows [25, 40) exist nowhere.
    [(path, m)] = tier.manifests()
    mpath = path.with_suffix(".json")
    doc = json.loads(mpath.read_text())
    doc["shards"][0]["stop"] = 25
    for t in doc["shards"][0]["tensors"]:
        t["nbytes"] = t["nbytes"] * 25 // 40
    doc["shards"][0]["tensors"][1]["offset"] = doc["shards"][0]["tensors"][0]["nbytes"]
    mpath.write_text(json.dumps(doc))
    ctx.w.fill_(-1.0)
    with pytest.raises(RestoreError) as info:
        restore(ctx, comm, snapshot=tier, durable=None)
    assert info.value.missing == [("t", 25, 40)]
    assert "t[25, 40)" in str(info.value)
    assert torch.equal(ctx.w, torch.full((40, 3), -1.0))  # untouched: no zeros, no fresh rows
    # The operator's view (`elastic-emb state`) says the same.
    from click.testing import CliRunner
    from elastic_emb.cli import main

    res = CliRunner().invoke(main, ["state", "--state-dir", str(tmp_path), "--run-id", "unit"])
    assert res.exit_code == 0, res.output
    [commit] = json.loads(res.output)["commits"]
    assert commit["step"] == 3 and not commit["complete"] and commit["missing"] == [["t", 25, 40]]
    assert commit["nodes"] == ["nodeA"]


def test_first_start_without_state_keeps_initial_rows(tmp_path, world1):
    topo, comm = world1()
    ctx = TinyContext(topo)
    ctx.w.fill_(3.0)
    report = restore(ctx, comm, snapshot=SnapshotTier(tmp_path, "unit", "nodeA"), durable=None)
    assert report.step == -1 and report.source_tiers == ["init"]
    assert torch.equal(ctx.w, torch.full((40, 3), 3.0))
    with pytest.raises(RestoreError, match="state was required"):
        restore(ctx, comm, snapshot=SnapshotTier(tmp_path, "unit", "nodeA"), durable=None, require_state=True)


def test_prune_keeps_newest_complete_commits(tmp_path):
    import time

    tier = SnapshotTier(tmp_path, "unit", "nodeA", keep=2)
    layout = [("step-000000000004-aa", True), ("step-000000000005-aa", True), ("step-000000000005-zz", False),
              ("step-000000000006-bb", True), ("step-000000000007-bb", False)]
    for name, complete in layout:
        d = tier.node_dir / name
        d.mkdir(parents=True)
        (d / "rank0.bin").write_bytes(b"x")
        if complete:
            (d / "rank0.json").write_text("{}")
        time.sleep(0.01)
    tier.prune()
    # Two newest complete commits stay (5, 6); step 4 goes; the torn step-5 of another
    # generation goes; a newer torn directory (a commit in progress) stays.
    assert sorted(p.name for p in tier.node_dir.iterdir()) == [
        "step-000000000005-aa", "step-000000000006-bb", "step-000000000007-bb"]


@settings(max_examples=40, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_crc32_combine_matches_crc_of_concatenation(a, b):
    """What lets a durable checkpoint saved at one world size be verified at another."""
    import zlib

    from elastic_emb.state import crc32_combine

    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_read_snapshot_copies_rows_while_it_verifies(tmp_path, world1, monkeypatch):
    """Rows restored locally from a file are copied in the checksum's pass (block by block): the
    copies must equal the file's rows at any offset and block size, and a corrupt file must still
    be refused when it is read that way."""
    import elastic_emb.state.snapshot as state

    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    ctx = TinyContext(topo)
    ctx.w.copy_(torch.arange(120, dtype=torch.float32).reshape(40, 3))
    ctx.acc.copy_(torch.arange(40, dtype=torch.float32) * -2)
    tier.commit(0, ctx.export_shard(), comm, {"t": 40})
    [(path, m)] = tier.manifests()
    monkeypatch.setattr(state, "VERIFY_CHUNK", 100)  # blocks smaller than a piece, not row-aligned
    w_a, acc_a, w_b = torch.zeros(7, 3), torch.zeros(7), torch.zeros(20, 3)
    fill = {"t": [(3, 10, {"weight": w_a, "acc": acc_a}), (20, 40, {"weight": w_b})]}
    got = read_snapshot(path, m, fill=fill)
    assert torch.equal(w_a, ctx.w[3:10]) and torch.equal(acc_a, ctx.acc[3:10]) and torch.equal(w_b, ctx.w[20:40])
    assert torch.equal(got["t"]["weight"], ctx.w) and torch.equal(got["t"]["acc"], ctx.acc)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last slot
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch, match="'acc'"):
        read_snapshot(path, m, fill=fill)
