"""Errors the device finds, raised on the host without the host waiting for the device.

On CUDA a lookup or gradient update checks its input where the data is: ids against the
table's range (inside the gather kernel), gradients for NaN and infinity. Reading the verdict
on the host at once would stall the host until the GPU reached that point (a synchronisation),
so instead each call writes a small record on the device (:data:`RECORD` int64 words) and an
event marks the call done; a record is copied to pinned host memory (on a stream of its own, so
the copy never queues behind later work) when a blocking read asks for it. The copy is a
one-block kernel storing through the pinned records' device mapping (pinned memory is mapped
into the GPU's address space), not a copy-engine transfer: a commit's delta occupies the
device-to-host copy engine in pieces of 16 MiB, and a read queued behind one waited for it
(about 0.3 ms on an H200, a step's lookup each time). The invalid rows are
never applied: ids out of range read row 0 instead (a lookup with bad ids returns garbage rows
*and* raises), gradients of a refused call are not applied at all.

When a record is read (:class:`DeviceChecks`), in call order:

- ``LookupHandle.wait()`` waits (bounded by the context's timeout) for its own lookup's record
  and every older one, and raises the first error among them: bad ids always surface at that
  lookup's ``wait()``, and an error of an earlier ``apply_gradients`` at the latest at the
  ``wait()`` of the next lookup. In a prefetching loop those records are long done;
- ``export_shard()``, ``state_dict()``, ``take_changes()`` and ``check_errors()`` wait for every
  record, so no commit is taken over an unreported error;
- ``lookup()`` and ``apply_gradients()`` raise an error already read, and never wait.

At most :data:`_RING` records are outstanding: the call after that waits for the oldest.

On the CPU the record is host memory already: it is read at the end of the call that wrote
it, and the error raised there.
"""

from __future__ import annotations

from collections import deque

import torch

from elastic_emb.context.group import poll
from elastic_emb.errors import CommunicationError, InvalidIds, NonFiniteGradients
from elastic_emb.protocol import TableSpec

# Words of one record: bad ids, n - first bad position (0: none), non-finite gradient rows,
# and 1 when the call was refused (rows left untouched).
RECORD = 4
R_BAD_IDS, R_FIRST, R_NONFINITE, R_REFUSED = range(RECORD)
_RING = 64


class Check:
    """One call's pending record: ``ids`` are kept to name the first bad one (read only on the
    error path); ``error`` is what reading the record raised (raised again on a second wait)."""

    __slots__ = ("what", "spec", "slot", "ids", "done", "copied", "values", "error")

    def __init__(self, what: str, spec: TableSpec, slot: int, ids: torch.Tensor, done) -> None:
        self.what, self.spec, self.slot, self.ids, self.done = what, spec, slot, ids, done
        self.copied = None  # CUDA: the event after the record's copy to pinned memory, once asked for
        self.values: list[int] | None = None
        self.error: Exception | None = None


