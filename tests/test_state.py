"""State tiers below the lifecycle: the reshard plan, replica placement, snapshot files with
manifests and checksums, restore's choice of commit, and its refusal to invent rows.

The multi-rank behaviour (live transfer, replicas across nodes, DCP at another world size) is
exercised with real processes in test_lifecycle.py; here a one-rank world (a real TCPStore and
gloo group in this process) drives the same code paths on files that the tests then damage.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_emb.errors import ChecksumMismatch, RestoreError
from elastic_emb.protocol import ContextBase, ShardData
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
from elastic_emb.state.snapshot import FOLD_CHAIN_LIMIT
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology
from tests.helpers.tmpfs import fill, mounted_tmpfs

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
    recs = [
        {"rank": r, "node_rank": n, "local_rank": lr}
        for r, (n, lr) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])
    ]
    node_of = {r["rank"]: r["node_rank"] for r in recs}
    for r in range(5):
        hs = replica_holders(recs, r, 1)
        assert len(hs) == 1 and node_of[hs[0]] != node_of[r]
        hs2 = replica_holders(recs, r, 5)  # capped at the other nodes
        assert len(hs2) == 2 and len({node_of[h] for h in hs2} | {node_of[r]}) == 3
    assert replica_holders(recs, 1, 0) == []
    assert replica_holders(recs[:2], 0, 1) == []  # one node: nowhere else to put a replica


# -- one-rank world: files, manifests, checksums ----------------------------------------------------


class TinyContext(ContextBase):
    """The smallest ShardedContext: one table held in plain tensors (no shard_views: restore
    imports a filled copy)."""

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
        topo = Topology.build(
            run_id="unit",
            generation=gen[0],
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
    assert torch.equal(got["t"]["weight"], torch.full((40, 3), 7.0)) and torch.equal(
        got["t"]["acc"], torch.full((40,), 7.5)
    )
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
    assert report.step == 0 and report.fallback and "rank0.bin (step 1, rows t[0, 40)" in report.fallback
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

    from elastic_emb.cli.main import main

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


def _shrink_manifest(mpath, stop):
    """Rewrite a manifest as if its shard held only rows [0, stop): a partial commit."""
    doc = json.loads(mpath.read_text())
    n = doc["shards"][0]["stop"]
    doc["shards"][0]["stop"] = stop
    for t in doc["shards"][0]["tensors"]:
        t["nbytes"] = t["nbytes"] * stop // n
    doc["shards"][0]["tensors"][1]["offset"] = doc["shards"][0]["tensors"][0]["nbytes"]
    mpath.write_text(json.dumps(doc))


def test_prune_counts_only_valid_manifests_that_cover_every_row(tmp_path, world1):
    """Issue case 1: a partial commit (valid manifest, rows missing), one with an invalid-JSON
    manifest and a torn one (data only) are newer than the last complete commit. Prune keeps
    ``keep`` complete commits and every newer directory (it may still complete); restore takes
    the newest complete commit; the start of the next generation removes the torn ones."""
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=2)
    ctx = TinyContext(topo)
    for step in range(5):
        _commit(tier, ctx, comm, step, float(step))
        tier.prune(comm)

    def names():
        return sorted(p.name.split("-")[1].lstrip("0") or "0" for p in tier.node_dir.glob("step-*"))

    assert names() == ["3", "4"]
    _commit(tier, ctx, comm, 5, 5.0)
    _shrink_manifest(tier.node_dir.glob("step-000000000005-*").__next__() / "rank0.json", 25)
    _commit(tier, ctx, comm, 6, 6.0)
    (next(tier.node_dir.glob("step-000000000006-*")) / "rank0.json").write_text("{not json")
    _commit(tier, ctx, comm, 7, 7.0)
    (next(tier.node_dir.glob("step-000000000007-*")) / "rank0.json").unlink()
    assert tier.prune(comm) == []
    assert names() == ["3", "4", "5", "6", "7"]
    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    report = restore(ctx2, comm2, snapshot=tier, durable=None)
    assert report.step == 4 and torch.equal(ctx2.w, torch.full((40, 3), 4.0))
    torn = sorted(p.name for p in tier.node_dir.glob("step-00000000000[567]-*"))
    assert sorted(tier.prune(comm2, at_start=True)) == torn and len(torn) == 3
    assert names() == ["3", "4"]


def test_run_that_committed_never_restarts_from_the_seed_silently(tmp_path, world1):
    """Issue case 2: every manifest deleted, data files and the run marker still there: restore
    raises, naming what exists; ``start_fresh`` starts over on purpose."""
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)
    _commit(tier, ctx, comm, 1, 2.0)
    assert (tier.node_dir / "run.json").exists()
    for m in tier.node_dir.glob("step-*/*.json"):
        m.unlink()
    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    ctx2.w.fill_(-3.0)
    with pytest.raises(RestoreError, match=r"committed before \(run marker on nodes \['nodeA'\]\).*step-000000000001-"):
        restore(ctx2, comm2, snapshot=tier, durable=None)
    assert torch.equal(ctx2.w, torch.full((40, 3), -3.0))
    report = restore(ctx2, comm2, snapshot=tier, durable=None, start_fresh=True)
    assert report.step == -1 and report.fallback == "start_fresh" and torch.equal(ctx2.w, torch.full((40, 3), -3.0))
    # Without the marker, data files without manifests still say that state existed.
    (tier.node_dir / "run.json").unlink()
    with pytest.raises(RestoreError, match="without a valid manifest set"):
        restore(ctx2, comm2, snapshot=tier, durable=None)


def test_state_files_are_owner_only_and_ids_cannot_leave_the_root(tmp_path, world1):
    import os
    import stat

    from elastic_emb.errors import TopologyError
    from elastic_emb.state.paths import under

    old = os.umask(0o022)
    try:
        topo, comm = world1()
        tier = SnapshotTier(tmp_path / "root", "unit", "nodeA", replication=0)
        _commit(tier, TinyContext(topo), comm, 0, 1.0)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path / "root"): stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "root").rglob("*")}
    assert modes and all(m == (0o700 if (tmp_path / "root" / p).is_dir() else 0o600) for p, m in modes.items()), modes
    assert stat.S_IMODE((tmp_path / "root").stat().st_mode) == 0o700
    for bad in ("../../x", "/abs", ".", "..", "a/b", ".hidden", "x" * 129, ""):
        with pytest.raises(TopologyError, match="run_id"):
            Topology.build(
                run_id=bad,
                generation=0,
                rank=0,
                world_size=1,
                local_rank=0,
                local_world_size=1,
                node_rank=0,
                num_nodes=1,
                ep_size=1,
                backend="gloo",
                master_addr="h",
                master_port=1,
            )
        with pytest.raises(ValueError, match="not a plain name"):
            SnapshotTier(tmp_path / "root", bad, "nodeA")
        with pytest.raises(ValueError, match="not a plain name"):
            SnapshotTier(tmp_path / "root", "unit", bad)
    # A symlink planted in the tree cannot lead a tier outside its root.
    (tmp_path / "root" / "evil").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="not inside its root"):
        under(tmp_path / "root", "evil", "nodeA")


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
    import elastic_emb.state.shardfile as state

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


# -- real processes: torn commits on one of two local ranks, a corrupt file on a 4-rank node -------


def _lifecycle_run(tmp_path, layout, gen, out, until, extra=None, config=None):
    from elastic_emb.testing.procs import run_ranks
    from tests.helpers import lifecycle_worker as lw
    from tests.test_lifecycle import rank_env, spec_of

    port = free_port()
    spec = spec_of(out, train_until=until, config={"transfer_timeout": 8, **(config or {})})
    envs = [rank_env(tmp_path, layout, r, port, gen, spec, (extra or {}).get(r)) for r in range(len(layout))]
    return run_ranks(lw.CODE, envs, 120)


@pytest.mark.slow
def test_torn_commits_of_one_local_rank_never_cost_the_last_complete_commit(tmp_path):
    """Issue case 1 with real processes: two ranks on one node; rank 1 is killed between its data
    and its manifest at step 5, twice in a row (rank 0's manifest of step 5 is written both times).
    The third start still restores step 4 bit for bit and trains on."""
    from tests.test_lifecycle import assert_bit_exact, gather, ok, ref_after

    out = tmp_path / "out"
    out.mkdir()
    kill = {1: {"ELASTIC_EMB_FAULT": "snapshot_before_manifest@5"}}
    for gen in (0, 1):
        results = _lifecycle_run(tmp_path, ["A", "A"], gen, out, 7, extra=kill)
        assert results[1].returncode == -9 and results[0].returncode != 0, [
            (r.returncode, r.stderr[-800:]) for r in results
        ]
    node = tmp_path / "nodes" / "A" / "test" / "A"
    assert len(list(node.glob("step-000000000004-*/rank1.json"))) == 1  # step 4 survived both crashes
    values = ok(_lifecycle_run(tmp_path, ["A", "A"], 2, out, 7))
    assert [v["start_step"] for v in values] == [4, 4]
    assert_bit_exact(gather(out, "start", 2), ref_after(4), "restored after two torn commits")
    assert_bit_exact(gather(out, "phase1", 2), ref_after(7), "trained on")
    # The torn step-5 directories of generations 0 and 1 went at the start: what is left is complete.
    left = sorted(node.glob("step-*"))
    assert left and all((d / "rank0.json").exists() and (d / "rank1.json").exists() for d in left), left


@pytest.mark.slow
def test_one_corrupt_file_on_a_four_rank_node_restores_the_older_commit(tmp_path):
    """Issue case 3: one flipped byte in rank0.bin of the newest commit, four ranks on the node.
    The file is rejected once for the whole node (not once per rank) and the previous commit is
    restored bit for bit."""
    from tests.test_lifecycle import assert_bit_exact, gather, ok, ref_after

    out = tmp_path / "out"
    out.mkdir()
    ok(_lifecycle_run(tmp_path, ["A"] * 4, 0, out, 3))
    [manifest] = (tmp_path / "nodes" / "A" / "test" / "A").glob("step-000000000003-*/rank0.json")
    data = manifest.with_name(json.loads(manifest.read_text())["data_file"])  # (a delta's, or its fold's)
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0x40
    data.write_bytes(bytes(raw))
    results = _lifecycle_run(tmp_path, ["A"] * 4, 1, out, 4)
    values = ok(results)
    assert [v["start_step"] for v in values] == [2] * 4
    assert_bit_exact(gather(out, "start", 1), ref_after(2), "restored the commit before the corrupt one")
    rejected = [line for r in results for line in r.stderr.splitlines() if '"snapshot_rejected"' in line]
    assert len(rejected) == 1, rejected


# -- full and read-only storage (a tmpfs the test mounts; needs root) ---------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "256k") as mnt:
        yield mnt


def test_full_storage_fails_the_commit_in_one_line_and_keeps_older_commits(tmpfs, world1):

    from elastic_emb.errors import StorageError

    topo, comm = world1()
    tier = SnapshotTier(tmpfs, "unit", "nodeA", replication=0, keep=3)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)
    filler = tmpfs / "filler"
    fill(filler, most=1 << 20)  # to the last block (it holds 256 KiB)
    with pytest.raises(StorageError) as info:
        _commit(tier, ctx, comm, 1, 2.0)
    msg = str(info.value)
    assert "\n" not in msg and "step-000000000001-" in msg and "needs 640 bytes" in msg and "bytes free" in msg, msg
    assert [p.name[:17] for p in tier.node_dir.glob("step-*")] == ["step-000000000000"]  # partial dir removed
    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    assert restore(ctx2, comm2, snapshot=tier, durable=None).step == 0
    assert torch.equal(ctx2.w, torch.full((40, 3), 1.0))
    filler.unlink()  # space freed: the job commits again
    _commit(tier, ctx2, comm2, 1, 2.0)
    assert restore(TinyContext(topo2), comm2, snapshot=tier, durable=None).step == 1


def test_restore_from_a_read_only_state_directory(tmpfs, world1):
    import subprocess

    from elastic_emb.errors import StorageError

    topo, comm = world1()
    tier = SnapshotTier(tmpfs, "unit", "nodeA", replication=0)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)
    _commit(tier, ctx, comm, 1, 2.0)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    report = restore(ctx2, comm2, snapshot=tier, durable=None)
    assert (
        report.step == 1
        and torch.equal(ctx2.w, torch.full((40, 3), 2.0))
        and torch.equal(ctx2.acc, torch.full((40,), 2.5))
    )
    assert tier.prune(comm2, at_start=True) == []  # nothing to delete, and a read-only root does not fail it
    with pytest.raises(StorageError, match="Read-only file system"):
        _commit(tier, ctx2, comm2, 2, 3.0)


# -- incremental commits: a base and a chain of deltas ------------------------------------------------


class TrackingContext(TinyContext):
    """TinyContext that tracks the rows it writes (``take_changes``), as the contract asks."""

    tracks_changes = True

    def __init__(self, topology, n=40):
        super().__init__(topology, n)
        self.changed = torch.zeros(len(self.rows), dtype=torch.bool)

    def write(self, local_rows, value):
        self.w[local_rows] = value
        self.acc[local_rows] = value + 0.25
        self.changed[local_rows] = True

    def take_changes(self):
        out, self.changed = self.changed, torch.zeros(len(self.rows), dtype=torch.bool)
        return {"t": out}


def _delta_commit(tier, ctx, comm, step):
    return tier.commit(step, ctx.export_shard(), comm, {"t": 40}, changes=ctx.take_changes())


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "rebased"])
@settings(max_examples=8, deadline=None)
@given(writes=st.lists(st.lists(st.integers(0, 39), max_size=12), min_size=1, max_size=7))
def test_base_and_deltas_restore_every_commit_exactly(tmp_path_factory, fold, writes):
    """Random writes (duplicates, empty steps) committed as a base and deltas (chain bound 3):
    restoring at each commit gives exactly the rows as they were at that commit; delta files hold
    only the changed rows. ``folded``: every third delta is folded into a base by the compactor
    (the chain goes on from it); ``rebased`` (the GPU path's rule): the commit after three deltas
    is a captured base."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("chain")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    topo = Topology.build(
        run_id="unit",
        generation=1,
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
    comm = Comm(topo, store, None, timeout=30)
    tier = SnapshotTier(tmp, "unit", "nodeA", replication=0, keep=100, max_chain=3, fold_ratio=1e9, fold_max_deltas=3)
    tier.fold = fold
    ctx = TrackingContext(topo)
    ctx.write(list(range(40)), 0.0)
    _delta_commit(tier, ctx, comm, 0)
    want = {0: (ctx.w.clone(), ctx.acc.clone())}
    for step, rows in enumerate(writes, start=1):
        if rows:
            ctx.write(rows, float(step))
        written, _ = _delta_commit(tier, ctx, comm, step)
        tier.prune(comm)  # as every commit is followed: it hands a fold point to the compactor
        assert tier.compactor.wait(60)
        want[step] = (ctx.w.clone(), ctx.acc.clone())
        [(_, m)] = [(p, m) for p, m in tier.manifests() if m.step == step]
        if fold:  # every commit a delta on the one before; every third one folded into a base
            assert written == len(set(rows)) * (8 + 12 + 4)  # index + weight + slot of changed rows only
            assert (m.parent is None) == (step % 3 == 0), (step, m.parent)
        else:
            assert (m.parent is None) == (step % 4 == 0), (step, m.parent)  # a base after 3 deltas
            if m.parent is not None:
                assert written == len(set(rows)) * (8 + 12 + 4)
    if fold:
        assert tier.compactor.folded == len(writes) // 3
    for step in sorted(want):
        for d in tier.node_dir.glob("step-*"):  # hide the newer commits: restore must give `step`
            if int(d.name.split("-")[1]) > step:
                d.rename(d.with_name("hidden-" + d.name))
        ctx2 = TrackingContext(topo)
        assert restore(ctx2, comm, snapshot=tier, durable=None).step == step
        assert torch.equal(ctx2.w, want[step][0]) and torch.equal(ctx2.acc, want[step][1]), step
        for d in tier.node_dir.glob("hidden-*"):
            d.rename(d.with_name(d.name.removeprefix("hidden-")))
    comm.close()


def test_a_fold_never_launders_a_corrupt_link_and_a_cancelled_fold_changes_nothing(tmp_path, world1):
    """The compactor reads a chain verified before it folds it (a corrupt base would otherwise get
    a fresh checksum in the new base): the fold fails, is logged, and the delta stays as it was. A
    fold cancelled (a resize, the exit) leaves the delta as it was too, with no file of its own
    left. A fold that runs folds the chain into a base that restores the same rows."""
    from elastic_emb.errors import _FoldCancelled
    from elastic_emb.state.compact import fold

    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=100, fold_ratio=1e9, fold_max_deltas=2)
    ctx = TrackingContext(topo)
    for step in range(3):  # a base, two deltas: step 2 is a fold point
        ctx.write([step, step + 7], float(step + 1))
        _delta_commit(tier, ctx, comm, step)
        if step < 2:
            tier.prune(comm)
    [cdir] = tier.node_dir.glob("step-000000000002-*")
    manifest = cdir / "rank0.json"
    before = manifest.read_bytes()
    with pytest.raises(_FoldCancelled):
        fold(tier, manifest, lambda: True)
    assert manifest.read_bytes() == before and not (cdir / "rank0.base.bin").exists()
    [base] = tier.node_dir.glob("step-000000000000-*/rank0.bin")
    good = base.read_bytes()
    base.write_bytes(good[:5] + bytes([good[5] ^ 1]) + good[6:])  # one bit of the base flipped
    tier.prune(comm)  # the fold point's prune hands step 2 to the compactor
    assert tier.compactor.wait(60) and tier.compactor.folded == 0
    assert manifest.read_bytes() == before and (cdir / "rank0.bin").is_file()
    assert not (cdir / "rank0.base.bin").exists()
    base.write_bytes(good)
    assert fold(tier, manifest) is not None  # now it folds: a base, and the delta's file is gone
    folded = json.loads(manifest.read_text())
    assert folded["parent"] is None and folded["folded_from"][0] == 1 and folded["data_file"] == "rank0.base.bin"
    assert not (cdir / "rank0.bin").exists()
    for d in tier.node_dir.glob("step-00000000000[01]-*"):  # restore needs nothing else now
        shutil.rmtree(d)
    topo2, comm2 = world1()
    ctx2 = TrackingContext(topo2)
    assert restore(ctx2, comm2, snapshot=tier, durable=None).step == 2
    assert torch.equal(ctx2.w, ctx.w) and torch.equal(ctx2.acc, ctx.acc)


def test_fold_points_follow_the_bytes_the_deltas_hold(tmp_path, world1, monkeypatch):
    """A fold costs a pass over the shard, so fold points are spaced by what a restore would read
    of the deltas: their bytes plus a cost per file (``DELTA_FILE_COST``). With ``fold_ratio`` 0.5
    of a 640-byte base and deltas of 96 bytes (4 rows of 24: index, weight, slot): every fourth
    delta without a file cost (384 >= 320 > 288), every third with 32 bytes a file (384 >= 320 >
    256), every second when the count bound (``fold_max_deltas`` 2) comes first, and never sooner
    than ``max_chain`` deltas after the last (here 6: a fold is no more frequent than the captured
    bases it replaces)."""
    from elastic_emb.state import compact

    for cost, ratio, max_deltas, max_chain, every in (
        (0, 0.5, 1000, 1, 4),
        (32, 0.5, 1000, 1, 3),
        (0, 0.5, 2, 1, 2),
        (0, 0.5, 1000, 6, 6),
    ):
        monkeypatch.setattr(compact, "DELTA_FILE_COST", cost)
        topo, comm = world1()
        tier = SnapshotTier(
            tmp_path / f"{cost}-{max_deltas}-{max_chain}",
            "unit",
            "nodeA",
            replication=0,
            keep=100,
            max_chain=max_chain,
            fold_ratio=ratio,
            fold_max_deltas=max_deltas,
        )
        ctx = TrackingContext(topo)
        ctx.write(list(range(40)), 0.0)
        folded = []
        for step in range(13):
            if step:
                ctx.write([(4 * step + k) % 40 for k in range(4)], float(step))
            written, _ = _delta_commit(tier, ctx, comm, step)
            assert written == (40 * 16 if step == 0 else 4 * 24), (step, written)
            tier.prune(comm)
            assert tier.compactor.wait(60)
            folded += [m.step for _, m in tier.manifests() if m.step == step and m.parent is None and step]
        assert folded == list(range(every, 13, every)), (cost, max_deltas, max_chain, folded)


def test_delta_chain_torn_tail_missing_link_and_prune(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=1, max_chain=8)
    ctx = TrackingContext(topo)
    for step in range(5):
        ctx.write([step, step + 10], float(step + 1))
        _delta_commit(tier, ctx, comm, step)
        tier.prune(comm)
    # keep=1 keeps the newest commit and its whole chain back to the base.
    assert len(list(tier.node_dir.glob("step-*"))) == 5
    dirs = sorted(tier.node_dir.glob("step-*"))
    # A torn tail (the newest delta without its manifest) is no commit: step 3 is restored.
    (dirs[4] / "rank0.json").unlink()
    ctx2 = TrackingContext(world1()[0])
    topo2, comm2 = world1()
    assert restore(ctx2, comm2, snapshot=tier, durable=None).step == 3
    assert float(ctx2.w[3, 0]) == 4.0 and float(ctx2.w[4, 0]) == 0.0
    # A missing link in the middle: step 2 gone while step 3 needs it: a named error, no gap.
    import shutil

    shutil.rmtree(dirs[2])
    with pytest.raises(RestoreError, match=r"missing link: step 3 .* delta on step 2 .*t\[0, 40\)"):
        restore(TrackingContext(topo2), comm2, snapshot=tier, durable=None)


@pytest.mark.slow
@pytest.mark.parametrize("fold", [False, True], ids=["rebased", "folded"])
@pytest.mark.parametrize("keep,max_chain", [(2, 4), (3, 2)])
def test_node_directory_stays_within_the_stated_bound_over_a_long_run(tmp_path, world1, keep, max_chain, fold):
    """120 commits (a base, then deltas of up to W random rows), each followed by prune as the
    lifecycle does: after every commit the node directory holds at most the bound of
    :mod:`elastic_emb.state.delta`, computed here from the config: never more commit directories,
    never more data bytes. ``rebased`` (a captured base every max_chain + 1 commits): 2 bases and
    max_chain + keep - 2 deltas, and the prunes the tier skips (a delta at least ``keep`` from its
    base) leave nothing behind: a full prune of a fresh tier on the same directory then deletes
    nothing. ``folded`` (the compactor folds every max_chain-th delta into a base, and the full
    prune at the next fold point frees what that made obsolete): 2 bases and 2 * max_chain - 2
    deltas, and a fresh prune deletes nothing right after a fold point's prune."""
    n, w, steps = 40, 6, 120
    row = 3 * 4 + 4  # weight float32[3] + one float32 slot
    base_bytes, delta_bytes = n * row, w * (row + 8)  # + the int64 index of each changed row
    window = 2 * max_chain - 2 if fold else max_chain + keep - 2
    max_dirs = 2 + window
    bound = 2 * base_bytes + window * delta_bytes
    topo, comm = world1()
    tier = SnapshotTier(
        tmp_path,
        "unit",
        "nodeA",
        replication=0,
        keep=keep,
        max_chain=max_chain,
        fold_ratio=1e9,
        fold_max_deltas=max_chain,
    )
    tier.fold = fold
    ctx = TrackingContext(topo)
    gen = torch.Generator().manual_seed(17)
    peak = peak_dirs = 0
    full_prunes = []
    full_prune = tier._prune
    tier._prune = lambda c, at_start: full_prunes.append(step) or full_prune(c, at_start)
    for step in range(steps):
        rows = torch.randint(0, n, (int(torch.randint(0, w + 1, (1,), generator=gen)),), generator=gen).tolist()
        ctx.write(rows, float(step + 1))
        _delta_commit(tier, ctx, comm, step)
        tier.prune(comm)
        if fold:
            assert tier.compactor.wait(60)  # (the next fold point would wait for it, bounded)
        if not fold or (step and step % max_chain == 0):
            fresh = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=keep, max_chain=max_chain)
            assert fresh.prune(comm) == [], f"step {step}: the prune after it left deletable commits"
        dirs = list(tier.node_dir.glob("step-*"))
        used = sum(f.stat().st_size for d in dirs for f in d.glob("*.bin"))
        assert len(dirs) <= max_dirs and used <= bound, (step, len(dirs), used, bound)
        peak, peak_dirs = max(peak, used), max(peak_dirs, len(dirs))
    assert peak > base_bytes and peak_dirs == max_dirs  # the bound is reached: exercised, not trivially met
    # Full prunes only at the base and the keep - 1 deltas after it, and at the fold points (the
    # others were skipped). (Folded, the chain is never re-based within 120 steps.)
    if fold:
        assert FOLD_CHAIN_LIMIT > steps and tier.compactor.folded == (steps - 1) // max_chain
        assert full_prunes == [s for s in range(steps) if s < keep or s % max_chain == 0], full_prunes
    else:
        assert full_prunes == [s for s in range(steps) if s % (max_chain + 1) < keep], full_prunes
    topo2, comm2 = world1()
    ctx2 = TrackingContext(topo2)
    assert restore(ctx2, comm2, snapshot=tier, durable=None).step == steps - 1
    assert torch.equal(ctx2.w, ctx.w) and torch.equal(ctx2.acc, ctx.acc)


# -- asynchronous commits (a background writer) with real processes -----------------------------------


@pytest.mark.slow
def test_async_commits_restore_bit_for_bit_and_a_kill_loses_only_the_commit_in_flight(tmp_path):
    from tests.test_lifecycle import assert_bit_exact, gather, ok, ref_after

    out = tmp_path / "out"
    out.mkdir()
    cfg = {"async_commit": True}
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], 0, out, 3, config=cfg))
    assert [v["step"] for v in values] == [3, 3]
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], 1, out, 5, config=cfg))
    assert [v["start_step"] for v in values] == [3, 3]  # close() waited for the commit in flight
    assert_bit_exact(gather(out, "start", 1), ref_after(3), "restored from asynchronous commits")
    assert_bit_exact(gather(out, "phase1", 1), ref_after(5), "trained on")
    # SIGKILL in the writer thread between the data and the manifests of step 7.
    kill = {r: {"ELASTIC_EMB_FAULT": "snapshot_before_manifest@7"} for r in range(2)}
    results = _lifecycle_run(tmp_path, ["A", "B"], 2, out, 8, extra=kill, config=cfg)
    # The first rank at the point is killed; its peer is killed there too or fails on the dead rank (exit 1).
    codes = [r.returncode for r in results]
    assert -9 in codes and 0 not in codes, [(r.returncode, r.stderr[-800:]) for r in results]
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], 3, out, 8, config=cfg))
    assert [v["start_step"] for v in values] == [6, 6]
    assert_bit_exact(gather(out, "start", 3), ref_after(6), "the commit in flight was lost, the one before restored")


def _commit_in_flight_to_a_dead_peer(tmp_path, timeout: float, **a_spec):
    """Nodes A and B commit in the background (``transfer_timeout`` = ``timeout``); B dies
    (SIGKILL) in its writer right after the data of step 2, so A's commit of step 2 waits for B
    in A's writer; A then re-forms alone with abort and trains to step 4. Returns A's result
    (``out`` under ``tmp_path``); ``a_spec``: more of A's lifecycle_worker spec."""
    from elastic_emb.testing.procs import run_ranks
    from tests.helpers import lifecycle_worker as lw
    from tests.test_lifecycle import layout_env, rank_env, spec_of

    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    config = {"async_commit": True, "transfer_timeout": timeout}
    specs = [
        spec_of(
            out,
            train_until=2,
            then_until=4,
            config=config,
            **a_spec,
            resize={"env": layout_env(["A"], 0, port, 1), "abort": True},
        ),
        spec_of(out, train_until=2, config=config, resize={"env": None}),
    ]
    kill = {"ELASTIC_EMB_FAULT": "snapshot_data_written@2"}
    envs = [rank_env(tmp_path, ["A", "B"], r, port, 0, specs[r], kill if r == 1 else None) for r in range(2)]
    a, b = run_ranks(lw.CODE, envs, 150)
    assert b.returncode == -9, (b.returncode, b.stderr[-1500:])
    assert a.returncode == 0, (a.returncode, a.stderr[-3000:])
    return a


@pytest.mark.slow
def test_async_commit_in_flight_to_a_dead_peer_is_dropped_by_an_aborted_reform(tmp_path):
    """Nodes A and B commit in the background; B dies (SIGKILL) in its writer right after the data
    of step 2, so A's commit of step 2 waits for B in its writer. A re-forms alone with abort
    (a peer died): it drops that commit instead of waiting out transfer_timeout for it, restores
    step 1 (B's rows from their replica on A) bit for bit, and trains on to step 4."""
    from tests.test_lifecycle import assert_bit_exact, gather, ref_after

    out = tmp_path / "out"
    timeout = 60.0
    a = _commit_in_flight_to_a_dead_peer(tmp_path, timeout)
    ev = a.value["events"][-1]
    assert ev["restored_step"] == 1 and a.value["step"] == 4, ev
    assert set(ev["source_tiers"]) == {"snapshot", "replica"}, ev  # aborted: no live rows
    # Bound, not a speed figure: the re-form did not wait for the dropped commit's timeout.
    assert ev["teardown_s"] < timeout / 2, ev
    assert_bit_exact(gather(out, "resized", 1), ref_after(1), "restored after dropping the commit in flight")
    assert_bit_exact(gather(out, "final", 1), ref_after(4), "trained on alone")


@pytest.mark.slow
def test_a_dead_peer_made_known_ends_the_wait_for_the_commit_in_flight(tmp_path):
    """As above, B dies in its writer after the data of step 2, so A's commit of step 2 waits for
    B's keys in A's writer. A's training thread waits for that commit (``wait_commit``, as it
    does for a slot of the writer at its next commit) while another thread learns that a peer is
    gone (the in-process resize's neighbour probe calls ``Lifecycle.interrupt``): the wait raises
    _CommAborted at once, not after transfer_timeout, the committed step stays 1, and the aborted
    re-form restores step 1 bit for bit and trains on."""
    from tests.test_lifecycle import assert_bit_exact, gather, ref_after

    out = tmp_path / "out"
    timeout = 60.0
    a = _commit_in_flight_to_a_dead_peer(tmp_path, timeout, interrupt_after=1.0)
    waited = a.value["interrupted"]
    assert waited["error"] == "_CommAborted" and waited["committed"] == 1, waited
    # Bound, not a speed figure: the interrupt (1 s in) ended the wait, not transfer_timeout.
    assert waited["seconds"] < timeout / 2, waited
    ev = a.value["events"][-1]
    assert ev["restored_step"] == 1 and a.value["step"] == 4, ev
    # The expected abort is logged as what it is, a warning with the reason and step, never as the
    # error commit_failed (which stays for real failures).
    logged = [json.loads(line) for line in a.stderr.splitlines() if line.startswith("{")]
    aborted = [e for e in logged if e.get("event") == "commit_aborted"]
    assert [(e["level"], e["step"], e["reason"]) for e in aborted] == [("warning", 2, "the test's peer is gone")], (
        a.stderr[-3000:]
    )
    assert not [e for e in logged if "commit_failed" in str(e.get("event"))], a.stderr[-3000:]
    assert_bit_exact(gather(out, "resized", 1), ref_after(1), "restored after the interrupted commit")
    assert_bit_exact(gather(out, "final", 1), ref_after(4), "trained on alone")


