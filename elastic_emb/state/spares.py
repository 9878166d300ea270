"""Data files allocated ahead of the GPU-captured commits that will fill them.

A fresh ``/dev/shm`` file gets its pages at the first write, inside the copy into it.
:class:`SpareFiles` keeps a few files allocated ahead (``posix_fallocate``, in parallel), sized
from the commits seen so far; the writer renames one into the commit's directory and copies into
its pages. Spares live under a dot directory of the node directory that listings never read, and
:func:`remove_dead_spares` removes those of processes that are gone.

Design: ``docs/COMMIT.md`` (section "Spare files").
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
    """Up to ``count`` allocated files in ``directory`` (owned by this process alone).

    Args:
        directory: the spares' directory; whatever is there is removed first.
        count: how many files to keep ready.
        file_mode: the files' permissions.
        dir_mode: the directory's permissions.
    """

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
        """A commit of ``nbytes`` was captured: keep ``count`` files of at least that ready.

        Files are sized 1/16 above the largest commit seen; ready files that became too small are
        removed, and the missing ones are allocated in the background.

        Args:
            nbytes: the captured commit's data size.
        """
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
                # Not mapped here: mapping with MAP_POPULATE ahead slows the writer's copies
                # (mmap/munmap of large mappings contend with the copy threads).
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
        """Take a ready file for a commit.

        Args:
            nbytes: the commit's data size.

        Returns:
            The path of a ready file of at least ``nbytes`` (the caller renames it away), or None.
        """
        with self._lock:
            for i, (path, size) in enumerate(self._ready):
                if size >= nbytes:
                    del self._ready[i]
                    return path
        return None

    def close(self) -> None:
        """Wait for the allocations under way, then remove the directory and every spare in it."""
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def remove_dead_spares(node_dir: Path) -> None:
    """Remove the spare directories (``.spare-<pid>``) of processes of this node that are gone.

    Args:
        node_dir: the node directory; directories of live processes (or of another user's) stay.
    """
    for d in Path(node_dir).glob(".spare-*"):
        pid = d.name.removeprefix(".spare-")
        if not (pid.isascii() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: left alone)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue
