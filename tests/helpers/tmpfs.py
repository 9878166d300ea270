"""A small tmpfs a test mounts to fill, free or remount read-only (needs root; skips otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount's syntax: ``256k``, ``4m``) on ``mnt``, unmounted at exit.

    Skips the test where it cannot mount (not root, or a container without CAP_SYS_ADMIN)."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); this test fills and remounts one")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


def fill(path: Path, *, most: int) -> int:
    """Write zeros to ``path`` until its filesystem is full (at most ``most`` bytes). Returns the
    bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while written < most:
            written += os.write(fd, b"\0" * min(4096, most - written))
    except OSError:
        pass
    finally:
        os.close(fd)
    return written