def _parents(node_dir, rank: int) -> dict[int, int | None]:
    """Step -> parent step of this node's own manifests of ``rank`` (None: a base)."""
    out = {}
    for m in node_dir.glob(f"test/*/step-*/rank{rank}.json"):
        d = json.loads(m.read_text())
        out[d["step"]] = d["parent"][0] if d["parent"] else None
    return out


@pytest.mark.slow
def test_a_kill_at_every_point_of_compaction_restores_the_last_complete_commit(tmp_path):
    """Incremental commits by default, a fold point every second delta (``fold_max_deltas`` 2), which
    each holder folds into a base after it is complete (elastic_emb/state/compact.py). Two nodes,
    a replica each; each start SIGKILLs both ranks at one point, and the next start restores the
    newest complete commit bit for bit:

    - of the fold point's commit: data written, replica in flight, manifest missing, half done
      (rank 0 wrote its own manifest, rank 1 none): the commit does not exist, and its chain is
      as it was;
    - of the fold itself: the new base's data written (the delta's manifest still names its
      parent), the manifest swapped (the old delta file still there), and each node at a different
      one of those.

    Last, one node loses a delta of its own chain (the middle link): its rows come from the
    replica of that chain on the other node, bit for bit."""
    from tests.test_lifecycle import assert_bit_exact, gather, ok, reference

    out = tmp_path / "out"
    out.mkdir()
    ref = reference(32)  # every start is compared with the tables after the step it restored
    cfg = {"fold_max_deltas": 2, "fold_ratio": 1e6, "apply_in_place": False}  # (folding: not the default)
    nodes = {0: tmp_path / "nodes" / "A", 1: tmp_path / "nodes" / "B"}
    commit_kills = [
        {r: "snapshot_data_written" for r in (0, 1)},
        {r: "snapshot_replica_in_flight" for r in (0, 1)},
        {r: "snapshot_before_manifest" for r in (0, 1)},
        {0: "snapshot_manifest_partial", 1: "snapshot_before_manifest"},
    ]
    fold_kills = [
        {r: "fold_data_written" for r in (0, 1)},
        {r: "fold_manifest_swapped" for r in (0, 1)},
        {0: "fold_manifest_swapped", 1: "fold_data_written"},
    ]
    restored = -1
    for gen, kill in enumerate(commit_kills + fold_kills):  # each start restores what the kill left, trains on
        # A start's first commit is a base (at restored + 1); the fold point comes 2 deltas later.
        point = restored + 3
        extra = {r: {"ELASTIC_EMB_FAULT": f"{where}@{point}"} for r, where in kill.items()}
        folding = gen >= len(commit_kills)
        # A fold runs beside the next commits; the writer waits for it at the next fold point
        # (point + 2), so training that far makes sure it reached its kill point.
        results = _lifecycle_run(
            tmp_path, ["A", "B"], gen, out, point + 2 if folding else point, extra=extra, config=cfg
        )
        codes = [r.returncode for r in results]
        # Each rank is killed at its point, or fails on the peer that was (a collective in
        # progress). A fold is local, but it runs beside training: a rank whose peer died at its
        # own fold point may fail on the dead peer, and exit (cancelling its fold), before its
        # fold reaches the point. Which comes first is a race; both leave a restorable chain.
        assert -9 in codes and 0 not in codes, (kill, [(r.returncode, r.stderr[-1500:]) for r in results])
        if gen:
            assert_bit_exact(
                gather(out, "start", gen),
                ref[restored + 1],
                f"after the kill at {(commit_kills + fold_kills)[gen - 1]}",
            )
        for r, where in kill.items():
            parents = _parents(nodes[r], r)
            assert [parents.get(s, "absent") for s in (point - 1, point - 2)] == [point - 2, None], (kill, parents)
            [cdir] = [d for d in (nodes[r] / "test" / ("A", "B")[r]).glob(f"step-{point:012d}-*")] or [None]
            if folding and codes[r] != -9:  # failed on its dead peer first: its fold cancelled, or done
                assert parents[point] in (point - 1, None), (kill, codes, parents)
            elif where == "fold_data_written":  # the delta as it was, and an orphan the prune removes
                assert parents[point] == point - 1 and (cdir / f"rank{r}.base.bin").is_file(), (kill, parents)
            elif where == "fold_manifest_swapped":  # a base now; the delta's file is the orphan
                assert parents[point] is None and (cdir / f"rank{r}.bin").is_file(), (kill, parents)
            elif where == "snapshot_manifest_partial":  # rank 0's own manifest only: not a commit
                assert parents[point] == point - 1 and point not in _parents(nodes[1], 1)
            else:
                assert point not in parents, (kill, parents)
        if folding:  # restored next: the newest commit complete when the fold was killed
            values = ok(_lifecycle_run(tmp_path, ["A", "B"], 100 + gen, out, -1, config=cfg))
            assert len({v["start_step"] for v in values}) == 1 and values[0]["start_step"] >= point, values
            restored = values[0]["start_step"]
            assert_bit_exact(gather(out, "start", 100 + gen), ref[restored + 1], f"after the kill at {kill}")
        else:
            restored = point - 1
    # Restore the last one, train a chain (fold_max_deltas 3: a base, 2 deltas, no fold point), then drop
    # node B's own middle delta.
    cfg = {"fold_max_deltas": 3, "fold_ratio": 1e6, "apply_in_place": False}
    gen = len(commit_kills + fold_kills)
    last = restored + 3
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], gen, out, last, config=cfg))
    assert [v["start_step"] for v in values] == [restored] * 2
    assert_bit_exact(gather(out, "start", gen), ref[restored + 1], f"after the kill at {fold_kills[-1]}")
    assert [_parents(nodes[1], 1).get(s) for s in (last, last - 1, last - 2)] == [last - 1, last - 2, None]
    [middle] = (tmp_path / "nodes" / "B").glob(f"test/B/step-{last - 1:012d}-*/rank1.json")
    middle.unlink()
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], gen + 1, out, -1, config=cfg))
    assert [v["start_step"] for v in values] == [last, last]
    assert_bit_exact(gather(out, "start", gen + 1), ref[last + 1], "node B's delta from its replica on A")


