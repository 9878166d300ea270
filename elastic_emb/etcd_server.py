"""A real etcd server for drills and tests: the rendezvous store that outlives every node.

With torch's ``c10d`` rendezvous the store lives inside one torchrun agent (``is_host``): when
that node dies the rendezvous dies with it. With ``--rdzv-conf inner=etcd-v2`` the elastic_emb
backend keeps the rendezvous in etcd instead, so any node, the first one included, can be lost.
On Kubernetes etcd runs as its own service; on one machine (drills, tests) this module starts
Debian's ``etcd`` (package ``etcd-server``, 3.4) as a child process:

- on free loopback ports (client and peer), in a data directory the caller owns;
- with the v2 API enabled (torch's ``etcd-v2`` rendezvous and python-etcd speak v2);
- ``start()`` waits for ``/health`` to report healthy, bounded by ``start_timeout``, and raises
  naming the log file when etcd exits or never gets healthy;
- ``stop()`` sends SIGTERM, then SIGKILL after ``stop_timeout``; ``kill()`` is the fault a drill
  injects (SIGKILL, data directory kept) and ``start()`` again restarts it on the same ports
  with the same data, as a restarted etcd member would.

``command()`` is exposed separately so a caller that must start the process elsewhere (inside a
network namespace, say) builds the same command line and uses :func:`wait_healthy`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from elastic_emb.errors import EtcdUnavailable  # noqa: F401 - also importable from here
from elastic_emb.testing.ports import free_port

ETCD_BINARY_ENV = "ELASTIC_EMB_ETCD"  # path of the etcd binary, when it is not `etcd` on PATH


def etcd_binary() -> str | None:
    return os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd")


def command(binary: str, data_dir: Path, host: str, client_port: int, peer_port: int, name: str = "drill") -> list[str]:
    """The etcd command line of a one-member cluster listening on ``host`` only."""
    client = f"http://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    return [
        binary, "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}", "--initial-cluster-state", "new",
        "--enable-v2=true", "--log-level", "warn",
        # A test store: no fsync per write (the data dir is a temp dir) keeps it fast on a busy disk.
        "--unsafe-no-fsync",
    ]


def health(url: str, timeout: float = 1.0) -> bool:
    """Whether etcd at ``url`` answers ``/health`` with ``{"health": "true"}``."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:  # noqa: S310 - loopback only
            return r.status == 200 and json.loads(r.read() or b"{}").get("health") == "true"
    except (OSError, ValueError, urllib.error.URLError):
        return False


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> float:
    """Block until etcd at ``url`` is healthy; return the seconds it took. Raises on exit or timeout."""
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"etcd exited with {proc.returncode} before it was healthy (log {log}):\n{tail}")
        if health(url, timeout=min(1.0, max(0.05, deadline - time.monotonic()))):
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(f"etcd at {url} was not healthy within {timeout}s (log {log}); raise start_timeout or "
                       f"check that the ports are free")


class EtcdServer:
    """One etcd member on loopback. Use as a context manager, or start()/stop()."""

    def __init__(self, data_dir: str | Path, *, host: str = "127.0.0.1", start_timeout: float = 20.0,
                 stop_timeout: float = 5.0) -> None:
        if not host.startswith("127."):
            raise ValueError(f"host={host!r}: the test etcd listens on loopback (127.0.0.0/8) only")
        self.data_dir = Path(data_dir)
        self.host = host
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.client_port = free_port()  # reserved until the process ends: etcd binds it with SO_REUSEADDR
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "etcd.log"
        self.started_in: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` for ``torchrun --rdzv-endpoint``."""
        return f"{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "EtcdServer":
        binary = etcd_binary()
        if binary is None:
            raise EtcdUnavailable(
                f"etcd is not installed: `apt-get install etcd-server` (Debian), or set {ETCD_BINARY_ENV} to its path"
            )
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                command(binary, self.data_dir / "member", self.host, self.client_port, self.peer_port),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal is for the test runner, not etcd
            )
        try:
            self.started_in = wait_healthy(self.url, self.proc, self.start_timeout, self.log_path)
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
