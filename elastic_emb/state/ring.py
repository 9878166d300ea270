"""A ring of node-local log segments that the GPU's copy engine writes deltas into.

:class:`SegmentRing` holds ``count`` shared-memory files in the node directory's ``log/`` folder,
allocated, mapped and registered with CUDA once and reused across commits: a delta is copied
straight into a free :class:`Segment`, and its manifest names the segment, so no byte is copied
on the host. A segment is reused only once no manifest names it; :func:`sweep_segments` removes
the unreferenced segments of processes that are gone.

Design: ``docs/COMMIT.md`` (section "The log ring").
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
    """One log segment: a file, its shared mapping, and who holds it.

    Args:
        ring: the ring it belongs to.
        name: the file's name (what a manifest records).
        path: the file.
        size: its size in bytes.
        mm: its shared mapping (``host`` is a uint8 tensor over it).
    """

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
        """The capture in this segment is written or dropped (see :meth:`SegmentRing.release`)."""
        self.ring.release(self)


class SegmentRing:
    """``count`` registered segments of ``size`` bytes in ``directory`` (this process's own).

    Holds an ``flock`` on its lock file while the process lives, so that :func:`sweep_segments`
    never removes the segments of a live ring.

    Args:
        directory: the node directory's ``log/`` folder.
        count: the number of segments.
        size: bytes per segment (rounded up to :data:`SEGMENT_ALIGN`).
        file_mode: the files' permissions.
        register: register the mappings with CUDA (``cudaHostRegister``).

    Raises:
        ValueError: if ``count`` or ``size`` is below 1.
        RuntimeError: if registering a segment with CUDA fails (e.g. the locked-memory limit).
        OSError: if a file cannot be created or allocated.
    """

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
                        raise RuntimeError(
                            f"cudaHostRegister of log segment {path} ({self.size} bytes) failed with "
                            f"CUDA error {err}: lower the ring size or raise the locked-memory limit"
                        )
                    self._registered.append(seg.host.data_ptr())
        except BaseException:
            self.close()
            raise
        log.info("log_ring_ready", dir=str(self.dir), segments=count, segment_bytes=self.size)

    def acquire(self, nbytes: int) -> Segment | None:
        """Take a free segment for a delta (it is then "in flight").

        Args:
            nbytes: the delta's size.

        Returns:
            The segment, or None: the delta is larger than a segment, or every segment is in
            flight or named by a manifest that still exists.
        """
        if nbytes > self.size:
            return None
        with self._cv:  # a free one first: checking whether held ones were pruned costs a stat each
            # From the one after the last taken: the oldest first, whose commit is the likeliest
            # pruned (one stat, not one per segment, on the training thread)
            order = self.segments[self._next :] + self.segments[: self._next]
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
        """The commit in ``seg`` is written: the segment is held until ``manifest`` is gone.

        Args:
            seg: the segment.
            manifest: the manifest that names it.
        """
        with self._cv:
            seg.state, seg.manifest = "held", manifest

    def release(self, seg: Segment) -> None:
        """The capture in ``seg`` is written or dropped: a dropped one (still in flight) frees it.

        Args:
            seg: the segment.
        """
        with self._cv:
            if seg.state == "flight":
                seg.state, seg.manifest = "free", None

    def in_use(self) -> int:
        """How many segments are taken.

        Returns:
            The segments in flight or named by a manifest that still exists.
        """
        with self._cv:
            return sum(
                s.state == "flight" or (s.state == "held" and s.manifest is not None and s.manifest.exists())
                for s in self.segments
            )

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
    """Drop the manifests that name a segment a newer commit's manifest names too.

    A segment holds one commit at a time, so one of them is damaged or foreign: only the newest is
    read (and its checksums decide); the others are reported.

    Args:
        manifests: ``(path, manifest)`` pairs.

    Returns:
        The pairs kept, in their order.
    """
    newest: dict[str, int] = {}
    for i, (_, m) in enumerate(manifests):
        if m.segment is not None and (m.segment not in newest or manifests[newest[m.segment]][1].commit < m.commit):
            newest[m.segment] = i
    out = []
    for i, (path, m) in enumerate(manifests):
        if m.segment is not None and newest[m.segment] != i:
            log.warning(
                "snapshot_manifest_invalid",
                path=str(path),
                error=f"log segment {m.segment!r} is named by a newer commit too; this one is not read",
            )
            continue
        out.append((path, m))
    return out


def on_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on tmpfs, hugetlbfs or ramfs.

    Only such file pages can stay registered with CUDA (Linux refuses long-term pins of pages of
    disk filesystems).

    Args:
        path: a path (symlinks resolved).

    Returns:
        True on a memory-backed filesystem; False otherwise or when the mounts cannot be read.
    """
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
    """Where the segment a manifest names lies: always inside ``<node dir>/log``.

    Args:
        node_dir: the node directory.
        name: the segment name from a manifest (untrusted).

    Returns:
        The segment's path.

    Raises:
        ValueError: if ``name`` is not a plain name (via :func:`~elastic_emb.state.paths.check_name`).
    """
    return Path(node_dir) / LOG_DIR / check_name(name, "log segment")


def sweep_segments(node_dir: Path, referenced: set[str]) -> list[str]:
    """Remove the segments of rings whose process is gone that no manifest names.

    A ring's process is gone when its lock file's ``flock`` is free; its lock file goes with its
    last segment.

    Args:
        node_dir: the node directory.
        referenced: the segment names the node's manifests name.

    Returns:
        The names of the segments removed.
    """
    d = Path(node_dir) / LOG_DIR
    removed = []
    for lock in sorted(d.glob("ring-*.lock")):
        token = lock.name[len("ring-") : -len(".lock")]
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