@pytest.mark.slow
def test_async_commits_in_process_grow_waits_for_the_commit_in_flight(tmp_path):
    """2 -> 4 in the same processes: the old ranks' last commit is in flight when the resize
    starts; the rebuild waits for it, so the new world restores exactly the last step."""
    from tests.test_lifecycle import _in_process

    _in_process(tmp_path, ["A", "B"], ["A", "B", "C", "D"], {}, config={"async_commit": True})


@pytest.mark.slow
def test_incremental_commits_of_emb_context_restore_bit_for_bit(tmp_path):
    """EmbContext tracks its writes: with incremental commits (max_chain 2, not folding: bases and
    deltas alternate) two nodes train, restart and restore the last step bit for bit, then a node is
    lost and its rows come from the replicas of the chain."""
    import shutil

    from tests.test_lifecycle import assert_bit_exact, gather, ok, ref_after

    out = tmp_path / "out"
    out.mkdir()
    cfg = {"incremental": True, "max_chain": 2, "fold": False}
    ok(_lifecycle_run(tmp_path, ["A", "B"], 0, out, 4, config=cfg))
    deltas = [m for m in (tmp_path / "nodes").glob("*/test/*/step-*/rank*.json") if '"parent":[' in m.read_text()]
    assert deltas, "no delta commit was written"
    values = ok(_lifecycle_run(tmp_path, ["A", "B"], 1, out, 6, config=cfg))
    assert [v["start_step"] for v in values] == [4, 4]
    assert_bit_exact(gather(out, "start", 1), ref_after(4), "restored from a base and deltas")
    assert_bit_exact(gather(out, "phase1", 1), ref_after(6), "trained on")
    shutil.rmtree(tmp_path / "nodes" / "B")
    [v] = ok(_lifecycle_run(tmp_path, ["A"], 2, out, 7, config=cfg))
    assert v["start_step"] == 6
    assert_bit_exact(gather(out, "start", 2), ref_after(6), "node B lost: its chain from the replicas")


