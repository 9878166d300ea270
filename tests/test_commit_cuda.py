"""Delta commits captured on the GPU (elastic_emb.state.capture), checked bit for bit on one GPU.

EmbContext on CUDA (world size 1), a commit after every step through the device path: the
changed rows as the context recorded them (duplicates, skipped rows), the values a table's one
write computed or (a table written twice) a side-stream gather, an asynchronous copy to pinned memory, the background writer (checksums, file, manifest last), up
to three commits in flight while the next steps already write rows. Every commit the directory
keeps is materialised (its base and chain, in order) and compared with the shard as it was right
after its step (a device copy taken in stream order, so no host sync perturbs the overlap); then
a fresh context restores the newest commit through ``restore`` and matches the last step. The
lifecycle test does the same through ``Lifecycle.start`` / ``lc.commit`` with ``async_commit``.

On the GPU machine:  python -m pytest tests/test_commit_cuda.py -q
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TABLES = [TableSpec(name="a", num_rows=60_000, dim=32), TableSpec(name="b", num_rows=7_000, dim=8)]
OPT = OptimizerSpec(kind="adagrad", lr=0.5)
STEPS = 20
PIECE = 64 << 10  # the copies off the GPU in many pieces, alternating streams (capture._copy)


def _solo(port: int):
    from elastic_emb.context import EmbContext

    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    topo = Topology.build(
        run_id="cuda-commit",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="nccl",
        master_addr="127.0.0.1",
        master_port=port,
    )
    ctx = EmbContext(topo, store, tables=TABLES, optimizer=OPT, seed=3, nonfinite_gradients="skip")
    return topo, store, ctx


def _batch(gen: torch.Generator, step: int, spec: TableSpec, nan: bool = True):
    """Random ids with many duplicates (drawn from a part of the table), an empty batch now and
    then, and (``nan``) NaN gradients on a few ids (skipped rows: the delta lists them as no row)."""
    n = 0 if step % 7 == 3 else int(torch.randint(1, 20_000, (1,), generator=gen))
    hi = max(1, spec.num_rows // (1 + step % 3))
    ids = torch.randint(0, hi, (n,), generator=gen).cuda()
    grads = torch.randn(n, spec.dim, generator=gen).cuda()
    if nan and n and step % 4 == 1:
        grads[: min(5, n)] = float("nan")
    return ids, grads


def _state(shards) -> dict:
    return {name: [sd.weight.clone()] + [sd.slots[k].clone() for k in sorted(sd.slots)] for name, sd in shards.items()}


def _same(got: dict, want: dict) -> bool:
    return all(torch.equal(g.cpu(), w.cpu()) for name in want for g, w in zip(got[name], want[name]))


def _restore_matches(tier, comm, step: int, final: dict, what: str) -> None:
    """A fresh context restores the newest commit of ``tier`` (that of ``step``) through
    ``restore`` and holds ``final`` bit for bit; then ``comm`` (the writer's) is closed."""
    from elastic_emb.state import Comm, restore

    topo2, store2, fresh = _solo(free_port())
    try:
        comm2 = Comm(topo2, store2, None, timeout=60)
        assert restore(fresh, comm2, snapshot=tier, durable=None).step == step
        assert _same(_state(fresh.export_shard()), final), f"restore {what} differs"
        comm2.close()
    finally:
        fresh.close()
        comm.close()


def test_device_commits_every_step_restore_bit_for_bit(tmp_path):
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DeviceCapture
    from elastic_emb.state.delta import read_chain, resolve_chains
    from elastic_emb.state.shardfile import read_snapshot
    from elastic_emb.state.writer import CommitWriter

    port = free_port()
    topo, store, ctx = _solo(port)
    comm = Comm(topo, store, None, timeout=60)
    num_rows = {t.name: t.num_rows for t in TABLES}
    tier = SnapshotTier(tmp_path, "cuda-commit", "A", replication=0, keep=STEPS, max_chain=STEPS)
    # Not on /dev/shm: no ring can be registered there, so the deltas take the pinned-buffer path
    # (and a ring too small for a kept chain of STEPS would send them there as well).
    tier.enable_ring(2)
    tier.enable_spares(3)  # data files allocated ahead, as the lifecycle does
    device = DeviceCapture(ctx.device, buffers=3, timeout=60, piece_bytes=PIECE)
    writer = CommitWriter(tier, comm, timeout=60, depth=3)
    gen = torch.Generator().manual_seed(11)
    expect = {}
    try:
        ctx.take_changed_rows()  # start from here: the lazy seed fill counts as unchanged
        for step in range(STEPS):
            for spec in TABLES:
                # Table "a" written twice now and then: its delta is gathered from the table while
                # "b"'s is copied from the values its one write computed (RowsTaken.written)
                for _ in range(2 if spec.name == "a" and step % 5 == 2 else 1):
                    ids, grads = _batch(gen, step, spec)
                    ctx.apply_gradients(spec.name, ids, grads)
            views = ctx.shard_views()
            cap = tier.capture(
                step, views, topo, num_rows, ctx.take_changed_rows(unique=False), device=device, hold=ctx.hold_writes
            )
            assert (cap.parent is None) == (step == 0), f"step {step}: a base only first (parent {cap.parent})"
            expect[step] = _state(views)  # in stream order: after this step's writes, before the next's
            writer.submit(cap)
        assert writer.wait() == STEPS - 1
        chains, gaps = resolve_chains(tier.manifests())
        assert not gaps, gaps
        steps = sorted(chain[-1][1].step for chain in chains.values())
        assert steps == list(range(STEPS)), f"every commit is kept (keep={STEPS}): {steps}"
        for chain in chains.values():
            step = chain[-1][1].step
            got = read_chain(chain, read_snapshot)
            names = lambda n: ["weight"] + sorted(k for k in got[n] if k != "weight")  # noqa: E731
            assert _same({n: [got[n][k] for k in names(n)] for n in got}, expect[step]), (
                f"commit of step {step} differs from the rows right after its step"
            )
        final = _state(ctx.export_shard())
    finally:
        writer.close()
        tier.close_spares()
        ctx.close()
    assert not list(tier.node_dir.glob(".spare-*")), "close_spares removes the files allocated ahead"
    _restore_matches(tier, comm, STEPS - 1, final, "from the base and its chain")


@pytest.fixture
def shm_path():
    """A directory on /dev/shm: the log ring needs memory-backed files (the state dir's default)."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="ee-ring-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _materialise_all(tier, expect):
    """Every commit the directory lists, read through its base and chain (CRC32s checked), equals
    the shard right after its step. Returns the steps checked."""
    from elastic_emb.state.delta import read_chain, resolve_chains
    from elastic_emb.state.shardfile import read_snapshot

    chains, gaps = resolve_chains(tier.manifests())
    assert not gaps, gaps
    for chain in chains.values():
        step = chain[-1][1].step
        got = read_chain(chain, read_snapshot)
        names = lambda n: ["weight"] + sorted(k for k in got[n] if k != "weight")  # noqa: E731
        assert _same({n: [got[n][k] for k in names(n)] for n in got}, expect[step]), (
            f"commit of step {step} differs from the rows right after its step"
        )
    return sorted(chain[-1][1].step for chain in chains.values())


def test_log_ring_reuses_segments_and_every_kept_commit_restores(shm_path):
    """Deltas land in a ring of registered log segments (no file copy): a commit every step,
    bases every ``max_chain + 1``, pruning at ``keep=2``; segments are reused once their commits
    are pruned, never while a kept commit names them (every kept commit is re-read bit for bit
    along the way); a manifest whose range leaves its segment, or whose segment name leaves the
    log folder, is refused; close keeps exactly the segments that manifests name, and a fresh
    context restores the newest commit from them."""
    import json

    from elastic_emb.errors import ChecksumMismatch
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DeviceCapture
    from elastic_emb.state.ring import Segment
    from elastic_emb.state.shardfile import read_snapshot
    from elastic_emb.state.writer import CommitWriter

    steps, max_chain, keep, depth = 40, 4, 2, 3
    count = max_chain + depth + keep
    topo, store, ctx = _solo(free_port())
    comm = Comm(topo, store, None, timeout=60)
    num_rows = {t.name: t.num_rows for t in TABLES}
    tier = SnapshotTier(shm_path, "cuda-commit", "A", replication=0, keep=keep, max_chain=max_chain)
    tier.enable_ring(count, size=16 << 20)  # room for the largest delta of _batch (made and registered now)
    device = DeviceCapture(ctx.device, buffers=depth, timeout=60, piece_bytes=PIECE)
    writer = CommitWriter(tier, comm, timeout=60, depth=depth)
    gen = torch.Generator().manual_seed(17)
    expect, used, deltas, checked = {}, [], 0, set()
    try:
        ctx.take_changed_rows()
        for step in range(steps):
            for spec in TABLES:
                ctx.apply_gradients(spec.name, *_batch(gen, step, spec))
            views = ctx.shard_views()
            cap = tier.capture(
                step, views, topo, num_rows, ctx.take_changed_rows(unique=False), device=device, hold=ctx.hold_writes
            )
            if cap.parent is not None:
                deltas += 1
                assert isinstance(cap.buffer, Segment), f"step {step}: a delta with a free segment lands in the ring"
                used.append(cap.buffer.name)
            expect[step] = _state(views)
            writer.submit(cap)
            if step % 5 == 4:  # the kept commits, re-read while segments are being reused
                writer.wait()
                checked.update(_materialise_all(tier, expect))
        assert writer.wait() == steps - 1
        kept = _materialise_all(tier, expect)
        checked.update(kept)
        assert kept[-1] == steps - 1 and len(checked) >= 2 * steps // 5, (kept, sorted(checked))
        assert len(set(used)) <= count < deltas, f"{deltas} deltas went through {len(set(used))} of {count} segments"
        final = _state(ctx.export_shard())

        # Untrusted manifests: a range outside the segment, a segment name outside the log folder.
        path, m = next((p, m) for p, m in tier.manifests() if m.segment is not None)
        assert path.parent == tier.node_dir / "log" and path.stat().st_size >= m.data_bytes
        outside = m.model_copy(update={"segment_offset": path.stat().st_size - m.data_bytes + 64})
        with pytest.raises(ChecksumMismatch, match="outside the log segment"):
            read_snapshot(path, outside)
        flipped = m.model_copy(
            update={
                "shards": [
                    r.model_copy(update={"tensors": [t.model_copy(update={"crc32": t.crc32 ^ 1}) for t in r.tensors]})
                    for r in m.shards
                ]
            }
        )
        with pytest.raises(ChecksumMismatch):
            read_snapshot(path, flipped)
        mfile = next(
            f for f in tier.node_dir.glob("step-*/rank0.json") if json.loads(f.read_text()).get("segment") == m.segment
        )
        original = mfile.read_text()
        for bad in ("../../escape.bin", ".hidden"):
            mfile.write_text(json.dumps({**json.loads(original), "segment": bad}))
            assert all(x.segment != bad for _, x in tier.manifests()), f"segment {bad!r} must be refused"
        mfile.write_text(original)
    finally:
        writer.close()
        tier.close_spares()
        ctx.close()
    named = {m.segment for _, m in tier.manifests() if m.segment}
    left = {p.name for p in (tier.node_dir / "log").glob("seg-*.bin")}
    assert named and left == named, f"close keeps exactly the segments manifests name: {left} vs {named}"
    _restore_matches(tier, comm, steps - 1, final, "through the log segments")


def test_device_capture_takes_no_host_sync(shm_path):
    """The training thread's part of a device commit (take the rows, gather, hold, copy, submit)
    and the next step's update run under sync-debug "error": none of them waits for the GPU."""
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DeviceCapture
    from elastic_emb.state.writer import CommitWriter

    topo, store, ctx = _solo(free_port())
    comm = Comm(topo, store, None, timeout=60)
    tier = SnapshotTier(shm_path, "cuda-commit", "A", replication=0, keep=2, max_chain=100)
    tier.enable_ring(8, size=16 << 20)  # the copies land in the log ring (made and registered here)
    device = DeviceCapture(ctx.device, buffers=2, timeout=60, piece_bytes=PIECE)
    writer = CommitWriter(tier, comm, timeout=60, depth=2)
    num_rows = {t.name: t.num_rows for t in TABLES}
    gen = torch.Generator().manual_seed(5)
    try:
        batches = [[_batch(gen, s, spec) for spec in TABLES] for s in range(6)]
        for step in range(2):  # the base (a host copy) and one delta to warm the pinned buffers up
            for spec, (ids, grads) in zip(TABLES, batches[step]):
                ctx.apply_gradients(spec.name, ids, grads)
            writer.submit(
                tier.capture(
                    step,
                    ctx.shard_views(),
                    topo,
                    num_rows,
                    ctx.take_changed_rows(unique=False),
                    device=device,
                    hold=ctx.hold_writes,
                )
            )
        writer.wait()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(2, 6):
                for spec, (ids, grads) in zip(TABLES, batches[step]):
                    ctx.apply_gradients(spec.name, ids, grads)
                cap = tier.capture(
                    step,
                    ctx.shard_views(),
                    topo,
                    num_rows,
                    ctx.take_changed_rows(unique=False),
                    device=device,
                    hold=ctx.hold_writes,
                )
                writer.submit(cap)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert writer.wait() == 5
        assert len(list((tier.node_dir / "log").glob("seg-*.bin"))) == 8
    finally:
        writer.close()
        tier.close_spares()
        ctx.close()
        comm.close()


def test_lifecycle_async_commits_on_the_gpu_restore_bit_for_bit(shm_path):
    """``Lifecycle`` with ``async_commit`` on CUDA takes the device path: commit every step,
    ``committed_step`` trails by at most the commits in flight and reaches the last step after
    ``wait_commit``; a new lifecycle restores that step bit for bit."""
    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.context import EmbContext

    def factory(topology, store):
        return EmbContext(topology, store, tables=TABLES, optimizer=OPT, seed=3)

    def start():
        port = free_port()
        env = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "cuda-lc",
            "ELASTIC_EMB_BACKEND": "nccl",
        }
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
        cfg = LifecycleConfig(async_commit=True, max_chain=50, state_dir=str(shm_path), node_id="A")
        return Lifecycle.start(factory, cfg, env=env, store=store)

    gen = torch.Generator().manual_seed(2)
    lc = start()
    try:
        assert lc.step == -1
        for step in range(12):
            for spec in TABLES:
                lc.context.apply_gradients(spec.name, *_batch(gen, step, spec, nan=False))
            lc.commit(step)
            assert lc.committed_step <= step
        assert lc._committer._device is not None, "async_commit on CUDA must take the device path"
        assert lc.wait_commit() == 11 and lc.committed_step == 11
        final = _state(lc.context.export_shard())
    finally:
        lc.close()
    assert not list((shm_path / "cuda-lc" / "A").glob(".spare-*")), "close() removes the files allocated ahead"
    assert list((shm_path / "cuda-lc" / "A" / "log").glob("seg-*.bin")), "the lifecycle's deltas land in the log ring"
    lc2 = start()
    try:
        assert lc2.step == 11
        assert _same(_state(lc2.context.export_shard()), final), "restored rows differ from the last step's"
    finally:
        lc2.close()


