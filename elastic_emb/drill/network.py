"""Where the simulated nodes live on the network: loopback, or one network namespace per node.

- :class:`Network`: every node on 127.0.0.1, told apart by ports (works everywhere, unprivileged);
- :class:`Netns`: each node in a network namespace of its own, with its own address on a bridge
  in a hub namespace that also hosts the drill's rendezvous store (needs root and ``ip netns``);
- :func:`pick_network`: the one a scenario's ``network`` asks for (``auto``: netns when
  :func:`netns_works` proves it can, else loopback).

Design: ``docs/DRILLS.md`` (section "Network").
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
from pathlib import Path

import structlog

from elastic_emb.drill import procs
from elastic_emb.events import configure_logging

# A lazy proxy (not get_logger(), which binds now): it follows a later configure_logging(), so
# the CLI can turn the drill's info events down after this module was imported.
configure_logging()
log = structlog.get_logger("elastic_emb.drill")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class Network:
    """Loopback: every node on 127.0.0.1. The base class of :class:`Netns`."""

    kind = "loopback"
    store_addr = "127.0.0.1"

    def setup(self, max_nodes: int) -> None:
        """Prepare room for the nodes (nothing to do on loopback).

        Args:
            max_nodes: how many nodes the drill may start in all.
        """
        pass

    def node_addr(self, number: int) -> str:
        """The address node ``number``'s agent uses (``torchrun --local-addr``).

        Args:
            number: the node's number.

        Returns:
            ``127.0.0.1``.
        """
        return "127.0.0.1"

    def node_env(self, number: int) -> dict:
        """Environment variables node ``number``'s agent needs on this network.

        Args:
            number: the node's number.

        Returns:
            No variables on loopback.
        """
        return {}

    def wrap(self, cmd: list[str], number: int) -> list[str]:
        """The command line that runs ``cmd`` as node ``number``.

        Args:
            cmd: the agent's command line.
            number: the node's number.

        Returns:
            ``cmd`` unchanged on loopback.
        """
        return cmd

    def spawn_store(self, python: str, port: int, log_path: Path) -> subprocess.Popen:
        """Start the rendezvous TCPStore the drill hosts, in a process of its own, and wait until it listens.

        Args:
            python: the interpreter to run :mod:`elastic_emb.drill.store_server` with.
            port: the port to serve on (at :attr:`store_addr`).
            log_path: file that receives the server's output (appended).

        Returns:
            The server process, in a session of its own.

        Raises:
            RuntimeError: if the server exits before it listens.
            TimeoutError: if it does not listen within 30 seconds.
        """
        return self._popen(
            [python, "-m", "elastic_emb.drill.store_server", "--host", self.store_addr, "--port", str(port)], log_path
        )

    def _popen(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as logf:
            p = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        # Wait (bounded) until it listens, so agents never race its start.
        from elastic_emb.drill.store_server import wait_listening

        wait_listening(self.store_addr, int(cmd[cmd.index("--port") + 1]), p, timeout=30.0, netns=self.hub_ns())
        return p

    def hub_ns(self) -> str | None:
        """The namespace that hosts the store; None on loopback."""
        return None

    def kill_node(self, number: int, agent_pid: int) -> list[int]:
        """SIGKILL a whole node: its agent and every descendant (collected before the signal).

        Args:
            number: the node's number.
            agent_pid: the pid of the node's torchrun agent.

        Returns:
            The pids signalled.
        """
        return procs.kill_tree(agent_pid, signal.SIGKILL)

    def teardown(self) -> None:
        """Remove what :meth:`setup` made (nothing on loopback)."""
        pass


class Netns(Network):
    """One network namespace per node, joined by veth pairs to a bridge in a hub namespace.

    Every name holds the creating process's pid, so :func:`remove_stale_namespaces` can remove
    what a killed drill left behind.

    Args:
        tag: a string that, with the pid, seeds the names and the ``10.X.0.0/24`` subnet.
    """

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
        """The namespace name of node ``number``.

        Args:
            number: the node's number.

        Returns:
            ``ee<id>n<number>``.
        """
        return f"ee{self.id}n{number}"

    def hub_ns(self) -> str:
        """The hub namespace, which holds the bridge and the drill's store.

        Returns:
            Its name.
        """
        return self.hub

    def setup(self, max_nodes: int) -> None:
        """Make the hub (bridge at :attr:`store_addr`) and one namespace per node, each with its veth.

        Stale namespaces of drills that were killed are removed first.

        Args:
            max_nodes: how many node namespaces to make.

        Raises:
            subprocess.CalledProcessError: if an ``ip`` command fails.
        """
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
        """The address of node ``number`` in its namespace.

        Args:
            number: the node's number.

        Returns:
            ``10.X.0.(10 + number)``.
        """
        return f"10.{self.subnet}.0.{10 + number}"

    def node_env(self, number: int) -> dict:
        """Point gloo at the node's veth (the shared hostname resolves to an address the namespace lacks).

        Args:
            number: the node's number.

        Returns:
            ``{"GLOO_SOCKET_IFNAME": "eth0"}``.
        """
        return {"GLOO_SOCKET_IFNAME": "eth0"}

    def wrap(self, cmd: list[str], number: int) -> list[str]:
        """Run ``cmd`` inside node ``number``'s namespace.

        Args:
            cmd: the agent's command line.
            number: the node's number.

        Returns:
            ``ip netns exec <namespace> cmd...``.
        """
        return ["ip", "netns", "exec", self.ns(number), *cmd]

    def spawn_store(self, python: str, port: int, log_path: Path) -> subprocess.Popen:
        """Start the rendezvous TCPStore in the hub namespace and wait until it listens.

        Args:
            python: the interpreter to run :mod:`elastic_emb.drill.store_server` with.
            port: the port to serve on (at :attr:`store_addr`).
            log_path: file that receives the server's output (appended).

        Returns:
            The server process (``ip netns exec`` running it).

        Raises:
            RuntimeError: if the server exits before it listens.
            TimeoutError: if it does not listen within 30 seconds.
        """
        cmd = [
            "ip",
            "netns",
            "exec",
            self.hub,
            python,
            "-m",
            "elastic_emb.drill.store_server",
            "--host",
            self.store_addr,
            "--port",
            str(port),
        ]
        return self._popen(cmd, log_path)

    def _pids(self, ns: str) -> list[int]:
        r = _ip("netns", "pids", ns, check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_node(self, number: int, agent_pid: int) -> list[int]:
        """SIGKILL every process of node ``number``: the agent, its descendants, and all in its namespace.

        Args:
            number: the node's number.
            agent_pid: the pid of the node's torchrun agent.

        Returns:
            The pids signalled.
        """
        pids = sorted(set(procs.descendants(agent_pid)) | set(self._pids(self.ns(number))) | {agent_pid})
        return procs.signal_all(pids, signal.SIGKILL)

    def teardown(self) -> None:
        """SIGKILL every process left in the namespaces this object made, then delete them."""
        for ns in reversed(self.made):
            procs.signal_all(self._pids(ns), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        self.made.clear()


STALE = re.compile(r"^ee(\d+)x[0-9a-f]{3}(hub|n\d+)$")


def remove_stale_namespaces() -> list[str]:
    """Delete drill namespaces whose creating process is gone (a drill that was SIGKILLed).

    Returns:
        The names of the namespaces removed.
    """
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
    """Whether this process can make namespaces joined by a veth pair (root, iproute2, kernel support).

    Tries it: makes a namespace with a veth pair and an address, then deletes it.

    Returns:
        ``(True, "ok")``, or ``(False, why)``.
    """
    if os.geteuid() != 0:
        return False, "not root"
    # Unique per process, whole: two test workers probe at once, and their pids often differ in
    # the last digit only. The veth's outer end lives in the root namespace, whose interface
    # names are at most 15 characters ("eep" + a pid of at most 7 digits + "a").
    tag, outer = f"eeprobe{os.getpid()}", f"eep{os.getpid()}a"
    try:
        # names with this pid that exist now are a killed probe's (an earlier process of this pid)
        _ip("link", "del", outer, check=False)
        _ip("netns", "del", tag, check=False)
        _ip("netns", "add", tag)
        try:
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", tag)
            _ip("-n", tag, "link", "set", "lo", "up")
            _ip("-n", tag, "addr", "add", "10.254.0.2/24", "dev", "eth0")
            _ip("link", "del", outer, check=False)
        finally:
            _ip("netns", "del", tag, check=False)
        return True, "ok"
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return False, f"ip netns failed: {detail.strip()[:200]}"


def pick_network(choice: str, tag: str) -> Network:
    """The network a scenario asks for.

    Args:
        choice: ``"loopback"``, ``"netns"``, or ``"auto"`` (netns when it works, else loopback).
        tag: passed to :class:`Netns` to name its namespaces.

    Returns:
        A :class:`Network` (loopback) or a :class:`Netns`, not yet set up.

    Raises:
        RuntimeError: if ``choice`` is ``"netns"`` and namespaces do not work here.
    """
    if choice == "loopback":
        return Network()
    ok, why = netns_works()
    if choice == "netns" and not ok:
        raise RuntimeError(
            f"network='netns' asked for, but namespaces do not work here ({why}); use network='loopback'"
        )
    if not ok:
        log.info("drill_network_loopback", reason=why)
        return Network()
    return Netns(tag)
