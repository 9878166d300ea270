"""A real etcd server on loopback for tests (Debian's etcd-server; nothing starts it for you).

``with EtcdServer(data_dir) as server:`` starts ``etcd`` with the v2 API on (torch's ``etcd-v2``
rendezvous and python-etcd speak v2), waits until ``/version`` answers (bounded), and on exit
terminates it (SIGKILL after 5 s). ``server.endpoint`` is ``127.0.0.1:PORT`` for
``--rdzv-endpoint``. (Not named ``etcd.py``: tests/ is on sys.path and would shadow python-etcd.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

from procs import free_port


class EtcdServer:
    def __init__(self, data_dir: str, start_timeout: float = 20.0) -> None:
        self.data_dir = data_dir
        self.start_timeout = start_timeout
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "EtcdServer":
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: apt-get install etcd-server (listed in .ci/apt-packages)")
        os.makedirs(self.data_dir, exist_ok=True)
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", os.path.join(self.data_dir, "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--enable-v2=true", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(f"{client}/v2/keys", timeout=1) as r:  # noqa: S310 - loopback
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise TimeoutError(f"etcd did not answer on {client} within {self.start_timeout}s; see {self._log.name}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
