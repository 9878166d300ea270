"""elastic_emb.testing.ports: a reserved port is never handed to anyone else, and its consumer
(a real TCPStore, twice in a row) still binds it.

The first test would fail with the usual bind-read-close helper: with 200 ports released
instead of held, about 14 of 2,000 ephemeral picks land on one of them (28,000 ports in
Linux's default range).
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from elastic_emb.testing.ports import PortReservation, free_port, free_ports, release_ports, reserve_port


def test_held_ports_are_never_picked_by_bind_0_or_connect():
    held = [reserve_port() for _ in range(200)]
    ports = {r.port for r in held}
    assert len(ports) == len(held)
    try:
        picked = []
        for i in range(2000):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, i % 2)
                s.bind(("127.0.0.1" if i % 3 else "0.0.0.0", 0))
                picked.append(s.getsockname()[1])
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(64)
            for _ in range(300):  # outgoing connections take ephemeral source ports
                with socket.create_connection(server.getsockname()) as c:
                    picked.append(c.getsockname()[1])
                    server.accept()[0].close()
        assert not ports & set(picked), f"held ports handed out: {sorted(ports & set(picked))}"
    finally:
        for r in held:
            r.release()


def test_a_store_binds_a_held_port_and_a_second_store_after_it():
    with reserve_port() as reservation:
        for _ in range(2):  # a restarted consumer on the same port
            store = dist.TCPStore("127.0.0.1", reservation.port, 1, True, wait_for_workers=False)
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store
        assert reservation.held
    assert not reservation.held


def test_a_second_listener_on_a_held_port_is_refused():
    """The reservation does not make a port shareable by two servers: the second one fails."""
    with reserve_port() as reservation:
        first = dist.TCPStore("127.0.0.1", reservation.port, 1, True, wait_for_workers=False)
        with socket.socket() as s, pytest.raises(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", reservation.port))
            s.listen()
        del first


def test_free_port_holds_until_released():
    port = free_port()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: the reservation is in the way
    assert release_ports() >= 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # released: the kernel has it back


def test_free_ports_reserves_a_run_that_its_consumers_bind_and_nobody_else_takes():
    """The metrics endpoints' layout (base, base + 1, ...): every port of the run is held (a
    bind to port 0 never gets one, a second reservation of one is refused), and an HTTP server
    (SO_REUSEADDR, like prometheus-client's) serves on each beside its reservation."""
    import http.server

    base = free_ports(4)
    run = set(range(base, base + 4))
    try:
        with pytest.raises(OSError):
            PortReservation(base + 2)  # another reservation of a held port
        picked = set()
        for _ in range(2000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                picked.add(s.getsockname()[1])
        assert not run & picked, f"held ports handed out: {sorted(run & picked)}"
        for port in sorted(run):
            server = http.server.HTTPServer(("0.0.0.0", port), http.server.BaseHTTPRequestHandler)
            server.server_close()
    finally:
        assert release_ports() >= 4
    with pytest.raises(ValueError):
        free_ports(0)
