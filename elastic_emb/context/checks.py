"""Errors the device finds, raised on the host without the host waiting for the device.

Each lookup or gradient update on CUDA writes a small record (:data:`RECORD` int64 words: bad
ids, first bad position, non-finite rows, refused) on the device; :class:`DeviceChecks` copies
records to pinned host memory only when a blocking read asks for them, and raises
:class:`~elastic_emb.errors.InvalidIds` or :class:`~elastic_emb.errors.NonFiniteGradients` in
call order. On the CPU a record is read at the end of its call.

Design: ``docs/CONTEXT.md`` (section "Device checks").
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
    error path); ``error`` is what reading the record raised (raised again on a second wait).

    Args:
        what: the call, for messages (``lookup('t')``).
        spec: the table the call used.
        slot: the record's slot in the ring.
        ids: the call's ids.
        done: the CUDA event recorded after the call (None on the CPU).
    """

    __slots__ = ("what", "spec", "slot", "ids", "done", "copied", "values", "error")

    def __init__(self, what: str, spec: TableSpec, slot: int, ids: torch.Tensor, done) -> None:
        self.what, self.spec, self.slot, self.ids, self.done = what, spec, slot, ids, done
        self.copied = None  # CUDA: the event after the record's copy to pinned memory, once asked for
        self.values: list[int] | None = None
        self.error: Exception | None = None


class DeviceChecks:
    """The records of one context's calls, in call order.

    Args:
        device: the context's device.
        timeout: seconds a blocking read waits for the device at most.
        log_: the context's logger.
    """

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
        # The pinned records as the device sees them (a kernel's stores reach the host without
        # the copy engine, which a commit's delta may be busy with), or None where the mapping
        # is not available: the copy engine copies them then.
        self._mapped_slots = _mapped(self._host, device) if cuda else None

    @property
    def mapped(self) -> bool:
        """Whether records reach the host through their device mapping (a kernel's stores), not
        a copy-engine transfer (CUDA; the CPU needs neither)."""
        return self._mapped_slots is not None

    def record(self) -> tuple[int, torch.Tensor]:
        """A zeroed device record for the next call; waits for the oldest when the ring is full.

        Returns:
            ``(slot, record)``: the slot to :meth:`post` and a device tensor of :data:`RECORD`
            words.
        """
        if len(self._pending) >= _RING:
            self._settle(self._pending[0], block=True)  # the oldest slot is reused next
        slot = self._next
        self._next = (self._next + 1) % _RING
        rec = self._dev_slots[slot]
        rec.zero_()
        return slot, rec

    def post(self, what: str, spec: TableSpec, slot: int, ids: torch.Tensor, stream=None) -> Check:
        """The call that filled record ``slot`` is queued: read it on the CPU now, on CUDA later.

        Args:
            what: the call, for messages.
            spec: the table the call used.
            slot: the slot :meth:`record` gave.
            ids: the call's ids (to name the first bad one).
            stream: the stream the call ran on (default: the current one).

        Returns:
            The pending :class:`Check`.

        Raises:
            InvalidIds: on the CPU, when the record counts ids out of range.
            NonFiniteGradients: on the CPU, when the call was refused for non-finite gradients.
        """
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
        no copy: the records of finished calls are fetched by the next blocking read).

        Raises:
            InvalidIds: a record counted ids out of range.
            NonFiniteGradients: a call was refused for non-finite gradients.
        """
        while self._pending and self._settle(self._pending[0], block=False):
            pass

    def raise_through(self, check: Check, timeout: float | None = None) -> None:
        """Wait for ``check`` and every older record (bounded), raising the first bad one.

        Args:
            check: the record waited for.
            timeout: seconds to wait for each record; None: the context's timeout.

        Raises:
            InvalidIds: a record counted ids out of range.
            NonFiniteGradients: a call was refused for non-finite gradients.
            CommunicationError: the device did not finish a check within the timeout.
        """
        while self._pending and check.values is None:
            self._settle(self._pending[0], block=True, timeout=timeout)
        if check.error is not None:
            raise check.error

    def raise_all(self) -> None:
        """Wait for every record (bounded by the timeout), raising the first bad one.

        Raises:
            InvalidIds: a record counted ids out of range.
            NonFiniteGradients: a call was refused for non-finite gradients.
            CommunicationError: the device did not finish a check within the timeout.
        """
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
                raise CommunicationError(
                    f"{check.what}: the device did not finish its checks within {t}s; "
                    f"the GPU is stuck or overloaded: close this context"
                )
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
                    spec.name,
                    v[R_NONFINITE],
                )
            self.log.warning("context.nonfinite_gradients_skipped", table=spec.name, rows=v[R_NONFINITE])


class _HostRecords:
    """Pinned host memory as the GPU addresses it: ``__cuda_array_interface__`` over its pointer
    (the same address on the device: unified virtual addressing), so torch makes a CUDA tensor
    of it whose kernels store straight into host memory."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive with the CUDA tensor (which holds this object)
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "<i8",
            "strides": None,
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def _mapped(host: torch.Tensor, device: torch.device) -> list[torch.Tensor] | None:
    """Per slot, a CUDA view of the pinned records ``host``; None where the device cannot map them."""
    try:
        view = torch.as_tensor(_HostRecords(host), device=device)
    except (RuntimeError, TypeError, ValueError):  # no mapping: the copy engine copies the records
        return None
    if not view.is_cuda or view.data_ptr() != host.data_ptr():
        return None
    return list(view.unbind(0))
