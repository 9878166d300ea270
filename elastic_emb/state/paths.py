"""Where the state tiers put files: names, the directory layout under each root, file modes.

Snapshots live under ``<state_dir>/<run_id>/<node_id>/``, durable checkpoints under
``<durable_dir>/<run_id>/``. Run and node ids are untrusted: :func:`check_name` accepts plain
names only and :func:`under` keeps every path inside its root. :func:`node_id_from_env` gives the
node id that survives restarts; files are owner-only by default (:data:`FILE_MODE`,
:data:`DIR_MODE`).

Design: ``docs/COMMIT.md`` (section "Names and directories").
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

from elastic_emb import config
from elastic_emb.topology import SAFE_NAME

FILE_MODE = 0o600
DIR_MODE = 0o700
_SAFE = re.compile(SAFE_NAME)


def check_name(value: str, what: str) -> str:
    """Check that ``value`` is a safe path component.

    Args:
        value: the name to check (a run id, a node id, a file name).
        what: what the name is, for the error message.

    Returns:
        ``value`` unchanged.

    Raises:
        ValueError: if ``value`` is not a string of 1-128 letters, digits, ``_``, ``-`` or ``.``
            that does not start with a dot.
    """
    if not isinstance(value, str) or not _SAFE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a plain name: use 1-128 letters, digits, '_', '-' or '.', "
            f"not starting with '.' (it becomes a directory name under the state root)"
        )
    return value


def node_id_from_env(env: Mapping[str, str] | None = None) -> str:
    """This node's stable identity: ``ELASTIC_EMB_NODE_ID``, else the host name.

    Args:
        env: the environment to read (None: the process's).

    Returns:
        The node id, checked by :func:`check_name` (which raises ValueError for an unsafe one).
    """
    nid = config.load(env, "node_id").node_id or socket.gethostname()
    return check_name(nid, "node id (ELASTIC_EMB_NODE_ID or the host name)")


def under(root: str | os.PathLike, *names: str) -> Path:
    """The path ``root/names...``, checked to lie strictly inside ``root``.

    Args:
        root: the tier's root directory.
        *names: path components below it, each checked by :func:`check_name`.

    Returns:
        The resolved path (a symlink planted in the tree cannot lead out of the root).

    Raises:
        ValueError: if a name is unsafe, or the resolved path is the root itself or outside it.
    """
    base = Path(root).resolve()
    for n in names:
        check_name(n, "path component")
    path = base.joinpath(*names).resolve()
    if path == base or base not in path.parents:
        raise ValueError(f"state path {path} is not inside its root {base}; refusing to write there")
    return path


def make_dirs(root: str | os.PathLike, path: Path, mode: int = DIR_MODE) -> None:
    """Create ``path`` and its missing parents below ``root`` with ``mode``.

    The root itself is created with ``mode`` too when missing, its own missing parents with the
    defaults; existing directories keep their modes.

    Args:
        root: the tier's root directory.
        path: the directory to create, at or below ``root``.
        mode: the permissions of every directory created at or below the root.
    """
    root = Path(root).resolve()
    root.parent.mkdir(parents=True, exist_ok=True)  # above the root: the user's directories, their modes
    chain = [p for p in reversed(path.parents) if root in p.parents or p == root] + [path]
    for d in chain:
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)  # mkdir's mode is masked by the umask


def open_new(path: Path, mode: int = FILE_MODE, readable: bool = False):
    """Open ``path`` for writing, created or truncated, with permissions ``mode``.

    Args:
        path: the file.
        mode: its permissions, set even when the file existed or the umask would mask them.
        readable: open it for reading too (a shared mapping of it needs both).

    Returns:
        A binary file object (``"r+b"`` or ``"wb"``).
    """
    fd = os.open(path, (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)  # an existing file keeps its old mode otherwise; the umask may mask it
    return os.fdopen(fd, "r+b" if readable else "wb")
