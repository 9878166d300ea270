"""A real etcd for drills and tests: the rendezvous store that outlives every node.

Starts Debian's ``etcd`` (package ``etcd-server``) as child processes on loopback (test tooling):

- :class:`EtcdServer`: one member on free loopback ports, in a data directory the caller owns;
- :class:`EtcdCluster`: ``size`` members forming one cluster; :meth:`EtcdCluster.leader` names its leader;
- :func:`command`, :func:`wait_healthy`: for a caller that starts the process elsewhere.

Design: ``docs/DRILLS.md`` (section "The test etcd").
"""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

from elastic_emb import config
from elastic_emb.errors import ElasticEmbError
from elastic_emb.testing.ports import free_port

ETCD_BINARY_ENV = "ELASTIC_EMB_ETCD"  # path of the etcd binary, when it is not `etcd` on PATH


class EtcdUnavailable(ElasticEmbError, RuntimeError):
    """The etcd binary is not installed."""


def etcd_binary() -> str | None:
    """Where the etcd binary is.

    Returns:
        ``ELASTIC_EMB_ETCD`` when set, else ``etcd`` on PATH, else None.
    """
    return config.load(None, "etcd").etcd or shutil.which("etcd")


def command(
    binary: str,
    data_dir: Path,
    host: str,
    client_port: int,
    peer_port: int,
    name: str = "drill",
    initial_cluster: str | None = None,
    tls: "TLSFiles | None" = None,
) -> list[str]:
    """The etcd command line of one member listening on ``host`` only.

    The v2 API is enabled (torch's ``etcd-v2`` and python-etcd speak v2); fsync is off (a test store).

    Args:
        binary: the etcd binary.
        data_dir: the member's data directory.
        host: the address to listen on (client and peer).
        client_port: the client port.
        peer_port: the peer port.
        name: the member's name.
        initial_cluster: every member's ``name=peer URL``, comma-separated; None for a one-member cluster.
        tls: serve the client port over HTTPS, requiring a client certificate signed by ``tls.ca``.

    Returns:
        The argument list.
    """
    client = f"{'https' if tls else 'http'}://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    secure = (
        []
        if tls is None
        else [
            "--cert-file",
            str(tls.cert),
            "--key-file",
            str(tls.key),
            "--client-cert-auth",
            "--trusted-ca-file",
            str(tls.ca),
        ]
    )
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        initial_cluster or f"{name}={peer}",
        "--initial-cluster-state",
        "new",
        "--enable-v2=true",
        "--log-level",
        "warn",
        # A test store: no fsync per write (the data dir is a temp dir) keeps it fast on a busy disk.
        "--unsafe-no-fsync",
        *secure,
    ]


class TLSFiles(NamedTuple):
    """PEM files of a test etcd's TLS: its certificate and key (also the client's), and the CA."""

    cert: Path
    key: Path
    ca: Path

    def context(self) -> ssl.SSLContext:
        """A client TLS context: trusts :attr:`ca` and presents :attr:`cert` and :attr:`key`.

        Returns:
            The SSL context.
        """
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def health(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """Whether etcd at ``url`` answers ``/health`` with ``{"health": "true"}``.

    Args:
        url: the member's client URL.
        timeout: seconds for the request.
        context: the TLS context for an HTTPS URL.

    Returns:
        True when healthy; False on any error or other answer.
    """
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout, context=context) as r:  # noqa: S310
            return r.status == 200 and json.loads(r.read() or b"{}").get("health") == "true"
    except (OSError, ValueError, urllib.error.URLError):
        return False


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None,
    timeout: float,
    log: Path | None = None,
    context: ssl.SSLContext | None = None,
) -> float:
    """Block until etcd at ``url`` is healthy.

    Args:
        url: the member's client URL.
        proc: the etcd process, watched so that its exit ends the wait; None watches nothing.
        timeout: seconds to wait at most.
        log: the member's log file, quoted in the errors.
        context: the TLS context for an HTTPS URL.

    Returns:
        The seconds it took.

    Raises:
        RuntimeError: if ``proc`` exits first (with the log's tail).
        TimeoutError: if etcd is not healthy within ``timeout`` seconds.
    """
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"etcd exited with {proc.returncode} before it was healthy (log {log}):\n{tail}")
        if health(url, timeout=min(1.0, max(0.05, deadline - time.monotonic())), context=context):
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(
        f"etcd at {url} was not healthy within {timeout}s (log {log}); raise start_timeout or "
        f"check that the ports are free"
    )


class EtcdServer:
    """One etcd member on loopback. Use as a context manager, or :meth:`start` / :meth:`stop`.

    The client port is reserved (:func:`~elastic_emb.testing.ports.free_port`) until the process ends.

    Args:
        data_dir: the directory for the member's data and its log (``etcd.log``).
        host: a loopback address to listen on.
        start_timeout: seconds :meth:`start` waits for health.
        stop_timeout: seconds :meth:`stop` waits after SIGTERM before SIGKILL.
        name: the member's name.
        peer_port: the peer port; default a free one.
        initial_cluster: every member's ``name=peer URL`` (see :func:`command`).
        tls: serve the client port over HTTPS with client certificates.

    Raises:
        ValueError: if ``host`` is not in 127.0.0.0/8.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        start_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        name: str = "drill",
        peer_port: int | None = None,
        initial_cluster: str | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        if not host.startswith("127."):
            raise ValueError(f"host={host!r}: the test etcd listens on loopback (127.0.0.0/8) only")
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.client_port = free_port()  # reserved until the process ends: etcd binds it with SO_REUSEADDR
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "etcd.log"
        self.started_in: float | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` for ``torchrun --rdzv-endpoint``."""
        return f"{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Start the process without waiting for it to be healthy (a cluster's members must all
        be started before any of them can elect a leader). Does nothing while it runs.

        Raises:
            EtcdUnavailable: if the etcd binary is not installed.
        """
        binary = etcd_binary()
        if binary is None:
            raise EtcdUnavailable(
                f"etcd is not installed: `apt-get install etcd-server` (Debian), or set {ETCD_BINARY_ENV} to its path"
            )
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                command(
                    binary,
                    self.data_dir / "member",
                    self.host,
                    self.client_port,
                    self.peer_port,
                    self.name,
                    self.initial_cluster,
                    self.tls,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal is for the test runner, not etcd
            )

    def start(self) -> "EtcdServer":
        """Start the member (again on the same ports and data after :meth:`kill`) and wait until healthy.

        Returns:
            This server.

        Raises:
            EtcdUnavailable: if the etcd binary is not installed.
            RuntimeError: if etcd exits before it is healthy (it is stopped).
            TimeoutError: if it is not healthy within ``start_timeout`` (it is stopped).
        """
        if self.running:
            return self
        self.launch()
        try:
            self.started_in = wait_healthy(
                self.url, self.proc, self.start_timeout, self.log_path, self.tls.context() if self.tls else None
            )
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL (a drill fault): the data directory stays, start() brings the member back."""
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(self.stop_timeout)

    def stop(self) -> None:
        """SIGTERM the member, then SIGKILL after ``stop_timeout``; the data directory stays."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(self.stop_timeout)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster, named ``m0`` to ``m<size-1>``.

    ``kill(member)`` SIGKILLs one member (default: the leader) and ``start()`` brings back every
    member that is down, on its ports and data; the others keep serving meanwhile (a quorum of
    ``size // 2 + 1`` survives the loss of ``(size - 1) // 2`` members).

    Args:
        data_dir: the directory holding one data directory per member (``m0``, ``m1``, ...).
        size: members, 1 to 7.
        host: a loopback address to listen on.
        start_timeout: seconds :meth:`start` waits for every member's health, in all.
        stop_timeout: seconds each member's stop waits after SIGTERM.

    Raises:
        ValueError: if ``size`` is not in 1..7.
    """

    def __init__(
        self,
        data_dir: str | Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
    ) -> None:
        if not 1 <= size <= 7:
            raise ValueError(f"size={size}: an etcd cluster for tests has 1 to 7 members (3 or 5 in production)")
        data_dir = Path(data_dir)
        peers = [free_port() for _ in range(size)]
        initial = ",".join(f"m{i}=http://{host}:{p}" for i, p in enumerate(peers))
        self.members = [
            EtcdServer(
                data_dir / f"m{i}",
                host=host,
                start_timeout=start_timeout,
                stop_timeout=stop_timeout,
                name=f"m{i}",
                peer_port=p,
                initial_cluster=initial,
            )
            for i, p in enumerate(peers)
        ]
        self.start_timeout = start_timeout
        self.started_in: float | None = None
        self.killed: list[int] = []

    @property
    def host(self) -> str:
        return self.members[0].host

    @property
    def endpoint(self) -> str:
        """Every member's ``HOST:PORT``, comma-separated (``--rdzv-endpoint`` of ``inner=etcd-v3``)."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def running(self) -> bool:
        return all(m.running for m in self.members)

    def start(self) -> "EtcdCluster":
        """Launch every member that is down, then wait until each of them is healthy.

        Returns:
            This cluster.

        Raises:
            EtcdUnavailable: if the etcd binary is not installed.
            RuntimeError: if a member exits before it is healthy (the cluster is stopped).
            TimeoutError: if a member is not healthy within ``start_timeout`` (the cluster is stopped).
        """
        start = time.monotonic()
        down = [m for m in self.members if not m.running]
        for m in down:
            m.launch()
        try:
            for m in down:
                left = max(1.0, self.start_timeout - (time.monotonic() - start))
                wait_healthy(m.url, m.proc, left, m.log_path)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - start
        return self

    def leader(self, timeout: float = 2.0) -> int | None:
        """The member that currently leads, from the live members' v3 status.

        Args:
            timeout: seconds for each member's status request.

        Returns:
            Its index, or None when no live member knows a leader.
        """
        ids = {}
        leader_id = None
        for i, m in enumerate(self.members):
            if not m.running:
                continue
            try:
                req = urllib.request.Request(f"{m.url}/v3/maintenance/status", data=b"{}", method="POST")
                with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
                    status = json.loads(r.read())
            except (OSError, ValueError, urllib.error.URLError):
                continue
            ids[str(status.get("header", {}).get("member_id"))] = i
            leader_id = str(status.get("leader")) if status.get("leader") else leader_id
        return ids.get(leader_id) if leader_id is not None else None

    def kill(self, member: int | None = None) -> int:
        """SIGKILL one member; its data stays, and :meth:`start` brings it back.

        Args:
            member: the member's index; default the leader, else member 0.

        Returns:
            The index of the member killed.

        Raises:
            ValueError: if ``member`` is out of range.
        """
        index = member if member is not None else self.leader()
        index = 0 if index is None else index
        if not 0 <= index < len(self.members):
            raise ValueError(f"member={index}: the cluster has members 0..{len(self.members) - 1}")
        self.members[index].kill()
        self.killed.append(index)
        return index

    def stop(self) -> None:
        """Stop every member (:meth:`EtcdServer.stop`)."""
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
