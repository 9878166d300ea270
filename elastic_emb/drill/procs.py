"""Finding and signalling the processes of one simulated node.

torchrun starts its workers with ``start_new_session=True`` (FACTS item 4), so a worker is not in
its agent's process group and a SIGKILL of the agent alone leaves the workers running. A node
loss must take the whole node, so the drill collects an agent's descendants from ``/proc``
(parent links) before it signals anything, then signals the agent and every descendant. In
network-namespace mode ``ip netns pids`` gives the same set more directly; both are used.
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
    """Every live descendant of ``pid`` (children first), from /proc parent links."""
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
    return sorted(_parents())


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
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
    """Send ``sig`` to each pid (and its process group when it leads one); return those signalled."""
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
    """Signal ``pid`` and all its descendants (collected first, so orphans are not missed)."""
    return signal_all([pid, *descendants(pid)], sig)
