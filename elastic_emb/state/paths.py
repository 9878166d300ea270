"""Where the state tiers put files: names, the directory layout under each root, file modes.

Snapshots live under ``<state_dir>/<run_id>/<node_id>/`` and durable checkpoints under
``<durable_dir>/<run_id>/``. The run id comes from the rendezvous (``--rdzv-id``) and the node id
from the environment, so both are untrusted: they must be plain names (:data:`SAFE_NAME`: letters,
digits, ``_ - .``, not starting with a dot, at most 128 characters), and every path built from
them is resolved and checked to lie under its root (:func:`under`), so no id can make a tier write
outside its root or make the root itself the run directory.

The node id must be stable across restarts (torchrun renumbers node ranks), so it is
``ELASTIC_EMB_NODE_ID`` if set, else the host name.

Files the tiers write are owner-only by default (:data:`FILE_MODE` 0600, :data:`DIR_MODE` 0700):
the rows of a model are its owner's data, not the host's.
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
    """``value`` if it is a safe path component, else ValueError naming it and the rule."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a plain name: use 1-128 letters, digits, '_', '-' or '.', "
                         f"not starting with '.' (it becomes a directory name under the state root)")
    return value


def node_id_from_env(env: Mapping[str, str] | None = None) -> str:
    """This node's stable identity: ELASTIC_EMB_NODE_ID, else the host name (checked)."""
    nid = config.load(env, "node_id").node_id or socket.gethostname()
    return check_name(nid, "node id (ELASTIC_EMB_NODE_ID or the host name)")


def under(root: str | os.PathLike, *names: str) -> Path:
    """``root/names...`` after checking each name and that the resolved path lies inside the
    resolved root (a symlink planted in the tree cannot lead out of it)."""
    base = Path(root).resolve()
    for n in names:
        check_name(n, "path component")
    path = base.joinpath(*names).resolve()
    if path == base or base not in path.parents:
        raise ValueError(f"state path {path} is not inside its root {base}; refusing to write there")
    return path


def make_dirs(root: str | os.PathLike, path: Path, mode: int = DIR_MODE) -> None:
    """Create ``path`` and its missing parents below ``root`` with ``mode`` (the root itself is
    created with ``mode`` too when missing, its missing parents with the defaults; existing
    directories keep their modes)."""
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
    """Open ``path`` for writing (created or truncated) with permissions ``mode``; ``readable``:
    for reading too (a shared mapping of it needs both)."""
    fd = os.open(path, (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)  # an existing file keeps its old mode otherwise; the umask may mask it
    return os.fdopen(fd, "r+b" if readable else "wb")
