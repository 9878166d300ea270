"""Free TCP ports that nothing else can take before their consumer binds them.

The usual helper binds port 0, reads the number, closes the socket and hands the number on. It
races: between the close and the consumer's bind, any socket on the machine may be given that
port, another helper's bind to port 0 or the source port of an outgoing connection (gloo and
the TCPStore clients open many). Tests and benchmark launchers saw EADDRINUSE from it.

:func:`reserve_port` keeps the socket instead: bound with ``SO_REUSEADDR`` to the wildcard
address (``::`` dual-stack, else ``0.0.0.0``, so it overlaps every local address), never
listening, until the reservation is released. Why that cannot race, on Linux:

* the kernel picks an ephemeral port (``bind`` to port 0, or the source port of ``connect``)
  only among ports no overlapping socket is bound to: the bind search counts every bound socket
  as a conflict, ``SO_REUSEADDR`` or not, and ``connect`` skips every port a ``bind`` claimed.
  So while the reservation is held, no other socket gets the port by chance, on any address;
* a consumer that binds with ``SO_REUSEADDR`` may share the port with sockets that do not
  listen, so it binds and listens beside the reservation. TCPStore (torch sets the option on
  its listening socket) and etcd (Go sets it on every listener) do; so does a second consumer
  after the first one ended (a restarted store on the same port).

A consumer that does not set ``SO_REUSEADDR`` cannot bind a reserved port: release the
reservation first (and accept the race) or pass it the socket itself.

:func:`free_port` is the one-call form: the number of a port reserved until
:func:`release_ports` (the test suite calls it after every test) or the end of the process.
:func:`free_ports` reserves a run of consecutive ports the same way, for a consumer that derives
ports from a base (the metrics endpoints: agent ``P``, its workers ``P + 1 + local rank``). A
port of the run after the first is bound by number, at first without ``SO_REUSEADDR``, so the
bind fails (and another run is tried) when any socket holds it, another reservation included;
the option is set once the port is ours, so its consumer binds beside it like any reserved port.
tests/test_ports.py checks these properties against the kernel.
"""

from __future__ import annotations

import errno
import socket
import threading

__all__ = ["PortReservation", "free_port", "free_ports", "release_ports", "reserve_port"]


class PortReservation:
    """A port held by a bound, non-listening socket until :meth:`release` (or ``with`` exit).

    ``port``: 0 (the kernel picks a free one) or the number to reserve, which must be held by no
    socket at all (else ``OSError``, EADDRINUSE)."""

    def __init__(self, port: int = 0) -> None:
        self._sock: socket.socket | None = _bind_wildcard(port)
        self.port: int = self._sock.getsockname()[1]

    @property
    def held(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        """Give the port back to the kernel (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PortReservation(port={self.port}, held={self.held})"


def _bind_wildcard(port: int = 0) -> socket.socket:
    errors = []
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # no IPv6 in this kernel or namespace
            errors.append(f"{addr}: {exc}")
            continue
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            if port == 0:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, 0))
            else:  # exclusive first: a bind with the option would share the port with another reservation
                sock.bind((addr, port))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            return sock
        except OSError as exc:
            sock.close()
            if port and exc.errno == errno.EADDRINUSE:
                raise  # taken: the caller tries another port
            errors.append(f"{addr}: {exc}")
    raise OSError(f"cannot reserve a TCP port: binding port 0 failed on every wildcard address ({'; '.join(errors)}); "
                  f"is networking available in this namespace?")


def reserve_port() -> PortReservation:
    """Reserve a free port (on every local address); the caller releases it (or uses ``with``)."""
    return PortReservation()


_held: list[PortReservation] = []
_held_lock = threading.Lock()


def free_port() -> int:
    """A free port, reserved until :func:`release_ports` or the end of the process."""
    reservation = PortReservation()
    with _held_lock:
        _held.append(reservation)
    return reservation.port


def release_ports() -> int:
    """Release every port :func:`free_port` handed out; returns how many there were."""
    with _held_lock:
        held, _held[:] = list(_held), []
    for reservation in held:
        reservation.release()
    return len(held)


def free_ports(count: int, attempts: int = 100) -> int:
    """The first of ``count`` consecutive free ports, all reserved until :func:`release_ports` (or
    the end of the process). Tries up to ``attempts`` runs (a run fails when one of its later ports
    is taken)."""
    if count < 1:
        raise ValueError(f"count={count!r}: reserve at least one port")
    for _ in range(attempts):
        run = [PortReservation()]
        try:
            while len(run) < count:
                if run[0].port + len(run) > 65535:
                    raise OSError(errno.EADDRINUSE, "past the last port")
                run.append(PortReservation(run[0].port + len(run)))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            for reservation in run:
                reservation.release()
            continue
        with _held_lock:
            _held.extend(run)
        return run[0].port
    raise OSError(errno.EADDRINUSE, f"cannot reserve {count} consecutive TCP ports in {attempts} attempts: the "
                                    f"ports after each free one were taken; free some ports or ask for fewer")
