"""Same-host row transport for CPU restores: each receiver pulls its rows out of its senders' memory.

:func:`transfer` (collective) moves row blocks by ``process_vm_readv(2)`` between the ranks of one
host, after checking that each sender is a worker of this job (:func:`job_member`) and owns the
addresses it published (a token probe); the pairs it could not move are returned, for gloo.
:func:`identity` and :func:`read_remote` are its parts. ``ELASTIC_EMB_TRANSPORT=cma`` selects it
(the CPU default); ``p2p`` keeps every byte on gloo.

Design: ``docs/COMMIT.md`` (section "Cross-memory attach").
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from pathlib import Path

import torch

from elastic_emb.errors import _PullError
from elastic_emb.events import get_logger

log = get_logger("elastic_emb.state.cma")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_syscall():
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None, None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc, fn


_libc, _readv = _load_syscall()
_token: tuple[int, ctypes.Array] | None = None  # (pid that made it, 16 random bytes)
_warned: set[str] = set()


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _token_buffer() -> ctypes.Array:
    """This process's token: regenerated after a fork, so parent and child never share one."""
    global _token
    if _token is None or _token[0] != os.getpid():
        _token = (os.getpid(), ctypes.create_string_buffer(os.urandom(16), 16))
    return _token[1]


def identity() -> dict:
    """What a reader needs to find this process and to prove it found the right one.

    Returns:
        A JSON-able dict: whether ``process_vm_readv`` is available here, the pid, the boot id,
        the host name, the pid namespace, and the address and hex value of this process's token.
    """
    tok = _token_buffer()
    pidns = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {
        "ok": _readv is not None,
        "pid": os.getpid(),
        "boot": _read_text("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "pidns": pidns,
        "token": [ctypes.addressof(tok), tok.raw.hex()],
    }


PULL_PIECE = 64 << 20  # bytes per system call when progress is reported (one advance per piece)


def read_remote(pid: int, blocks: list[tuple[int, int, int]], progress=None) -> None:
    """Copy blocks of bytes out of another process's memory into this one's.

    Args:
        pid: the process to read.
        blocks: ``(local address, remote address, bytes)`` triples.
        progress: a :class:`~elastic_emb.progress.Progress` advanced by the bytes of each piece
            read (at most :data:`PULL_PIECE` per system call), or None (one call per block).

    Raises:
        _PullError: if ``process_vm_readv`` is unavailable, fails (with its errno), or reads nothing.
    """
    if _readv is None:
        raise _PullError(38, "process_vm_readv is not available on this platform")  # ENOSYS
    for local, remote, n in blocks:
        done = 0
        while done < n:
            want = n - done if progress is None else min(n - done, PULL_PIECE)
            liov = _IOVec(local + done, want)
            riov = _IOVec(remote + done, want)
            got = _readv(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
            if got < 0:
                err = ctypes.get_errno()
                if err == 4:  # EINTR: nothing was copied, try again
                    continue
                raise _PullError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
            if got == 0:
                raise _PullError(14, f"process_vm_readv from pid {pid}: read 0 of {n - done} bytes")  # EFAULT
            done += got
            if progress is not None:
                progress.advance(got)


# Environment entries a worker of this job and launch has, set by its launcher at exec time.
JOB_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _environ(pid: int | str) -> dict[str, str]:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``). Reading it takes
    the same ptrace access as reading the process's memory."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def _parent(pid: int | str) -> int:
    """The parent pid of ``pid`` (``/proc/<pid>/stat``; the command name may hold spaces)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def job_member(pid: int) -> str | None:
    """Whether process ``pid`` is, in the kernel's view, a worker of this job's current launch.

    It must be a sibling of this worker (the same parent: the agent that started both) and have
    been started with this worker's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``.
    An offer in the store can be forged; ``/proc/<pid>`` cannot.

    Args:
        pid: the process an offer names.

    Returns:
        None when it is a worker of this job, else the reason it is not (or cannot be checked).
    """
    try:
        theirs, parent = _environ(pid), _parent(pid)
        mine = _environ("self")
    except (OSError, ValueError, IndexError) as exc:
        return f"not a process of this job: cannot read /proc/{pid} ({exc.__class__.__name__})"
    if parent != os.getppid():
        return f"not a process of this job: pid {pid} has parent {parent}, this worker's agent is {os.getppid()}"
    if not mine.get(JOB_ENV[0]):
        return f"not a process of this job: this worker has no {JOB_ENV[0]} to compare"
    for key in JOB_ENV:
        if theirs.get(key) != mine.get(key):
            return f"not a process of this job: pid {pid} has {key}={theirs.get(key)!r}, here {mine.get(key)!r}"
    return None


def _probe(me: dict, peer: dict) -> str | None:
    """None when ``peer``'s memory can be read from here, else the reason it cannot."""
    if not me["ok"]:
        return "process_vm_readv unavailable here"
    if not peer["ok"]:
        return "process_vm_readv unavailable on the peer"
    for key, what in (("boot", "boot id"), ("host", "host name"), ("pidns", "pid namespace")):
        if not me[key] or me[key] != peer[key]:
            return f"different {what} ({peer[key]!r}, here {me[key]!r})"
    if not isinstance(peer.get("pid"), int) or peer["pid"] <= 0:
        return f"bad pid {peer.get('pid')!r} in the offer"
    refused = job_member(peer["pid"])
    if refused is not None:
        return refused
    addr, want = peer["token"]
    got = ctypes.create_string_buffer(16)
    try:
        read_remote(int(peer["pid"]), [(ctypes.addressof(got), int(addr), 16)])
    except _PullError as exc:
        return f"probe read failed: {exc.strerror or exc} (errno {exc.errno})"
    if got.raw.hex() != want:
        return "probe token mismatch (the pid names another process)"
    return None


def _note_fallback(peer: int, reason: str) -> None:
    key = reason.split(" (")[0].split(":")[0]
    if key in _warned:
        log.debug("cma_fallback", peer=peer, reason=reason)
    else:
        _warned.add(key)
        log.warning(
            "cma_fallback",
            peer=peer,
            reason=reason,
            remedy="rows go over gloo p2p; ELASTIC_EMB_TRANSPORT=p2p skips the attempt",
        )


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_populate = [True]  # cleared when the kernel refuses MADV_POPULATE_WRITE


def _touch(b: torch.Tensor) -> None:
    """Fault the pages of a flat uint8 destination in before the pull: faults taken inside
    process_vm_readv's copy cost more than taking them first. ``madvise(MADV_POPULATE_WRITE)`` on
    the whole pages inside (no content changes, and cheaper than writing a byte per page), one
    write per page on the partial pages at the ends (and everywhere when the kernel lacks it)."""
    n = b.numel()
    if not n:
        return
    addr = b.data_ptr()
    lo = -(-addr // PAGE) * PAGE
    hi = (addr + n) // PAGE * PAGE
    if _populate[0] and _libc is not None and hi - lo >= 16 * PAGE:
        if _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_WRITE) == 0:
            if lo > addr:
                b[: lo - addr].zero_()
            if addr + n > hi:
                b[hi - addr :].zero_()
            return
        _populate[0] = False  # EINVAL on kernels before 5.14: write per page from now on
    b[::PAGE].zero_()
    b[-1:].zero_()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _yama_scope() -> int:
    try:
        return int(_read_text("/proc/sys/kernel/yama/ptrace_scope") or 0)
    except ValueError:
        return 0


def transfer(
    comm,
    outgoing: dict[int, tuple[int, list[torch.Tensor]]],
    incoming: dict[int, tuple[int, list[torch.Tensor]]],
    progress=None,
) -> set[tuple[int, int]]:
    """Move row blocks between the ranks of ``comm`` by cross-memory attach (collective).

    Every rank must call it, even with nothing to move. Keys are shared by sender and receiver
    (the index in the common plan order). Senders keep their rows alive and unchanged until the
    closing barrier.

    Args:
        comm: the communicator (:class:`elastic_emb.state.comm.Comm`): its store carries the offers.
        outgoing: block key -> (destination rank, this rank's source tensors, on the CPU).
        incoming: block key -> (source rank, this rank's destination tensors, on the CPU, shaped
            as the sender's).
        progress: a :class:`~elastic_emb.progress.Progress` advanced by the bytes pulled, or None.

    Returns:
        The ``(src, dst)`` pairs of the whole world whose blocks were not moved (any failure of
        that pair): the caller moves them another way.

    Raises:
        ValueError: if a source or destination tensor is not in CPU memory.
        RuntimeError: if a sender's offer does not match this rank's plan (the ranks planned
            differently).
    """
    keep: list[torch.Tensor] = []
    offers: dict[str, list[list[int]]] = {}
    for key, (_, tensors) in outgoing.items():
        spans = []
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"cma transport: a source tensor is on {t.device}, only CPU memory can be pulled")
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
            spans.append([t.data_ptr(), t.numel() * t.element_size()])
        offers[str(key)] = spans
    me = identity()
    opened = bool(outgoing) and _yama_scope() == 1 and _libc is not None
    if opened:
        _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    try:
        everyone = comm.exchange("cma-offer", {"id": me, "rows": offers})
        failed: dict[int, str] = {}
        by_src: dict[int, list[tuple[int, list[torch.Tensor]]]] = {}
        for key, (src, tensors) in sorted(incoming.items()):
            by_src.setdefault(src, []).append((key, tensors))
        for src in sorted(by_src):
            reason = _probe(me, everyone[src]["id"])
            if reason is None:
                counted = _Counted(progress)
                try:
                    _pull_from(everyone[src], by_src[src], src, counted if progress is not None else None)
                except _PullError as exc:
                    reason = f"pull failed: {exc.strerror or exc} (errno {exc.errno})"
                    counted.take_back()  # the pair's blocks go over gloo and are counted there
            if reason is not None:
                failed[src] = reason
                _note_fallback(src, reason)
        done = comm.exchange("cma-done", sorted(failed))
    finally:
        if opened:
            _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(0), 0, 0, 0)
    del keep
    return {(src, dst) for dst, srcs in enumerate(done) for src in srcs}


