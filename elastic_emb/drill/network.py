"""Where the simulated nodes live on the network: loopback, or one network namespace per node.

``loopback``: every agent on 127.0.0.1, told apart by ports only. Works everywhere, unprivileged.

``netns`` (root and a working ``ip netns``): each node gets a network namespace of its own with
one veth interface and an address ``10.X.0.(10+n)/24`` on a bridge that lives in a "hub"
namespace the drill also made; the drill's rendezvous store runs in the hub at ``10.X.0.1``.
So a node is a separate host in the sense that matters here: its own address, its own
loopback, and when it is killed every process in its namespace is found by ``ip netns pids``.
All traffic stays between namespaces the drill created (nothing is routed out of the hub), and
:meth:`Netns.teardown` deletes them all. ``GLOO_SOCKET_IFNAME`` points gloo at the node's veth
(gloo would otherwise resolve the shared hostname to an address the namespace does not have).

``auto`` picks netns when :func:`netns_works` proves, by making and deleting a namespace with a
veth pair, that it can; otherwise loopback.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
from pathlib import Path

from elastic_emb.drill import procs
import structlog

from elastic_emb.events import configure_logging

# A lazy proxy (not get_logger(), which binds now): it follows a later configure_logging(), so
# the CLI can turn the drill's info events down after this module was imported.
configure_logging()
log = structlog.get_logger("elastic_emb.drill")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class Network:
    kind = "loopback"
    store_addr = "127.0.0.1"

    def setup(self, max_nodes: int) -> None:
        pass

    def node_addr(self, number: int) -> str:
        return "127.0.0.1"

    def node_env(self, number: int) -> dict:
        return {}

    def wrap(self, cmd: list[str], number: int) -> list[str]:
        return cmd

    def spawn_store(self, python: str, port: int, log_path: Path) -> subprocess.Popen:
        """A TCPStore server process (the rendezvous store the drill hosts)."""
        return self._popen([python, "-m", "elastic_emb.drill.store_server", "--host", self.store_addr,
                            "--port", str(port)], log_path)

    def _popen(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as logf:
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        # Wait (bounded) until it listens, so agents never race its start.
        from elastic_emb.drill.store_server import wait_listening

        wait_listening(self.store_addr, int(cmd[cmd.index("--port") + 1]), p, timeout=30.0, netns=self.hub_ns())
        return p

    def hub_ns(self) -> str | None:
        return None

    def kill_node(self, number: int, agent_pid: int) -> list[int]:
        return procs.kill_tree(agent_pid, signal.SIGKILL)

    def teardown(self) -> None:
        pass


class Netns(Network):
    kind = "netns"

    def __init__(self, tag: str) -> None:
        digest = hashlib.sha1(f"{tag}-{os.getpid()}-{id(self)}".encode()).hexdigest()
        # The creating pid is in every name, so a later drill can remove what a killed one left.
        # (veth names are limited to 15 characters: "e" + 7 digits + "x" + 3 + "h" + node.)
        self.id = f"{os.getpid()}x{digest[:3]}"
        self.subnet = 100 + int(digest[5:7], 16) % 150  # 10.<100..249>.0.0/24
        self.store_addr = f"10.{self.subnet}.0.1"
        self.hub = f"ee{self.id}hub"
        self.made: list[str] = []

    def ns(self, number: int) -> str:
        return f"ee{self.id}n{number}"

    def hub_ns(self) -> str:
        return self.hub

    def setup(self, max_nodes: int) -> None:
        remove_stale_namespaces()
        _ip("netns", "add", self.hub)
        self.made.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.store_addr}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for n in range(max_nodes):
            ns, outer = self.ns(n), f"e{self.id}h{n}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", outer, "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", outer, "master", "br0")
            _ip("-n", self.hub, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_addr(n)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        log.info("drill_netns_ready", hub=self.hub, nodes=max_nodes, subnet=f"10.{self.subnet}.0.0/24")

    def node_addr(self, number: int) -> str:
        return f"10.{self.subnet}.0.{10 + number}"

    def node_env(self, number: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": "eth0"}

    def wrap(self, cmd: list[str], number: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(number), *cmd]

    def spawn_store(self, python: str, port: int, log_path: Path) -> subprocess.Popen:
        cmd = ["ip", "netns", "exec", self.hub, python, "-m", "elastic_emb.drill.store_server",
               "--host", self.store_addr, "--port", str(port)]
        return self._popen(cmd, log_path)

    def _pids(self, ns: str) -> list[int]:
        r = _ip("netns", "pids", ns, check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_node(self, number: int, agent_pid: int) -> list[int]:
        pids = sorted(set(procs.descendants(agent_pid)) | set(self._pids(self.ns(number))) | {agent_pid})
        return procs.signal_all(pids, signal.SIGKILL)

    def teardown(self) -> None:
        for ns in reversed(self.made):
            procs.signal_all(self._pids(ns), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        self.made.clear()


STALE = re.compile(r"^ee(\d+)x[0-9a-f]{3}(hub|n\d+)$")


def remove_stale_namespaces() -> list[str]:
    """Delete drill namespaces whose creating process is gone (a drill that was SIGKILLed)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ")[0].strip()
        m = STALE.match(name)
        if not m or procs.alive(int(m.group(1))):
            continue
        pids = [int(x) for x in _ip("netns", "pids", name, check=False).stdout.split()]
        procs.signal_all(pids, signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    if removed:
        log.warning("drill_stale_namespaces_removed", namespaces=removed)
    return removed


def netns_works() -> tuple[bool, str]:
    """Can this process make namespaces joined by a veth pair? (root, iproute2, kernel support)."""
    if os.geteuid() != 0:
        return False, "not root"
    tag = f"eeprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", tag)
        try:
            _ip("link", "add", f"{tag[:11]}a", "type", "veth", "peer", "name", "eth0", "netns", tag)
            _ip("-n", tag, "link", "set", "lo", "up")
            _ip("-n", tag, "addr", "add", "10.254.0.2/24", "dev", "eth0")
            _ip("link", "del", f"{tag[:11]}a", check=False)
        finally:
            _ip("netns", "del", tag, check=False)
        return True, "ok"
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return False, f"ip netns failed: {detail.strip()[:200]}"


def pick_network(choice: str, tag: str) -> Network:
    if choice == "loopback":
        return Network()
    ok, why = netns_works()
    if choice == "netns" and not ok:
        raise RuntimeError(f"network='netns' asked for, but namespaces do not work here ({why}); use network='loopback'")
    if not ok:
        log.info("drill_network_loopback", reason=why)
        return Network()
    return Netns(tag)
