"""The log ring's bookkeeping and its untrusted manifests, on the CPU (elastic_emb.state.ring).

The copy engine's part (a registered ring on CUDA) is in tests/test_commit_cuda.py; here the
same segments are unregistered files: a segment is reused only once no manifest names it, a
commit in a segment reads back through ``SnapshotTier.manifests`` and ``read_snapshot`` with
its CRC32s, a manifest whose range leaves its segment or whose segment name leaves the log
folder is refused, and the segments of a process that exited are removed by the next sweep
unless a manifest names them.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from elastic_emb.errors import ChecksumMismatch
from elastic_emb.protocol import ShardData
from elastic_emb.state import SnapshotTier
from elastic_emb.state.manifest import SnapshotManifest, commit_dirname, write_atomic
from elastic_emb.state.ring import LOG_DIR, SegmentRing, sweep_segments
from elastic_emb.state.shardfile import pack_shard, read_snapshot


def _landed_commit(tier: SnapshotTier, ring: SegmentRing, step: int, value: float):
    """A commit whose data lies in a segment of ``ring``, its manifest written last."""
    w = torch.full((40, 3), value)
    acc = torch.full((40,), value + 0.5)
    records, blob = pack_shard({"t": ShardData("t", range(0, 40), w, {"acc": acc})}, {"t": 40})
    seg = ring.acquire(blob.numel())
    assert seg is not None
    seg.host[: blob.numel()].copy_(blob)
    cdir = tier.node_dir / commit_dirname(step, "f" * 16)
    cdir.mkdir(parents=True)
    m = SnapshotManifest(
        step=step,
        generation=0,
        fingerprint="f" * 16,
        run_id="unit",
        world_size=1,
        ep_size=1,
        source_rank=0,
        source_node="nodeA",
        holder_node="nodeA",
        replica=False,
        data_file="rank0.bin",
        data_bytes=int(blob.numel()),
        shards=records,
        written_at=time.time(),
        segment=seg.name,
    )
    write_atomic(cdir / "rank0.json", m.model_dump_json())
    ring.landed(seg, cdir / "rank0.json")
    seg.release()  # what the writer does after the write: a landed segment stays held
    return seg, cdir


def test_segments_are_reused_only_once_no_manifest_names_them(tmp_path):
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    (tier.node_dir / LOG_DIR).mkdir(parents=True)
    ring = SegmentRing(tier.node_dir / LOG_DIR, 2, 4096, 0o600, register=False)
    try:
        a, adir = _landed_commit(tier, ring, 0, 1.0)
        b, _ = _landed_commit(tier, ring, 1, 2.0)
        assert ring.acquire(1) is None, "both segments are named by manifests: none is free"
        assert ring.acquire(ring.size + 1) is None, "a delta larger than a segment never lands in the ring"
        got = {m.step: read_snapshot(p, m) for p, m in tier.manifests()}
        assert [p.parent for p, _ in tier.manifests()] == [tier.node_dir / LOG_DIR] * 2
        assert torch.equal(got[0]["t"]["weight"], torch.full((40, 3), 1.0))
        assert torch.equal(got[1]["t"]["acc"], torch.full((40,), 2.5))
        for f in adir.iterdir():  # what prune does to a commit no kept commit needs
            f.unlink()
        adir.rmdir()
        again = ring.acquire(1)
        assert again is a, "the segment of the pruned commit is the one reused"
        again.release()  # dropped before its manifest: free at once
        assert ring.acquire(1) is a
    finally:
        ring.close()
    left = sorted(p.name for p in (tier.node_dir / LOG_DIR).glob("seg-*.bin"))
    assert left == [b.name], f"close keeps exactly the segments manifests name: {left}"


def test_untrusted_manifests_of_segments_are_refused(tmp_path):
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0)
    (tier.node_dir / LOG_DIR).mkdir(parents=True)
    ring = SegmentRing(tier.node_dir / LOG_DIR, 1, 4096, 0o600, register=False)
    try:
        seg, cdir = _landed_commit(tier, ring, 0, 3.0)
        [(path, m)] = tier.manifests()
        size = path.stat().st_size
        for bad in ({"segment_offset": size - m.data_bytes + 8}, {"data_bytes": size + 1}, {"data_bytes": -1}):
            with pytest.raises(ChecksumMismatch, match="outside the log segment"):
                read_snapshot(path, m.model_copy(update=bad))
        seg.host[5] ^= 0xFF  # a flipped byte in the segment: its CRC32 says so
        with pytest.raises(ChecksumMismatch, match="CRC32"):
            read_snapshot(path, m)
        seg.host[5] ^= 0xFF
        original = (cdir / "rank0.json").read_text()
        for name in ("../../../escape.bin", ".hidden", "a/b"):
            (cdir / "rank0.json").write_text(original.replace(seg.name, name))
            assert tier.manifests() == [], f"segment name {name!r} must be refused"
        (cdir / "rank0.json").write_text(original)
        # A second manifest naming the same segment: only the newest commit's is read.
        other = cdir.with_name(commit_dirname(1, "f" * 16))
        other.mkdir()
        (other / "rank0.json").write_text(original.replace('"step":0', '"step":1'))
        assert [m.step for _, m in tier.manifests()] == [1]
    finally:
        ring.close()


@pytest.mark.slow
def test_sweep_removes_the_unnamed_segments_of_an_exited_process(tmp_path):
    log_dir = tmp_path / LOG_DIR
    log_dir.mkdir()
    code = (
        "import sys; from pathlib import Path; from elastic_emb.state.ring import SegmentRing; "
        "r = SegmentRing(Path(sys.argv[1]), 3, 4096, 0o600, register=False); "
        "print(' '.join(s.name for s in r.segments))"
    )  # exits without close: as a crash does
    names = subprocess.run(
        [sys.executable, "-c", code, str(log_dir)], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert len(names) == 3
    mine = SegmentRing(log_dir, 1, 4096, 0o600, register=False)  # alive: never swept
    try:
        removed = sweep_segments(tmp_path, referenced={names[1]})
        assert sorted(removed) == sorted([names[0], names[2]])
        left = sorted(p.name for p in log_dir.glob("seg-*.bin"))
        assert left == sorted([names[1], mine.segments[0].name])
        assert sweep_segments(tmp_path, referenced=set()) == [names[1]], "once unnamed, it goes too"
        assert [p.name for p in log_dir.glob("ring-*.lock")] == [f"ring-{mine.token}.lock"]
    finally:
        mine.close()
