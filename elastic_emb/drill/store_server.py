"""``python -m elastic_emb.drill.store_server --host H --port P``: a rendezvous TCPStore host.

The drill hosts the c10d rendezvous store in a process of its own (in the hub namespace when
nodes are namespaces), so that killing any node, node 0 included, is a fair fault: with torch's
embedded store the first agent hosts it, and its death ends the job. It serves until killed
(bounded by ``--lifetime``, so a leaked server cannot outlive a test run by much).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from datetime import timedelta


def wait_listening(host: str, port: int, proc: subprocess.Popen, *, timeout: float, netns: str | None = None) -> None:
    """Block until ``host:port`` accepts connections; raise naming the log if the server died."""
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
            probe = subprocess.run(["ip", "netns", "exec", netns, "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"],
                                   capture_output=True, timeout=5)
            if probe.returncode == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"store server on {host}:{port} did not listen within {timeout}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lifetime", type=float, default=3600.0, help="Exit after this many seconds at most.")
    args = p.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60), multi_tenant=True)
    print(f"store listening on {args.host}:{args.port}", flush=True)
    deadline = time.monotonic() + args.lifetime
    while time.monotonic() < deadline:
        time.sleep(1.0)
    del store


if __name__ == "__main__":
    main()