def test_applying_in_place_on_the_gpu_path_never_captures_a_base_again(shm_path):
    """The default rule on the device path (``apply=True``): 60 commits, a base only first, then
    deltas that land in the log ring; the applier writes each into the base in place and its
    segment comes free once the prune after the mark deleted it, so a ring of ``keep +
    APPLY_PRUNE_EVERY + 2 + depth`` segments carries every delta. Every commit the directory
    keeps is re-read bit for bit along the way, and a fresh context restores the newest one."""
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DeviceCapture
    from elastic_emb.state.ring import Segment
    from elastic_emb.state.snapshot import APPLY_PRUNE_EVERY
    from elastic_emb.state.writer import CommitWriter

    steps, keep, depth = 60, 2, 3
    count = keep + APPLY_PRUNE_EVERY + 2 + depth
    topo, store, ctx = _solo(free_port())
    comm = Comm(topo, store, None, timeout=60)
    num_rows = {t.name: t.num_rows for t in TABLES}
    tier = SnapshotTier(shm_path, "cuda-commit", "A", replication=0, keep=keep, apply=True)
    tier.enable_ring(count, size=16 << 20)
    device = DeviceCapture(ctx.device, buffers=depth, timeout=60, piece_bytes=PIECE)
    writer = CommitWriter(tier, comm, timeout=60, depth=depth)
    gen = torch.Generator().manual_seed(29)
    expect, used, checked, pinned = {}, [], set(), 0
    try:
        ctx.take_changed_rows()
        for step in range(steps):
            for spec in TABLES:
                ctx.apply_gradients(spec.name, *_batch(gen, step, spec))
            views = ctx.shard_views()
            cap = tier.capture(
                step, views, topo, num_rows, ctx.take_changed_rows(unique=False), device=device, hold=ctx.hold_writes
            )
            assert (cap.parent is None) == (step == 0), f"step {step}: a base only first (parent {cap.parent})"
            if cap.parent is not None:
                if isinstance(cap.buffer, Segment):
                    used.append(cap.buffer.name)
                else:
                    pinned += 1  # (no segment free at that moment: the pinned path, never a wait)
            expect[step] = _state(views)
            writer.submit(cap)
            if step % 10 == 9:
                writer.wait()
                assert tier.applier.wait(60)  # (a chain is read while no apply runs, as restore does)
                checked.update(_materialise_all(tier, expect))
        assert writer.wait() == steps - 1 and tier.applier.wait(60)
        checked.update(_materialise_all(tier, expect))
        assert steps - 1 in checked
        bases = [m for _, m in tier.manifests() if m.parent is None]
        assert len(bases) == 1 and bases[0].applied is not None and bases[0].applied.step >= steps - 1 - keep - depth, (
            bases
        )
        assert len(set(used)) <= count and len(used) + pinned == steps - 1, (len(set(used)), count, pinned)
        final = _state(ctx.export_shard())
    finally:
        writer.close()
        tier.close_spares()
        ctx.close()
    _restore_matches(tier, comm, steps - 1, final, "from the base written in place and the deltas after its mark")
