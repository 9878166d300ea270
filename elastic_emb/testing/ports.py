"""Free TCP ports that nothing else can take before their consumer binds them.

A reservation is a socket bound with ``SO_REUSEADDR`` to the wildcard address and never
listening: while it is held the kernel gives the port to no other socket by chance, and a
consumer that binds with ``SO_REUSEADDR`` (TCPStore, etcd) binds and listens beside it.

- :class:`PortReservation`, :func:`reserve_port`: a port held until released;
- :func:`free_port`, :func:`free_ports`: a port, or a run of consecutive ports, held until :func:`release_ports`.

Design: ``docs/DRILLS.md`` (section "Ports").
"""

from __future__ import annotations

import errno
import socket
import threading

__all__ = ["PortReservation", "free_port", "free_ports", "release_ports", "reserve_port"]


class PortReservation:
    """A port held by a bound, non-listening socket until :meth:`release` (or ``with`` exit).

    Args:
        port: 0 (the kernel picks a free one) or the number to reserve, which must be held by no
            socket at all.

    Raises:
        OSError: EADDRINUSE if ``port`` is held by a socket; another error if no wildcard address
            can be bound.
    """

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
    raise OSError(
        f"cannot reserve a TCP port: binding port 0 failed on every wildcard address ({'; '.join(errors)}); "
        f"is networking available in this namespace?"
    )


def reserve_port() -> PortReservation:
    """Reserve a free port (on every local address); the caller releases it (or uses ``with``).

    Returns:
        The reservation.
    """
    return PortReservation()


_held: list[PortReservation] = []
_held_lock = threading.Lock()


def free_port() -> int:
    """A free port, reserved until :func:`release_ports` or the end of the process.

    Returns:
        The port number.
    """
    reservation = PortReservation()
    with _held_lock:
        _held.append(reservation)
    return reservation.port


def release_ports() -> int:
    """Release every port :func:`free_port` and :func:`free_ports` reserved (the test suite calls it after each test).

    Returns:
        How many reservations there were.
    """
    with _held_lock:
        held, _held[:] = list(_held), []
    for reservation in held:
        reservation.release()
    return len(held)


def free_ports(count: int, attempts: int = 100) -> int:
    """The first of ``count`` consecutive free ports, all reserved until :func:`release_ports` (or
    the end of the process), for a consumer that derives ports from a base (the metrics endpoints).

    Args:
        count: how many consecutive ports.
        attempts: how many runs to try (a run fails when one of its later ports is taken).

    Returns:
        The first port of the run.

    Raises:
        ValueError: if ``count`` is below 1.
        OSError: EADDRINUSE if no run was free in ``attempts`` tries; another error if a port
            cannot be bound at all.
    """
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
    raise OSError(
        errno.EADDRINUSE,
        f"cannot reserve {count} consecutive TCP ports in {attempts} attempts: the "
        f"ports after each free one were taken; free some ports or ask for fewer",
    )
