"""Finding and signalling the processes of one simulated node.

torchrun starts its workers in sessions of their own (FACTS item 4), so a node loss signals the
agent and every descendant, collected from ``/proc`` parent links before anything is signalled
(:func:`kill_tree`).

Design: ``docs/DRILLS.md`` (section "Killing a node").
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, from ``/proc`` parent links.

    Args:
        pid: the ancestor.

    Returns:
        The descendants' pids, breadth first (children, then grandchildren, ...).
    """
    parents = _parents()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out, frontier = [], [pid]
    for _ in range(10_000):  # bounded walk
        if not frontier:
            break
        nxt = []
        for p in frontier:
            for c in children.get(p, []):
                out.append(c)
                nxt.append(c)
        frontier = nxt
    return out


def all_pids() -> list[int]:
    """Every process visible in ``/proc``.

    Returns:
        Their pids, sorted.
    """
    return sorted(_parents())


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces.

    Args:
        pid: the process.

    Returns:
        The command line, or ``""`` when the process is gone or unreadable.
    """
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie.

    Args:
        pid: the process.

    Returns:
        True for a running (or sleeping, or stopped) process, also one this user may not signal.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = ""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_all(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each pid, and to its process group when it leads one.

    Args:
        pids: the processes.
        sig: the signal number.

    Returns:
        The pids signalled (those gone or not ours are skipped).
    """
    hit = []
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return hit


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal ``pid`` and all its descendants (collected first, so orphans are not missed).

    Args:
        pid: the root of the tree.
        sig: the signal number.

    Returns:
        The pids signalled.
    """
    return signal_all([pid, *descendants(pid)], sig)