# -- checksums of GPU captures: chunks on several threads, joined --------------------------------------


def test_parallel_checksum_and_write_equal_zlib(tmp_path, monkeypatch):
    """The writer of GPU captures checksums and writes chunk by chunk on several threads: the
    joined CRC32 of every range equals zlib's of the range, padding between ranges is written
    too, and the file holds the buffer byte for byte (chunks made small so ranges span many)."""
    import os
    import zlib

    import numpy as np

    from elastic_emb.state import crc

    for la, lb in [(0, 5), (5, 0), (1, 1), (1000, 77777), (3, 1 << 20)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b), (la, lb)
    monkeypatch.setattr(crc, "CHUNK", 1000)
    buf = np.frombuffer(os.urandom(100_000), dtype=np.uint8)
    ranges = [(0, 8000), (8064, 50_000), (60_000, 0), (60_032, 39_968)]
    got = crc.write_and_checksum(tmp_path / "f.bin", buf, ranges, lambda p: open(p, "w+b"))
    assert got == [zlib.crc32(buf[o : o + n].tobytes()) for o, n in ranges]
    assert (tmp_path / "f.bin").read_bytes() == buf.tobytes()


def test_writer_checksums_of_landed_bytes_equal_zlib(monkeypatch):
    """The background writer checksums a GPU capture's bytes where they landed
    (``capture.finished_records`` -> ``crc.checksum_ranges``, chunks on 3 threads, joined): every
    tensor's CRC32 equals zlib's of that tensor's bytes, for sizes that are not multiples of the
    chunk or of the thread count, empty tensors, odd offsets and a range of exactly one chunk."""
    import os
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from elastic_emb.state import crc
    from elastic_emb.state.capture import PENDING_CRC, finished_records
    from elastic_emb.state.manifest import ShardRecord, TensorRecord

    pool = ThreadPoolExecutor(max_workers=3)
    monkeypatch.setattr(crc, "_pool", pool)
    monkeypatch.setattr(crc, "CHUNK", 1000)
    try:
        buf = np.frombuffer(os.urandom(40_000), dtype=np.uint8)
        ranges = [(0, 0), (1, 1), (3, 999), (1002, 1000), (2002, 1001), (3003, 3001), (6004, 0), (6005, 33_995)]
        assert crc.checksum_ranges(buf, ranges) == [zlib.crc32(buf[o : o + n].tobytes()) for o, n in ranges]
        records = [
            ShardRecord(
                table="t",
                num_rows=9,
                start=0,
                stop=9,
                tensors=[
                    TensorRecord(name=f"x{i}", dtype="uint8", row_shape=[], offset=o, nbytes=n, crc32=PENDING_CRC)
                    for i, (o, n) in enumerate(ranges[:4])
                ],
            ),
            ShardRecord(
                table="u",
                num_rows=9,
                start=0,
                stop=9,
                tensors=[
                    TensorRecord(name=f"y{i}", dtype="uint8", row_shape=[], offset=o, nbytes=n, crc32=PENDING_CRC)
                    for i, (o, n) in enumerate(ranges[4:])
                ],
            ),
        ]
        got = [tr.crc32 for rec in finished_records(records, buf) for tr in rec.tensors]
        assert got == [zlib.crc32(buf[o : o + n].tobytes()) for o, n in ranges]
        with pytest.raises(ValueError, match="outside the 40000-byte buffer"):
            crc.checksum_ranges(buf, [(39_999, 2)])
    finally:
        pool.shutdown()


