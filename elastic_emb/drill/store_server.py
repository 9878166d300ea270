"""``python -m elastic_emb.drill.store_server --host H --port P``: a rendezvous TCPStore host.

The drill hosts the rendezvous store in a process of its own (in the hub namespace when nodes
are namespaces), so that any node, node 0 included, can be killed. It serves until killed, or
for ``--lifetime`` seconds at most.

Design: ``docs/DRILLS.md`` (section "The rendezvous store").
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from datetime import timedelta


def wait_listening(host: str, port: int, proc: subprocess.Popen, *, timeout: float, netns: str | None = None) -> None:
    """Block until ``host:port`` accepts connections.

    Args:
        host: the server's address.
        port: the server's port.
        proc: the server process, watched so that its exit ends the wait.
        timeout: seconds to wait at most.
        netns: probe from inside this network namespace (``ip netns exec``); None probes from here.

    Raises:
        RuntimeError: if the server exits before it listens.
        TimeoutError: if it does not listen within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"store server on {host}:{port} exited with {proc.returncode} before listening")
        if netns is None:
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                pass
        else:
            probe = subprocess.run(
                ["ip", "netns", "exec", netns, "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"],
                capture_output=True,
                timeout=5,
            )
            if probe.returncode == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"store server on {host}:{port} did not listen within {timeout}s")


def main() -> None:
    """Serve a TCPStore (the master, multi-tenant) on ``--host``/``--port`` until killed or ``--lifetime`` ends."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lifetime", type=float, default=3600.0, help="Exit after this many seconds at most.")
    args = p.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore(
        args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60), multi_tenant=True
    )
    print(f"store listening on {args.host}:{args.port}", flush=True)
    deadline = time.monotonic() + args.lifetime
    while time.monotonic() < deadline:
        time.sleep(1.0)
    del store


if __name__ == "__main__":
    main()
