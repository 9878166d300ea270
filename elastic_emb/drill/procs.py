"""Finding and signalling the processes of one simulated node, through psutil.

torchrun starts its workers in sessions of their own (FACTS item 4), so a node loss signals the
agent and every descendant, collected before anything is signalled (:func:`kill_tree`). Each
process found is remembered with its creation time: a pid signalled or checked later is the
process found under it, never another that reused the pid in between (psutil checks).

Design: ``docs/DRILLS.md`` (section "Killing a node").
"""

from __future__ import annotations

import os
import signal
import threading

try:
    import psutil
except ImportError:  # pragma: no cover - the drill commands check the extra before they get here
    raise ImportError("elastic_emb.drill needs the drill extra: pip install 'elastic-emb[drill]'") from None

# pid -> the process found under it (psutil keeps its creation time); the oldest are forgotten
# beyond _KEEP, and a forgotten pid is looked up afresh when signalled.
_FOUND: dict[int, psutil.Process] = {}
_KEEP = 16384
_lock = threading.Lock()


def _remember(found: list[psutil.Process]) -> None:
    with _lock:
        for proc in found:
            _FOUND.pop(proc.pid, None)
            _FOUND[proc.pid] = proc
        for pid in list(_FOUND)[: max(0, len(_FOUND) - _KEEP)]:
            del _FOUND[pid]


def _process(pid: int | psutil.Process) -> psutil.Process:
    """The process found under ``pid``, else the one there now.

    Raises:
        psutil.NoSuchProcess: nothing runs under ``pid``.
    """
    if isinstance(pid, psutil.Process):
        return pid
    with _lock:
        proc = _FOUND.get(pid)
    return proc if proc is not None else psutil.Process(pid)


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (remembered, so that a later signal reaches only these processes).

    Args:
        pid: the ancestor.

    Returns:
        The descendants' pids, breadth first (children, then grandchildren, ...); empty when
        ``pid`` is gone.
    """
    try:
        found = _process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    _remember(found)
    # psutil lists each process after its parent: a depth per process orders them by generation.
    depth = {pid: 0}
    for proc in found:
        try:
            depth[proc.pid] = depth.get(proc.ppid(), 0) + 1
        except psutil.Error:
            depth[proc.pid] = len(found)  # gone since: last
    return [proc.pid for proc in sorted(found, key=lambda p: depth[p.pid])]


def all_pids() -> list[int]:
    """Every process visible to this one (remembered, as :func:`descendants` does).

    Returns:
        Their pids, sorted.
    """
    found = list(psutil.process_iter())
    _remember(found)
    return sorted(proc.pid for proc in found)


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces.

    Args:
        pid: the process.

    Returns:
        The command line, or ``""`` when the process is gone or unreadable.
    """
    try:
        return " ".join(_process(pid).cmdline())
    except psutil.Error:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` (the process found under it, when one was) exists and is not a zombie.

    Args:
        pid: the process.

    Returns:
        True for a running (or sleeping, or stopped) process, also one this user may not signal;
        False when it is gone, a zombie, or its pid now belongs to another process.
    """
    try:
        proc = _process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False


def signal_all(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each process, and to its process group when it leads one.

    A pid that :func:`descendants` or :func:`all_pids` returned is signalled only while the process
    found under it runs (psutil compares creation times); the group's signal follows the
    leader's, while the group still holds that leader's id.

    Args:
        pids: the processes.
        sig: the signal number.

    Returns:
        The pids signalled (those gone, reused or not ours are skipped).
    """
    hit = []
    for pid in pids:
        try:
            proc = _process(pid)
            leads = os.getpgid(proc.pid) == proc.pid
            proc.send_signal(sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
        if leads:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        hit.append(proc.pid)
    return hit


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal ``pid`` and all its descendants (collected first, so orphans are not missed).

    Args:
        pid: the root of the tree.
        sig: the signal number.

    Returns:
        The pids signalled.
    """
    try:
        _remember([_process(pid)])
    except psutil.NoSuchProcess:
        pass  # gone: its descendants, if any are left, now have another parent
    return signal_all([pid, *descendants(pid)], sig)
