"""A ring of node-local log segments that the GPU's copy engine writes deltas into.

A GPU-captured delta (:mod:`elastic_emb.state.capture`) used to land in a pinned buffer that the
writer then copied into a /dev/shm file: about 58 ms per 0.5 GB delta on an H200 host, the bound
of the whole commit path. :class:`SegmentRing` removes that copy: ``count`` files in the node
directory's ``log/`` folder, each ``size`` bytes, allocated (``posix_fallocate``), mapped and
``cudaHostRegister``-ed ONCE (registration costs about 0.3 s per 0.5 GB, so never per commit) and
reused across commits. The device-to-host copy of a delta goes straight into a free segment (it
starts at offset 0; one delta per segment); the writer waits for the copy's event, finishes the
checksums and writes the manifest, which names the segment, the offset and the length (and the
CRC32 of every tensor, as for any commit). No byte is copied on the host.

When a segment may be reused: a segment is "in flight" from its capture until its commit is
written (or dropped), then "held" by its manifest until that manifest is gone, i.e. until
:meth:`SnapshotTier.prune` deleted the commit directory, which it does only for commits no kept
commit needs (the newest ``keep`` complete ones and their chains back to a base, and anything
newer). Restore reads only commits whose manifests exist, so a segment is never rewritten under
a commit that restore, a replica or a chain could still read. When no segment is free, or a delta
is larger than a segment, the capture takes the pinned-buffer path instead (never a wait).

Shared-memory bound: the ring is ``count x size`` bytes, fixed once created (the lifecycle sizes
``size`` at 1.25 x its first GPU delta, ``count`` = ``min(max_chain, 8) + 3 + keep``), plus what
the commits that fell back to files hold. Segments of a process that has exited stay while a
manifest names them (restore after a worker restart reads them); the next prune on the node
removes the unreferenced ones of rings whose owner is gone (each ring holds an ``flock`` on its
lock file while its process lives, so a reused pid is never mistaken for the owner).

Everything a manifest says about a segment is checked on read: the name must be a plain name
(it resolves inside ``<node dir>/log``), ``offset + length`` must lie within the file, and every
tensor's CRC32 is verified (:func:`~elastic_emb.state.shardfile.read_snapshot`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import threading
from pathlib import Path

import torch

from elastic_emb.events import get_logger
from elastic_emb.state.paths import check_name

log = get_logger("elastic_emb.state")

LOG_DIR = "log"  # under the node directory
SEGMENT_ALIGN = 2 << 20


class Segment:
    """One log segment: a file, its shared mapping, and who holds it."""

    def __init__(self, ring: "SegmentRing", name: str, path: Path, size: int, mm: mmap.mmap) -> None:
        self.ring = ring
        self.name = name
        self.path = path
        self.size = size
        self.mm = mm
        self.host = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.state = "free"  # "flight": a capture is landing here; "held": a manifest names it
        self.manifest: Path | None = None

    def release(self) -> None:
        self.ring.release(self)


class SegmentRing:
    """``count`` registered segments of ``size`` bytes in ``directory`` (this process's own)."""

    def __init__(self, directory: Path, count: int, size: int, file_mode: int, register: bool = True) -> None:
        if count < 1 or size < 1:
            raise ValueError(f"a log ring needs count >= 1 and size >= 1, got count={count} size={size}")
        self.dir = Path(directory)
        self.size = -(-size // SEGMENT_ALIGN) * SEGMENT_ALIGN
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock_fd = os.open(self.dir / f"ring-{self.token}.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, file_mode)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held while this process lives: see sweep_segments
        self._registered: list[int] = []
        self._cudart = torch.cuda.cudart() if register else None
        self._cv = threading.Condition()
        self.segments: list[Segment] = []
        self._next = 0  # acquire looks from here: the segment after the one taken last
        try:
            for i in range(count):
                name = f"seg-{self.token}-{i}.bin"
                path = self.dir / name
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, file_mode)
                try:
                    os.posix_fallocate(fd, 0, self.size)  # the pages now, not inside the copies
                    mm = mmap.mmap(fd, self.size)
                finally:
                    os.close(fd)
                seg = Segment(self, name, path, self.size, mm)
                self.segments.append(seg)
                if self._cudart is not None:
                    err = int(self._cudart.cudaHostRegister(seg.host.data_ptr(), self.size, 0))
                    if err != 0:
                        _clear_cuda_error()  # else torch's next CUDA call reports it as its own
                        raise RuntimeError(f"cudaHostRegister of log segment {path} ({self.size} bytes) failed with "
                                           f"CUDA error {err}: lower the ring size or raise the locked-memory limit")
                    self._registered.append(seg.host.data_ptr())
        except BaseException:
            self.close()
            raise
        log.info("log_ring_ready", dir=str(self.dir), segments=count, segment_bytes=self.size)

    def acquire(self, nbytes: int) -> Segment | None:
        """A free segment for a delta of ``nbytes`` (now "in flight"), or None: the delta is
        larger than a segment, or every segment is in flight or named by a manifest."""
        if nbytes > self.size:
            return None
        with self._cv:  # a free one first: checking whether held ones were pruned costs a stat each
            # From the one after the last taken: the oldest first, whose commit is the likeliest
            # pruned (one stat, not one per segment, on the training thread)
            order = self.segments[self._next:] + self.segments[:self._next]
            for seg in order:
                if seg.state == "free":
                    return self._take(seg)
            for seg in order:
                if seg.state == "held" and (seg.manifest is None or not seg.manifest.exists()):
                    return self._take(seg)  # its commit was pruned
        return None

    def _take(self, seg: Segment) -> Segment:
        seg.state, seg.manifest = "flight", None
        self._next = (self.segments.index(seg) + 1) % len(self.segments)
        return seg

    def landed(self, seg: Segment, manifest: Path) -> None:
        """The commit in ``seg`` is written: held until ``manifest`` is gone."""
        with self._cv:
            seg.state, seg.manifest = "held", manifest

    def release(self, seg: Segment) -> None:
        """The capture in ``seg`` is written or dropped: a dropped one frees the segment."""
        with self._cv:
            if seg.state == "flight":
                seg.state, seg.manifest = "free", None

    def in_use(self) -> int:
        with self._cv:
            return sum(s.state == "flight" or (s.state == "held" and s.manifest is not None and s.manifest.exists())
                       for s in self.segments)

    def close(self) -> None:
        """Unregister and unmap; remove the segments no manifest names (the others stay for
        restore, removed by a later prune once unreferenced), then release the lock."""
        for ptr in self._registered:
            self._cudart.cudaHostUnregister(ptr)
        self._registered = []
        for seg in self.segments:
            keep = seg.state == "held" and seg.manifest is not None and seg.manifest.exists()
            seg.host = None
            try:
                seg.mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            if not keep:
                seg.path.unlink(missing_ok=True)
        self.segments = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
            if not any(self.dir.glob(f"seg-{self.token}-*.bin")):
                (self.dir / f"ring-{self.token}.lock").unlink(missing_ok=True)


def newest_per_segment(manifests: list) -> list:
    """``(path, manifest)`` pairs less those naming a segment a newer commit's manifest names too:
    a segment holds one commit at a time, so one of them is damaged or foreign; only the newest is
    read (and its CRC32s decide)."""
    newest: dict[str, int] = {}
    for i, (_, m) in enumerate(manifests):
        if m.segment is not None and (m.segment not in newest or manifests[newest[m.segment]][1].commit < m.commit):
            newest[m.segment] = i
    out = []
    for i, (path, m) in enumerate(manifests):
        if m.segment is not None and newest[m.segment] != i:
            log.warning("snapshot_manifest_invalid", path=str(path), error=f"log segment {m.segment!r} is named by "
                        f"a newer commit too; this one is not read")
            continue
        out.append((path, m))
    return out


def on_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on tmpfs (or hugetlbfs/ramfs): only such file pages can be
    registered with CUDA for long (Linux refuses long-term pins of pages of disk filesystems)."""
    target, best, fstype = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0]
    except (OSError, IndexError):
        return False
    return fstype in ("tmpfs", "hugetlbfs", "ramfs")


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed ``cudaHostRegister`` (torch's bindings
    return the error but leave it set, and torch's next check would raise it)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libcudart" in line and line.rstrip().endswith(tuple("0123456789o"))}
    for lib in sorted(libs):
        try:
            ctypes.CDLL(lib).cudaGetLastError()
        except OSError:
            continue


def segment_path(node_dir: Path, name: str) -> Path:
    """Where the segment a manifest names lies: always inside ``<node dir>/log`` (ValueError else)."""
    return Path(node_dir) / LOG_DIR / check_name(name, "log segment")


def sweep_segments(node_dir: Path, referenced: set[str]) -> list[str]:
    """Remove the segments of rings whose process is gone (their lock is free) that no manifest
    in ``referenced`` names; a ring's lock file goes with its last segment. Returns the names."""
    d = Path(node_dir) / LOG_DIR
    removed = []
    for lock in sorted(d.glob("ring-*.lock")):
        token = lock.name[len("ring-"): -len(".lock")]
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process is alive
            left = 0
            for seg in d.glob(f"seg-{token}-*.bin"):
                if seg.name in referenced:
                    left += 1
                    continue
                seg.unlink(missing_ok=True)
                removed.append(seg.name)
            if not left:
                lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    if removed:
        log.info("log_segments_removed", segments=removed)
    return removed