def test_spare_files_are_allocated_ahead_taken_and_removed(tmp_path):
    """Data files for GPU captures are allocated ahead in a directory of the process's own: a
    wanted size gives files at least that large, a taken file leaves the pool, close removes
    the directory, and a dead process's directory is removed by the next one."""
    import subprocess
    import sys
    import time

    from elastic_emb.state.spares import SpareFiles, remove_dead_spares

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".spare-{int(dead.stdout)}"
    stale.mkdir()
    (stale / "spare0.bin").write_bytes(b"x")
    remove_dead_spares(tmp_path)
    assert not stale.exists()
    spares = SpareFiles(tmp_path / ".spare-1", 2, 0o600, 0o700)
    spares.want(100_000)
    deadline, got = time.monotonic() + 30, None
    while got is None and time.monotonic() < deadline:
        got = spares.take(100_000)
        time.sleep(0.01)
    assert got is not None and got.stat().st_size >= 100_000
    assert spares.take(10**9) is None, "no file that large was wanted"
    spares.close()
    assert not (tmp_path / ".spare-1").exists()


# -- lineage: two histories of one run are refused, not merged ------------------------------------


def test_a_start_from_the_seed_chooses_a_lineage_that_every_commit_records(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=3)
    report = restore(TinyContext(topo), comm, snapshot=tier, durable=None)
    assert report.step == -1 and len(report.lineage) == 32
    tier.lineage = report.lineage
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)
    _commit(tier, ctx, comm, 1, 2.0)
    assert {m.lineage for _, m in tier.manifests()} == {report.lineage}
    topo2, comm2 = world1()
    again = restore(TinyContext(topo2), comm2, snapshot=tier, durable=None)
    assert (again.step, again.lineage) == (1, report.lineage)


def test_two_histories_of_one_run_are_refused_naming_both_unless_starting_over(tmp_path, world1):
    from elastic_emb.state.lineage import new_lineage

    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=5)
    ctx = TinyContext(topo)
    old, new = new_lineage(), new_lineage()
    tier.lineage = old
    _commit(tier, ctx, comm, 3, 1.0)
    _commit(tier, ctx, comm, 4, 2.0)
    # the same run id started over from the seed beside it (a wiped store, an empty node) and trained on
    tier.break_chain()
    tier.lineage = new
    _commit(tier, ctx, comm, 7, 5.0)
    topo2, comm2 = world1()
    with pytest.raises(RestoreError) as info:
        restore(TinyContext(topo2), comm2, snapshot=tier, durable=None)
    msg = str(info.value)
    assert "\n" not in msg and "two histories" in msg
    assert f"step 7 (generation {topo.generation}, lineage {new[:8]}" in msg
    assert f"step 4 (generation {topo.generation}, lineage {old[:8]}" in msg and "start_fresh" in msg
    topo3, comm3 = world1()
    ctx3 = TinyContext(topo3)
    report = restore(ctx3, comm3, snapshot=tier, durable=None, start_fresh=True)
    assert (report.step, report.lineage) == (7, new) and torch.equal(ctx3.w, torch.full((40, 3), 5.0))


def test_commits_written_before_lineages_restore_and_get_one(tmp_path, world1):
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    ctx = TinyContext(topo)
    _commit(tier, ctx, comm, 0, 1.0)  # tier.lineage None: a manifest of an earlier version
    assert [m.lineage for _, m in tier.manifests()] == [None]
    topo2, comm2 = world1()
    report = restore(TinyContext(topo2), comm2, snapshot=tier, durable=None)
    assert report.step == 0 and len(report.lineage) == 32
