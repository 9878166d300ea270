"""Small files an agent and its own workers share on their node, off the store's reach.

- :func:`write_replacing`: a new file renamed over the path (neither step follows a link);
- :func:`read_regular`: the first bytes of a regular file, or None (never blocks on a FIFO).

The drain's count (``drain_acks``) and the workers' progress (``watch/heartbeat.py``, read by the
agent's watchdog ``rdzv/hang.py``) use them.
"""

from __future__ import annotations

import os
import stat

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_replacing(path: str, data: bytes) -> None:
    """Write ``data`` to a new file and rename it over ``path`` (a reader sees old or new, whole).

    Args:
        path: the file.
        data: its new content.

    Raises:
        OSError: when the file cannot be written.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:  # left by a process of this pid that died between open and rename
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_regular(path: str, limit: int = 256) -> tuple[bytes, os.stat_result] | None:
    """The first ``limit`` bytes of ``path`` and its status, when it is a regular file.

    Args:
        path: the file.
        limit: the most bytes read.

    Returns:
        ``(bytes, stat)``, or None when it is missing, a link, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return os.read(fd, limit), st
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Remove ``path`` if it exists.

    Args:
        path: the file.
    """
    try:
        os.unlink(path)
    except OSError:
        pass
