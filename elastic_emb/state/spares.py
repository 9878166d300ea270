"""Data files allocated ahead of the GPU-captured commits that will fill them.

A fresh /dev/shm file gets its pages from the kernel at the first write: allocation and zeroing
inside the copy, which made the copy of a 0.5 GB delta into its file take about 110 ms on an H200
host (about 5 GB/s on 14 threads), while the same copy into pages already allocated takes about
30 ms (``bench/shm_landing.py``). :class:`SpareFiles` therefore keeps a few files allocated ahead
(``posix_fallocate``, one thread per file: separate files allocate in parallel, one file's
allocations do not), sized from the commits seen so far. The writer renames a spare into the
commit's directory, trims it to the commit's size, and copies into its pages. Spares live in the
node directory (so a rename moves no bytes) under a dot name that listings and restore never read;
they are bounded: ``count`` files of at most 1.0625 x the largest delta seen per process, removed
by ``close`` and, after a crash, by the next process of the node that allocates spares.
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elastic_emb.events import get_logger

log = get_logger("elastic_emb.state")


class SpareFiles:
    """Up to ``count`` allocated files in ``directory`` (owned by this process alone)."""

    def __init__(self, directory: Path, count: int, file_mode: int, dir_mode: int) -> None:
        self.dir = Path(directory)
        self.count = count
        self.file_mode = file_mode
        shutil.rmtree(self.dir, ignore_errors=True)  # a previous process of the same pid
        self.dir.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        self._ready: list[tuple[Path, int]] = []
        self._pending = 0
        self._size = 0
        self._serial = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="elastic_emb-spare")

    def want(self, nbytes: int) -> None:
        """A commit of ``nbytes`` was captured: keep ``count`` files of at least that ready."""
        stale = []
        with self._lock:
            size = nbytes + nbytes // 16
            if size > self._size:
                self._size = size
            if nbytes > min((s for _, s in self._ready), default=nbytes):  # too small from now on
                stale = [p for p, s in self._ready if s < self._size]
                self._ready = [(p, s) for p, s in self._ready if s >= self._size]
            missing = self.count - len(self._ready) - self._pending
            self._pending += max(0, missing)
            jobs = [(self._serial + i, self._size) for i in range(max(0, missing))]
            self._serial += len(jobs)
        for path in stale:
            path.unlink(missing_ok=True)
        for serial, size in jobs:
            self._pool.submit(self._allocate, serial, size)

    def _allocate(self, serial: int, size: int) -> None:
        path = self.dir / f"spare{serial}.bin"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, self.file_mode)
            try:
                # Not mapped here: mapping with MAP_POPULATE ahead made the writer's copies slower
                # on an H200 host (mmap/munmap of large mappings contend with the copy threads).
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            with self._lock:
                self._ready.append((path, size))
        except OSError as exc:  # no room: the writer falls back to a fresh file
            path.unlink(missing_ok=True)
            log.warning("spare_file_failed", path=str(path), bytes=size, error=str(exc))
        finally:
            with self._lock:
                self._pending -= 1

    def take(self, nbytes: int) -> Path | None:
        """A ready file of at least ``nbytes`` (the caller renames it away), or None."""
        with self._lock:
            for i, (path, size) in enumerate(self._ready):
                if size >= nbytes:
                    del self._ready[i]
                    return path
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def remove_dead_spares(node_dir: Path) -> None:
    """Remove the spare directories (``.spare-<pid>``) of processes of this node that are gone."""
    for d in Path(node_dir).glob(".spare-*"):
        pid = d.name.removeprefix(".spare-")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: left alone)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue
