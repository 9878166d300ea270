"""Same-host row transport for CPU restores: each receiver pulls its rows out of its senders' memory.

Why. On CPU every rank of a host runs on one kernel. Over gloo, a row block goes from rank s to
rank d through a loopback TCP connection: copied into socket buffers by s, out of them by d, about
2 GB/s here. Linux cross-memory attach, ``process_vm_readv(2)``, lets d copy the bytes from s's
address space straight into its own rows: one kernel copy, no socket, no staging buffer, and s
does nothing while it happens (see BENCHMARKS.md for what that changes for a live reshard).

How. :func:`transfer` is collective over the restore's communicator (:class:`elastic_emb.state.comm.Comm`):

1. Every rank publishes through ``Comm.exchange`` (the store, JSON): its identity (pid, boot id,
   host name, pid namespace, and the address and value of a random 16-byte token in its memory)
   and, for each row block it sends, the address and length of every tensor's bytes (weight, then
   optimizer slots, in the plan's order; a source that is not contiguous is copied first).
2. Each receiver checks each sender it needs: same boot id, host name and pid namespace; then
   that the offered pid is a worker of this job (:func:`job_member`: the kernel's
   ``/proc/<pid>`` says it is a sibling of this worker, started by the same agent with the same
   run id and restart count: a process outside the job, named by a forged offer in the store, is
   refused before a byte of it is read); then a probe: it reads the sender's token with
   ``process_vm_readv`` and compares it with the published value. A match proves that the pid
   names the process that published the addresses, in this kernel (not a recycled pid, not a
   process of another pid namespace), and that this process is allowed to read it (ptrace access
   rules: same user, Yama, seccomp). It then touches its
   destination pages in user space (a fresh arena faults in faster there than inside the kernel's
   copy, measured) and pulls every block.
3. A barrier (``Comm.exchange``, bounded by the communicator's timeout) on which every receiver
   reports the senders it could not read. Senders keep their source rows alive and unchanged until
   the barrier; the pairs reported are then moved by the caller over gloo (:class:`elastic_emb.state.transport.P2PTransport`),
   which both sides know from the barrier's result.

Any failure with a peer (EPERM from ptrace rules, ENOSYS from a seccomp policy or another OS,
another host or pid namespace, a process that is not a worker of this job launched by the same
agent, a wrong token, a short read) sends that peer's rows over gloo
instead: rows are never lost or guessed, only slower. The first fallback for a reason is logged as
a ``cma_fallback`` warning event, later ones at debug level. Under Yama ``ptrace_scope`` 1 (only
ancestors may read a process) a sender opens itself to readers of its own user with
``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` for the duration of the transfer and closes again
after the barrier; scopes 2 and 3 refuse and fall back.

``ELASTIC_EMB_TRANSPORT=cma`` selects it (the CPU default); ``p2p`` keeps every byte on gloo.
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
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.c_ulong]
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
    """What a reader needs to find this process and to prove it found the right one."""
    tok = _token_buffer()
    pidns = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {"ok": _readv is not None, "pid": os.getpid(), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
            "host": socket.gethostname(), "pidns": pidns, "token": [ctypes.addressof(tok), tok.raw.hex()]}


def read_remote(pid: int, blocks: list[tuple[int, int, int]]) -> None:
    """Copy ``(local_addr, remote_addr, nbytes)`` blocks out of process ``pid``; raises
    :class:`_PullError` on any error or short read."""
    if _readv is None:
        raise _PullError(38, "process_vm_readv is not available on this platform")  # ENOSYS
    for local, remote, n in blocks:
        done = 0
        while done < n:
            liov = _IOVec(local + done, n - done)
            riov = _IOVec(remote + done, n - done)
            got = _readv(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
            if got < 0:
                err = ctypes.get_errno()
                if err == 4:  # EINTR: nothing was copied, try again
                    continue
                raise _PullError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
            if got == 0:
                raise _PullError(14, f"process_vm_readv from pid {pid}: read 0 of {n - done} bytes")  # EFAULT
            done += got


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
    """None when process ``pid`` proves it is a worker of this job's current launch, else why not.

    Everything in the offer (pid, token, addresses) comes from the store, which anyone who can
    reach it may write. What a store writer cannot forge is the kernel's view of the offered
    process: it must be a sibling of this worker (the same parent: the agent that started both
    for this launch) and have been started with this worker's run id and restart count. Checked
    before a single byte of the process is read; a refusal sends that peer's rows over gloo."""
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
        log.warning("cma_fallback", peer=peer, reason=reason, remedy="rows go over gloo p2p; ELASTIC_EMB_TRANSPORT=p2p "
                    "skips the attempt")


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_populate = [True]  # cleared when the kernel refuses MADV_POPULATE_WRITE


def _touch(b: torch.Tensor) -> None:
    """Fault the pages of a flat uint8 destination in before the pull: faults taken inside
    process_vm_readv's copy cost more than taking them first (measured: 128 MB fresh, 0.062 s
    pulled as is, 0.040 + 0.017 s touched then pulled). ``madvise(MADV_POPULATE_WRITE)`` on the
    whole pages inside (no content changes, ~8% cheaper than writing a byte per page), one write
    per page on the partial pages at the ends (and everywhere when the kernel lacks it)."""
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
                b[hi - addr:].zero_()
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


def transfer(comm, outgoing: dict[int, tuple[int, list[torch.Tensor]]],
             incoming: dict[int, tuple[int, list[torch.Tensor]]]) -> set[tuple[int, int]]:
    """Collective: move row blocks between the ranks of ``comm`` by cross-memory attach.

    ``outgoing``: block key -> (destination rank, source tensors of this rank, CPU);
    ``incoming``: block key -> (source rank, destination tensors of this rank, CPU, same shapes
    as the sender's). Keys are shared by sender and receiver (the index in the common plan order).
    Every rank must call it, even with nothing to move. Returns the (src, dst) pairs of the whole
    world whose blocks were not moved (any failure of that pair): the caller moves them another way."""
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
                try:
                    _pull_from(everyone[src], by_src[src], src)
                except _PullError as exc:
                    reason = f"pull failed: {exc.strerror or exc} (errno {exc.errno})"
            if reason is not None:
                failed[src] = reason
                _note_fallback(src, reason)
        done = comm.exchange("cma-done", sorted(failed))
    finally:
        if opened:
            _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(0), 0, 0, 0)
    del keep
    return {(src, dst) for dst, srcs in enumerate(done) for src in srcs}


def _pull_from(peer: dict, blocks: list[tuple[int, list[torch.Tensor]]], src: int) -> None:
    pid = int(peer["id"]["pid"])
    post: list[tuple[torch.Tensor, torch.Tensor]] = []
    reads: list[tuple[int, int, int]] = []
    for key, tensors in blocks:
        spans = peer["rows"].get(str(key))
        if spans is None or len(spans) != len(tensors):
            raise RuntimeError(f"cma transport: rank {src} offers {spans!r} for block {key}, expected "
                               f"{len(tensors)} tensors; the ranks computed different plans")
        for t, (addr, nbytes) in zip(tensors, spans):
            if t.device.type != "cpu":
                raise ValueError(f"cma transport: a destination tensor is on {t.device}, only CPU memory can be pulled into")
            want = t.numel() * t.element_size()
            if nbytes != want:
                raise RuntimeError(f"cma transport: rank {src} offers {nbytes} bytes for block {key}, this rank "
                                   f"expects {want}; the ranks computed different plans")
            dst = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
            if dst is not t:
                post.append((t, dst))
            b = _flat(dst)
            _touch(b)
            reads.append((b.data_ptr(), int(addr), nbytes))
    read_remote(pid, reads)
    for t, dst in post:
        t.copy_(dst)
