"""The checksum algorithms of a manifest's tensors (elastic_emb.state.digest): the parallel,
the streamed and the defining computation agree; records validate the algorithm and the value
(untrusted input); restore verifies an XXH3-64 record and refuses a flipped byte."""

from __future__ import annotations

import os
import random
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from elastic_emb.state import crc, digest
from elastic_emb.state.manifest import TensorRecord

xxhash = pytest.importorskip("xxhash")  # a dependency (pyproject): a venv made before it was added lacks it

RANGES = [(0, 0), (1, 1), (3, 999), (1002, 1000), (2002, 1001), (3003, 3001), (6004, 0), (6005, 33_995)]


def _by_definition(b: bytes, chunk: int) -> int:
    """XXH3-64 of the XXH3-64s of each ``chunk`` bytes, 8 bytes little-endian each."""
    return xxhash.xxh3_64_intdigest(
        b"".join(xxhash.xxh3_64_intdigest(b[i : i + chunk]).to_bytes(8, "little") for i in range(0, len(b), chunk))
    )


@pytest.fixture
def small_chunks(monkeypatch):
    pool = ThreadPoolExecutor(max_workers=3)
    monkeypatch.setattr(crc, "_pool", pool)
    monkeypatch.setattr(crc, "CHUNK", 1000)
    monkeypatch.setattr(digest, "TREE_CHUNK", 1000)
    yield
    pool.shutdown()


def test_parallel_streamed_and_defined_digests_agree(small_chunks):
    buf = np.frombuffer(os.urandom(40_000), dtype=np.uint8)
    rng = random.Random(7)
    for algorithm, define in (("crc32", lambda b: zlib.crc32(b)), ("xxh3_64", lambda b: _by_definition(b, 1000))):
        want = [define(buf[o : o + n].tobytes()) for o, n in RANGES]
        assert digest.digest_ranges(buf, RANGES, algorithm) == want, algorithm
        for (o, n), w in zip(RANGES, want):
            d = digest.Digest(algorithm)
            at = o
            while at < o + n:  # fed in uneven blocks, across chunk boundaries
                step = rng.randint(1, 2500)
                d.update(buf[at : min(at + step, o + n)])
                at += step
            assert d.value() == w, (algorithm, o, n)
    with pytest.raises(ValueError, match="outside the 40000-byte buffer"):
        digest.digest_ranges(buf, [(39_999, 2)], "xxh3_64")
    with pytest.raises(ValueError, match="not one of"):
        digest.Digest("md5")


def test_chunks_are_checksummed_as_the_copy_lands(small_chunks):
    """``landed`` (a delta's copy landing piece by piece): the buffer holds zeros until each
    piece's bytes are in, and the digests equal those of the whole buffer: no chunk was read
    before its piece had landed, and every piece was awaited (the generator ran to its end)."""
    src = np.frombuffer(os.urandom(40_000), dtype=np.uint8)
    for algorithm, define in (("crc32", lambda b: zlib.crc32(b)), ("xxh3_64", lambda b: _by_definition(b, 1000))):
        want = [define(src[o : o + n].tobytes()) for o, n in RANGES]
        buf, ended = np.zeros_like(src), []

        def landed(piece=3_333):
            for lo in range(0, src.size, piece):
                buf[lo : lo + piece] = src[lo : lo + piece]
                yield min(lo + piece, src.size)
            ended.append(True)

        assert digest.digest_ranges(buf, RANGES, algorithm, landed()) == want, algorithm
        assert ended == [True], algorithm


def test_records_validate_the_algorithm_and_the_value():
    base = dict(name="weight", dtype="float32", row_shape=[4], offset=0, nbytes=16)
    assert TensorRecord(**base, crc32=5).algorithm == "crc32", "a manifest without the field means CRC32"
    assert TensorRecord(**base, crc32=(1 << 64) - 1, algorithm="xxh3_64").crc32 == (1 << 64) - 1
    for bad in (
        dict(crc32=1 << 32),
        dict(crc32=1 << 64, algorithm="xxh3_64"),
        dict(crc32=-2),
        dict(crc32=1, algorithm="md5"),
    ):
        with pytest.raises(ValidationError):
            TensorRecord(**base, **bad)


def test_restore_verifies_an_xxh3_record(tmp_path, small_chunks):
    from elastic_emb.errors import ChecksumMismatch
    from elastic_emb.state.manifest import ShardRecord, SnapshotManifest
    from elastic_emb.state.shardfile import read_snapshot

    w = torch.arange(3000 * 4, dtype=torch.float32).reshape(3000, 4)  # 48000 bytes: many 1000-byte chunks
    raw = w.view(torch.uint8).reshape(-1).numpy()
    path = tmp_path / "rank0.bin"
    path.write_bytes(raw.tobytes())
    tr = TensorRecord(
        name="weight",
        dtype="float32",
        row_shape=[4],
        offset=0,
        nbytes=raw.size,
        crc32=_by_definition(raw.tobytes(), 1000),
        algorithm="xxh3_64",
    )
    m = SnapshotManifest(
        step=1,
        generation=0,
        fingerprint="f",
        run_id="r",
        world_size=1,
        written_at=0.0,
        ep_size=1,
        source_rank=0,
        source_node="n",
        holder_node="n",
        replica=False,
        data_file="rank0.bin",
        data_bytes=raw.size,
        shards=[ShardRecord(table="t", num_rows=3000, start=0, stop=3000, tensors=[tr])],
    )
    dst = torch.empty(10, 4)
    got = read_snapshot(path, m, fill={"t": [(5, 15, {"weight": dst})]})
    assert torch.equal(got["t"]["weight"], w) and torch.equal(dst, w[5:15])
    flipped = bytearray(raw.tobytes())
    flipped[47_001] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(ChecksumMismatch, match="XXH3-64"):
        read_snapshot(path, m)


def test_checksum_threads_run_below_the_callers_priority():
    """The checksum threads (elastic_emb.state.crc.pool) run at NICE above the process, so the
    training thread wins a core they also want; the calling thread keeps its own priority."""
    import os
    import threading

    from elastic_emb.state import crc

    tid = lambda: threading.get_native_id()  # noqa: E731
    mine = os.getpriority(os.PRIO_PROCESS, tid())
    theirs = crc.pool().submit(lambda: os.getpriority(os.PRIO_PROCESS, tid())).result()
    assert theirs == min(19, mine + crc.NICE), (mine, theirs)
    assert os.getpriority(os.PRIO_PROCESS, tid()) == mine