class DeviceChecks:
    """The records of one context's calls, in call order (see the module docstring)."""

    def __init__(self, device: torch.device, timeout: float, log_):
        self.device = device
        self.timeout = timeout
        self.log = log_
        self._pending: deque[Check] = deque()
        self._next = 0
        cuda = device.type == "cuda"
        self._dev = torch.zeros(_RING, RECORD, dtype=torch.int64, device=device)
        self._host = torch.zeros(_RING, RECORD, dtype=torch.int64, pin_memory=cuda) if cuda else self._dev
        # Per slot: the device record, its pinned copy and an event, made once (a call indexes a list).
        self._dev_slots = list(self._dev.unbind(0))
        self._host_slots = list(self._host.unbind(0))
        self._events = [torch.cuda.Event() for _ in range(_RING)] if cuda else []
        self._copied = [torch.cuda.Event() for _ in range(_RING)] if cuda else []
        # Records travel to the host on a stream of their own, each once its call is done, so a
        # copy never waits behind later work (a call queues none: reading is for wait() & co.);
        # high priority: the copy kernel is scheduled before queued blocks of other streams.
        self._copy_stream = torch.cuda.Stream(device=device, priority=-1) if cuda else None
        # The pinned records as the device sees them (module docstring), or None where the
        # mapping is not available: the copy engine copies them then.
        self._mapped_slots = _mapped(self._host, device) if cuda else None

    @property
    def mapped(self) -> bool:
        """Whether records reach the host through their device mapping (a kernel's stores), not
        a copy-engine transfer (CUDA; the CPU needs neither)."""
        return self._mapped_slots is not None

    def record(self) -> tuple[int, torch.Tensor]:
        """A zeroed device record for the next call: (slot, tensor of :data:`RECORD` words)."""
        if len(self._pending) >= _RING:
            self._settle(self._pending[0], block=True)  # the oldest slot is reused next
        slot = self._next
        self._next = (self._next + 1) % _RING
        rec = self._dev_slots[slot]
        rec.zero_()
        return slot, rec

    def post(self, what: str, spec: TableSpec, slot: int, ids: torch.Tensor, stream=None) -> Check:
        """The call that filled record ``slot`` is queued (on ``stream``, default the current one):
        read it on the CPU now (and raise), on CUDA once the device is done with it."""
        if not self._events:  # CPU: the record is host memory
            check = Check(what, spec, slot, ids, None)
            check.values = self._dev_slots[slot].tolist()
            self._raise_if_bad(check)
            return check
        done = self._events[slot]  # free again: the slot's previous check was settled (record())
        done.record(stream)
        check = Check(what, spec, slot, ids, done)
        self._pending.append(check)
        return check

    def _copy(self, check: Check) -> None:
        """Queue the record's copy to pinned memory behind its call, on the copy stream."""
        cs = self._copy_stream
        cs.wait_event(check.done)
        with torch.cuda.stream(cs):
            if self._mapped_slots is not None:  # an elementwise kernel: torch's copy_ would use the copy engine
                torch.bitwise_or(self._dev_slots[check.slot], 0, out=self._mapped_slots[check.slot])
            else:
                self._host_slots[check.slot].copy_(self._dev_slots[check.slot], non_blocking=True)
        check.copied = self._copied[check.slot]
        check.copied.record(cs)

    def raise_ready(self) -> None:
        """Raise the first bad record among those already on the host; never waits (and asks for
        no copy: the records of finished calls are fetched by the next blocking read)."""
        while self._pending and self._settle(self._pending[0], block=False):
            pass

    def raise_through(self, check: Check, timeout: float | None = None) -> None:
        """Wait for ``check`` and every older record (bounded), raising the first bad one."""
        while self._pending and check.values is None:
            self._settle(self._pending[0], block=True, timeout=timeout)
        if check.error is not None:
            raise check.error

    def raise_all(self) -> None:
        """Wait for every record (bounded by the timeout), raising the first bad one."""
        while self._pending:
            self._settle(self._pending[0], block=True)

    def _settle(self, check: Check, block: bool, timeout: float | None = None) -> bool:
        """Read ``check`` once on the host (with ``block``: asking for its copy and waiting for
        it, bounded); raise if bad."""
        if check.copied is None:
            if not block:
                return False
            self._copy(check)
        if not check.copied.query():
            if not block:
                return False
            t = self.timeout if timeout is None else timeout
            if not poll(check.copied.query, t):
                raise CommunicationError(f"{check.what}: the device did not finish its checks within {t}s; "
                                         f"the GPU is stuck or overloaded: close this context")
        self._pending.popleft()
        check.values = self._host_slots[check.slot].tolist()
        self._raise_if_bad(check)
        return True

    def _read_id(self, ids: torch.Tensor, pos: int):
        """``ids[pos]`` on the host (the error path): on CUDA through pinned memory and a polled
        event, so even this read never blocks in a synchronising call."""
        if ids.device.type != "cuda":
            return int(ids[pos])
        host = torch.empty(1, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids[pos : pos + 1], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return int(host[0]) if poll(copied.query, self.timeout) else "?"

    def _raise_if_bad(self, check: Check) -> None:
        try:
            self._verdict(check)
        except Exception as exc:
            check.error = exc
            raise

    def _verdict(self, check: Check) -> None:
        v, spec = check.values, check.spec
        if v[R_BAD_IDS]:
            pos = check.ids.numel() - v[R_FIRST]
            first = self._read_id(check.ids, pos) if 0 <= pos < check.ids.numel() else "?"
            raise InvalidIds(
                f"{check.what}: {v[R_BAD_IDS]} id(s) out of range for table {spec.name!r} of {spec.num_rows} "
                f"rows, the first {first} at position {pos} (valid ids are 0..{spec.num_rows - 1})"
                + ("; no row was updated" if v[R_REFUSED] else "; the rows returned for them are not valid")
            )
        if v[R_NONFINITE]:
            if v[R_REFUSED]:
                raise NonFiniteGradients(
                    f"{check.what}: {v[R_NONFINITE]} row(s) of table {spec.name!r} got NaN or infinite gradients; "
                    f"no row of that call was updated. Fix the loss (or clip gradients), or construct the "
                    f"context with nonfinite_gradients='skip' to update the other rows",
                    spec.name, v[R_NONFINITE])
            self.log.warning("context.nonfinite_gradients_skipped", table=spec.name, rows=v[R_NONFINITE])


class _HostRecords:
    """Pinned host memory as the GPU addresses it: ``__cuda_array_interface__`` over its pointer
    (the same address on the device: unified virtual addressing), so torch makes a CUDA tensor
    of it whose kernels store straight into host memory."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive with the CUDA tensor (which holds this object)
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i8", "strides": None,
                                         "data": (host.data_ptr(), False), "version": 2}


def _mapped(host: torch.Tensor, device: torch.device) -> list[torch.Tensor] | None:
    """Per slot, a CUDA view of the pinned records ``host``; None where the device cannot map them."""
    try:
        view = torch.as_tensor(_HostRecords(host), device=device)
    except (RuntimeError, TypeError, ValueError):  # no mapping: the copy engine copies the records
        return None
    if not view.is_cuda or view.data_ptr() != host.data_ptr():
        return None
    return list(view.unbind(0))