class _Counted:
    """Forwards a pull's progress and remembers it, so a failed pull can take its bytes back."""

    def __init__(self, progress) -> None:
        self.progress = progress
        self.n = 0

    def advance(self, n: int) -> None:
        self.n += n
        self.progress.advance(n)

    def take_back(self) -> None:
        if self.progress is not None and self.n:
            self.progress.advance(-self.n)
        self.n = 0


def _pull_from(peer: dict, blocks: list[tuple[int, list[torch.Tensor]]], src: int, progress=None) -> None:
    pid = int(peer["id"]["pid"])
    post: list[tuple[torch.Tensor, torch.Tensor]] = []
    reads: list[tuple[int, int, int]] = []
    for key, tensors in blocks:
        spans = peer["rows"].get(str(key))
        if spans is None or len(spans) != len(tensors):
            raise RuntimeError(
                f"cma transport: rank {src} offers {spans!r} for block {key}, expected "
                f"{len(tensors)} tensors; the ranks computed different plans"
            )
        for t, (addr, nbytes) in zip(tensors, spans):
            if t.device.type != "cpu":
                raise ValueError(
                    f"cma transport: a destination tensor is on {t.device}, only CPU memory can be pulled into"
                )
            want = t.numel() * t.element_size()
            if nbytes != want:
                raise RuntimeError(
                    f"cma transport: rank {src} offers {nbytes} bytes for block {key}, this rank "
                    f"expects {want}; the ranks computed different plans"
                )
            dst = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
            if dst is not t:
                post.append((t, dst))
            b = _flat(dst)
            _touch(b)
            reads.append((b.data_ptr(), int(addr), nbytes))
    read_remote(pid, reads, progress)
    for t, dst in post:
        t.copy_(dst)
