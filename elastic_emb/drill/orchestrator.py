"""The drill orchestrator: real torchrun agents, real faults, bounded waits, nothing left behind.

- :class:`Drill`: runs one scenario end to end, one ``torchrun`` agent per simulated node, then
  verifies the final tables against the reference replay;
- :class:`DrillResult`: what happened (progress events, faults fired, nodes), for the report;
- :class:`EventReader`: reads the workers' progress lines as they are written;
- :func:`worker_error`: the cause of a node's failure, from its log.

Design: ``docs/DRILLS.md`` (section "The orchestrator").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

from elastic_emb.drill import procs
from elastic_emb.drill.errors import DrillError
from elastic_emb.drill.network import Network, pick_network
from elastic_emb.drill.replay import EXAMPLE, LossDetected, verify
from elastic_emb.drill.scenario import Fault, Scenario
from elastic_emb.events import configure_logging
from elastic_emb.testing.ports import free_port

# A lazy proxy (not get_logger(), which binds now): it follows a later configure_logging(), so
# the CLI can turn the drill's info events down after this module was imported.
configure_logging()
log = structlog.get_logger("elastic_emb.drill")


# How long a fault's slow-down waits for the world it leads to: long enough for a join in restart
# mode on a loaded machine (the new agent's start, a drain, every worker restarted).
AWAIT_S = 120.0


@dataclass
class Node:
    """One simulated node: its torchrun agent process, its log, and what became of it."""

    number: int
    proc: subprocess.Popen
    log_path: Path
    started: float
    state: str = "running"  # running | leaving | left | killed | exited
    exit_code: int | None = None
    ended: float | None = None

    @property
    def name(self) -> str:
        return f"node{self.number}"


@dataclass
class FiredFault:
    """A fault the drill injected: which, when (wall clock and committed step), on which node, and what it did."""

    index: int
    fault: Fault
    t: float
    step: int
    node: int | None
    detail: dict = field(default_factory=dict)

    def as_dict(self, t0: float) -> dict:
        """The fault as a report record.

        Args:
            t0: the drill's start (``time.time()``), from which ``t`` is counted.

        Returns:
            Index, kind, trigger, node, seconds since ``t0``, committed step, and the detail.
        """
        return {
            "index": self.index,
            "kind": self.fault.kind,
            "trigger": self.fault.when(),
            "node": self.node,
            "t": round(self.t - t0, 3),
            "committed_step": self.step,
            **self.detail,
        }


class EventReader:
    """Incremental reader of the workers' JSON-lines progress files.

    Args:
        directory: the directory of ``*.jsonl`` files (``<out>/run/events``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        """Read the complete lines written since the last call (also kept in :attr:`events`).

        A torn line (a process killed mid-write) is skipped; a partial last line waits for the next call.

        Returns:
            The new events, sorted by their time.
        """
        new: list[dict] = []
        if not self.directory.is_dir():
            return new
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = offset + end + 1
            for line in chunk[: end + 1].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue  # a torn line from a killed process: skip it
        new.sort(key=lambda e: e.get("t", 0))
        self.events.extend(new)
        return new


@dataclass
class DrillResult:
    """The outcome of :meth:`Drill.run`: the verdict (``ok``), the verification, and what happened."""

    scenario: Scenario
    out: Path
    ok: bool
    verification: dict
    error: str | None
    t0: float
    t_end: float
    events: list[dict]
    faults: list[FiredFault]
    nodes: list[Node]
    network: str
    orphans_alive_at_end: list[int] = field(default_factory=list)
    report: dict = field(default_factory=dict)


class Drill:
    """Run one scenario end to end: ``Drill(scenario, out).run()`` returns a :class:`DrillResult`.

    Args:
        scenario: the drill to run.
        out: the output directory (made, or replaced when it holds an earlier drill).
        script: the training script; the packaged recsys example by default, in which case the
            scenario's ``workload`` picks the packaged script.
        on_progress: called with a status dict on every turn of the loop, and once before verifying.
        python: the interpreter of the agents and the store server.
        metrics_port: serve Prometheus metrics on 127.0.0.1: node ``n``'s agent on
            ``metrics_port + n * (nproc_per_node + 1)``, its workers on the ports after it; None: off.
    """

    def __init__(
        self,
        scenario: Scenario,
        out: Path | str,
        *,
        script: Path | str = EXAMPLE,
        on_progress: Callable[[dict], None] | None = None,
        python: str = sys.executable,
        metrics_port: int | None = None,
    ) -> None:
        self.scenario = scenario
        self.metrics_port = metrics_port
        self.out = Path(out).resolve()
        if scenario.workload != "recsys" and Path(script).resolve() == Path(EXAMPLE).resolve():
            from elastic_emb.examples import WORKLOADS

            script = WORKLOADS[scenario.workload]  # the scenario names its own packaged workload
        self.script = Path(script).resolve()
        self.on_progress = on_progress or (lambda status: None)
        self.python = python
        self.nodes: dict[int, Node] = {}
        self.fired: list[FiredFault] = []
        self.network: Network | None = None
        self.store = None
        self.store_proc: subprocess.Popen | None = None
        self.etcd = None  # elastic_emb.testing.etcd.EtcdCluster when store == "etcd"
        self.gpus: dict[int, list[int]] = {}  # node -> GPU indices (backend nccl)
        self.orphans_alive: list[int] = []
        self.late_joiners: set[str] = set()  # nodes whose join came after the job finished
        self.store_back_at: float | None = None
        self.max_step = -1
        self.world = 0
        self.t0 = 0.0
        self.t_first_step: float | None = None
        self.slow_file = self.out / "run" / "slow"
        self.rank0_pid: int | None = None
        # (rank 0's pid and generation at the fault, the world size it leads to or None, deadline)
        self.awaiting: tuple[int | None, int, int | None, float] | None = None
        self.generation = -1  # the newest generation seen stepping
        # A commit complete in a generation, per rank: {generation: {rank: its first step there}} and
        # {generation: ranks whose progress said a commit of that generation is complete}. A new world
        # counts as in only once every rank has one (commits are written in the background: the first
        # steps of a world may have none yet, and a fault then would leave nothing to restore from).
        self.first_step_in: dict[int, dict[int, int]] = {}
        self.committed_in: dict[int, set[int]] = {}
        self.history = scenario.simulate()  # the live nodes after each fault

    # -- set-up ---------------------------------------------------------------------------------

    def _prepare_out(self) -> None:
        if self.out.exists():
            # Only ever remove a directory a drill made (it holds our marker), never a user's.
            if not (self.out / "scenario.json").exists() and any(self.out.iterdir()):
                raise DrillError(f"--out {self.out} exists and is not a drill directory; choose an empty or new one")
            shutil.rmtree(self.out)
        for sub in ("run/events", "run/final", "state", "logs"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        (self.out / "scenario.json").write_text(self.scenario.model_dump_json(indent=2))

    def _start_store(self) -> tuple[str, int, dict]:
        """The rendezvous endpoint and the rdzv-conf keys that say who hosts its store."""
        host = self.network.store_addr
        if self.scenario.store == "drill":
            port = free_port()
            self.store_proc = self.network.spawn_store(self.python, port, self.out / "logs" / "store.log")
            return host, port, {"is_host": "false"}
        if self.scenario.store == "agent":
            return self.network.node_addr(0), free_port(), {}
        from elastic_emb.testing.etcd import EtcdCluster, EtcdUnavailable

        # etcd listens on loopback only (EtcdServer refuses other hosts), so etcd drills run on
        # loopback: pick_network() is told so in run().
        self.etcd = EtcdCluster(self.out / "etcd", self.scenario.etcd_members, host="127.0.0.1", start_timeout=30.0)
        try:
            self.etcd.start()
        except EtcdUnavailable as exc:
            raise DrillError(f"store='etcd': {exc}") from None
        host, port = self.etcd.members[0].endpoint.rsplit(":", 1)
        return host, int(port), {"inner": f"etcd-{self.scenario.etcd_api}"}

    def _agent_cmd(self, number: int) -> list[str]:
        s = self.scenario
        # Heartbeat expiry 3 s; 8 s from 8 workers up: that many processes on a loaded machine can
        # starve an agent past 3 s between its join and its round's end, and torch would drop it as
        # dead before the first step.
        attempts = 3 if s.initial_nodes * s.nproc_per_node < 8 else 8
        conf = {
            "join_timeout": 90,
            "last_call_timeout": 1,
            "close_timeout": 5,
            "keep_alive_interval": 1,
            "keep_alive_max_attempt": attempts,
            "read_timeout": 60,
            **self.store_conf,
        }
        if s.store == "agent":
            conf["is_host"] = "true" if number == 0 else "false"
        if s.mode == "in_process":
            conf["resize"] = "in_process"
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={s.min_nodes}:{s.max_nodes}",
            f"--nproc-per-node={s.nproc_per_node}",
            f"--rdzv-backend={s.rendezvous}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id=drill-{s.name}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
            f"--max-restarts={s.max_restarts}",
            "--monitor-interval=0.1",
            f"--local-addr={self.network.node_addr(number)}",
            str(self.script),
            "--steps",
            str(s.steps),
            "--batch",
            str(s.batch),
            "--seed",
            str(s.seed),
            "--step-delay",
            str(s.step_delay),
            "--out",
            str(self.out / "run"),
            "--checksums",
            "--slow-file",
            str(self.slow_file),
            "--slow-delay",
            str(s.slow_delay),
        ]

    def _gpu_env(self, number: int) -> dict:
        """Node ``number`` gets ``nproc_per_node`` GPUs that no live node holds."""
        import torch

        count = torch.cuda.device_count()
        n = self.scenario.nproc_per_node
        if count < n:
            raise DrillError(f"backend='nccl' needs {n} GPU(s) per node; this machine has {count}: use backend='gloo'")
        # The lowest GPUs no live node holds: a joiner must not share a GPU with a survivor (NCCL
        # refuses a communicator with a duplicate GPU).
        held = {
            d
            for k, devs in self.gpus.items()
            if k in self.nodes and self.nodes[k].exit_code is None and self.nodes[k].state in ("running", "leaving")
            for d in devs
        }
        free = [d for d in range(count) if d not in held]
        if len(free) < n:
            raise DrillError(f"node{number} needs {n} free GPU(s); live nodes hold {sorted(held)} of {count}")
        devices = [str(d) for d in free[:n]]
        self.gpus[number] = [int(d) for d in devices]
        # NVLink multicast off (FACTS: NCCL pitfalls).
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices), "NCCL_NVLS_ENABLE": "0"}

    def _start_node(self, number: int) -> Node:
        state_dir = self.out / "state" / f"node{number}"
        state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ELASTIC_EMB_", "MASTER_"))}
        env.update(
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # FACTS item 1: the shared agent store deadlocks resizes
            ELASTIC_EMB_NODE_ID=f"node{number}",
            ELASTIC_EMB_STATE_DIR=str(state_dir),
            ELASTIC_EMB_BACKEND=self.scenario.backend,
            ELASTIC_EMB_LOG_FORMAT="json",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        if self.metrics_port is not None:
            env.update(
                ELASTIC_EMB_METRICS_PORT=str(self.metrics_port + number * (self.scenario.nproc_per_node + 1)),
                ELASTIC_EMB_METRICS_ADDR="127.0.0.1",
            )
        env.update(self.network.node_env(number))
        if self.scenario.backend == "nccl":
            env.update(self._gpu_env(number))
        log_path = self.out / "logs" / f"node{number}.log"
        logf = open(log_path, "ab")
        cmd = self.network.wrap(self._agent_cmd(number), number)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(self.out),
        )
        logf.close()
        node = Node(number, proc, log_path, time.time())
        self.nodes[number] = node
        log.info("drill_node_started", node=node.name, pid=proc.pid, addr=self.network.node_addr(number))
        return node

    # -- faults ---------------------------------------------------------------------------------

    def _live(self) -> list[int]:
        return [n for n, node in sorted(self.nodes.items()) if node.state == "running"]

    def _workers(self, node: Node) -> list[int]:
        script = str(self.script)
        return [
            p
            for p in procs.descendants(node.proc.pid)
            if script in procs.cmdline(p) and "torch.distributed.run" not in procs.cmdline(p)
        ]

    def _fire(self, index: int, fault: Fault) -> None:
        live = self._live()
        target = None
        detail: dict = {}
        if fault.kind == "join":
            target = max(self.nodes) + 1
            self._start_node(target)
        elif fault.kind in ("leave", "kill_node", "kill_agent"):
            target = fault.node if fault.node is not None else Scenario.default_victim(live, fault.kind)
            node = self.nodes.get(target)
            if node is None or node.state != "running":
                raise DrillError(
                    f"fault #{index} {fault.kind} at {fault.when()}: node {target} is not running (live: {live})"
                )
            if fault.kind == "leave":
                node.state = "leaving"
                os.kill(node.proc.pid, signal.SIGTERM)  # the agent forwards it to its workers
            elif fault.kind == "kill_agent":
                node.state = "killed"
                detail["orphans"] = self._workers(node)  # they outlive the agent (FACTS item 4)
                os.kill(node.proc.pid, signal.SIGKILL)
                detail["pids"] = [node.proc.pid]
            else:
                node.state = "killed"
                detail["pids"] = self.network.kill_node(target, node.proc.pid)
        elif fault.kind in ("crash_worker", "corrupt"):
            target = fault.node if fault.node is not None else live[-1]
            node = self.nodes[target]
            deadline = time.monotonic() + 15.0  # its agent may be between two sets of workers
            workers = self._workers(node)
            while not workers and time.monotonic() < deadline and node.proc.poll() is None:
                time.sleep(0.05)
                workers = self._workers(node)
            if not workers:
                raise DrillError(f"fault #{index} {fault.kind}: node {target} has no live worker to kill within 15 s")
            victims = workers[-1:] if fault.kind == "crash_worker" else workers
            procs.signal_all(victims, signal.SIGKILL)
            detail["pids"] = victims
            if fault.kind == "corrupt":
                detail.update(self._corrupt(target, victims))
        elif fault.kind == "kill_store":
            if self.etcd is None:
                raise DrillError("fault kill_store needs store='etcd'")
            detail["member"] = self.etcd.kill(fault.member)
            self.store_back_at = time.monotonic() + fault.duration
            detail["down_seconds"] = fault.duration
        if fault.kind != "kill_store":
            # Slow training down until a new world steps, so a short drill cannot end first.
            self.slow_file.touch()
            # In process, a crashed worker's node leaves the world and rejoins it: two re-forms; slow
            # down until the second (else the survivor, stepping fast once alone, may finish first).
            rejoins = fault.kind == "crash_worker" and self.scenario.mode == "in_process"
            # A membership fault is in once a world of the size it leads to steps: a new generation
            # alone may be an earlier fault's re-form landing late (in restart mode on a loaded machine
            # a joiner's agent can be slow to start), which would end the slow-down before this
            # fault's node is in.
            world = (
                len(self.history[index + 1]) * self.scenario.nproc_per_node
                if fault.kind in ("join", "leave", "kill_node", "kill_agent")
                else None
            )
            self.awaiting = (self.rank0_pid, self.generation + int(rejoins), world, time.monotonic() + AWAIT_S)
        self.fired.append(FiredFault(index, fault, time.time(), self.max_step, target, detail))
        log.info("drill_fault", index=index, kind=fault.kind, node=target, step=self.max_step, **detail)

    def _corrupt(self, number: int, victims: list[int]) -> dict:
        from elastic_emb.drill.corrupt import corrupt_newest_snapshot

        deadline = time.monotonic() + 5.0
        while any(procs.alive(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.01)
        return corrupt_newest_snapshot(self.out / "state" / f"node{number}")

    # -- the loop -------------------------------------------------------------------------------

    def _observe(self, new: list[dict]) -> None:
        for e in new:
            if e.get("event") == "job_complete_before_join":
                self.late_joiners.add(e["node"])
            if e.get("event") == "step":
                if self.t_first_step is None:
                    self.t_first_step = e["t"]
                self.max_step = max(self.max_step, e["step"])
                self.world = e["world"]
                self.generation = max(self.generation, e.get("generation", -1))
                if e.get("rank") == 0:
                    self.rank0_pid = e.get("pid")
                gen, rank = e.get("generation", -1), e.get("rank")
                first = self.first_step_in.setdefault(gen, {}).setdefault(rank, e["step"])
                # `committed`: the newest step complete on this rank (the example's progress lines);
                # a script whose lines lack it is taken at its word that a step is committed.
                if e.get("committed") is None or e["committed"] >= first:
                    self.committed_in.setdefault(gen, set()).add(rank)
        if self.awaiting is not None:
            pid, generation, world, deadline = self.awaiting
            # a new incarnation of rank 0 (restart mode), or the same one in a newer generation
            # (mode in_process: the survivors keep their processes), at the world size the fault leads to
            new_world = (self.rank0_pid is not None and self.rank0_pid != pid) or self.generation > generation
            # ... and every rank of it has a commit of that world complete (with its replicas): the
            # next fault (a kill of the node that was alone before) then leaves a world to restore from.
            committed = set(range(self.world)) <= self.committed_in.get(self.generation, set())
            given_up = time.monotonic() > deadline
            if (new_world and world in (None, self.world) and committed) or given_up:
                # A new incarnation is stepping and has committed (or we gave up waiting): full speed again.
                if given_up:
                    log.warning(
                        "drill_await_gave_up",
                        seconds=AWAIT_S,
                        world=self.world,
                        expected_world=world,
                        generation=self.generation,
                        committed_ranks=sorted(self.committed_in.get(self.generation, ())),
                    )
                self.awaiting = None
                self.slow_file.unlink(missing_ok=True)
        for node in self.nodes.values():
            if node.exit_code is None and node.proc.poll() is not None:
                node.exit_code = node.proc.returncode
                node.ended = time.time()
                node.state = {"running": "exited", "leaving": "left"}.get(node.state, node.state)
                log.info("drill_node_ended", node=node.name, exit_code=node.exit_code, state=node.state)

    def _due(self, fault: Fault) -> bool:
        if fault.at_step is not None:
            return self.max_step >= fault.at_step
        return self.t_first_step is not None and time.time() - self.t_first_step >= fault.at_time

    def run(self) -> DrillResult:
        """Start the nodes, inject the faults, wait for the end, clean up, and verify the final tables.

        Every wait is bounded by ``scenario.timeout``; whatever happens, every process tree the
        drill started is killed and its namespaces are removed. A drill that fails once started
        does not raise: its error is in the result.

        Returns:
            The result; ``ok`` is True when training finished and the tables equal the replay.

        Raises:
            DrillError: if ``out`` exists and is not a drill directory, or ``store: etcd`` is asked
                for with network namespaces.
            RuntimeError: if ``network: netns`` is asked for and namespaces do not work here.
        """
        s = self.scenario
        self._prepare_out()
        # etcd listens on loopback only; NCCL between namespaces of one host is untested: loopback.
        loopback_only = s.store == "etcd" or s.backend == "nccl"
        self.network = pick_network("loopback" if loopback_only and s.network == "auto" else s.network, self.out.name)
        if s.store == "etcd" and self.network.kind != "loopback":
            raise DrillError(
                "store='etcd' runs on loopback only (the test etcd listens on 127.0.0.1); set network: loopback"
            )
        self.t0 = time.time()
        reader = EventReader(self.out / "run" / "events")
        error: str | None = None
        pending = list(enumerate(s.faults))
        previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            # A SIGTERMed drill still cleans up (processes, namespaces): turn it into an error.
            def _terminated(signum, frame):
                raise DrillError(f"the drill was sent signal {signum}; stopped and cleaned up")

            previous_sigterm = signal.signal(signal.SIGTERM, _terminated)
        try:
            self.network.setup(s.max_nodes + sum(f.kind == "join" for f in s.faults))
            host, port, self.store_conf = self._start_store()
            self.endpoint = self.etcd.endpoint if self.etcd is not None else f"{host}:{port}"
            for n in range(s.initial_nodes):
                self._start_node(n)
            # The start is paced like a join: at load the first round may form before every initial
            # node is in (last call 1 s), and the stragglers join later; faults wait for the full world.
            self.slow_file.touch()
            self.awaiting = (None, -1, s.initial_nodes * s.nproc_per_node, time.monotonic() + AWAIT_S)
            deadline = time.monotonic() + s.timeout
            while True:
                self._observe(reader.poll())
                if self.store_back_at is not None and time.monotonic() >= self.store_back_at:
                    self.store_back_at = None
                    self.etcd.start()  # same ports, same data directory: the member comes back
                    log.info("drill_store_restarted", seconds_to_healthy=self.etcd.started_in)
                for item in list(pending):
                    index, fault = item
                    # A step-triggered fault waits until the previous fault's new world is stepping
                    # (bounded by that wait's deadline), so faults land one resize at a time; a
                    # time-triggered fault fires when its time comes, overlapping or not.
                    if fault.at_step is not None and self.awaiting is not None:
                        continue
                    if self._due(fault):
                        pending.remove(item)
                        self._fire(index, fault)
                self.on_progress(
                    {
                        "step": self.max_step,
                        "steps": s.steps,
                        "world": self.world,
                        "nodes": len(self._live()),
                        "faults": len(self.fired),
                        "t": time.time() - self.t0,
                    }
                )
                if all(node.exit_code is not None for node in self.nodes.values()):
                    break
                if time.monotonic() > deadline:
                    error = (
                        f"drill {s.name!r} timed out after {s.timeout:g}s at committed step {self.max_step} "
                        f"of {s.steps}; live nodes {self._live()}; see {self.out / 'logs'}"
                    )
                    break
                time.sleep(0.1)
            self._observe(reader.poll())
            failed = [n for n in self.nodes.values() if n.state == "exited" and n.exit_code != 0]
            if error is None and failed:
                when = " before the first committed step" if self.max_step < 0 else ""
                error = f"agents failed{when}: " + "; ".join(
                    f"{n.name} exit {n.exit_code}: {worker_error(n.log_path)} (log {n.log_path})" for n in failed
                )
            # A join that came after the end exits 0 (its worker or its agent saw the job marked
            # complete), but the drill did not resize: say so instead of passing.
            self.late_joiners |= {
                n.name
                for n in self.nodes.values()
                if "job_finished_before_join" in n.log_path.read_text(errors="replace")
            }
            if error is None and self.late_joiners:
                error = (
                    f"{sorted(self.late_joiners)} came after the job finished (the world ended before it could "
                    f"include them; their agents exited 0): raise steps or slow_delay so that the join lands "
                    f"during training"
                )
            if error is None and pending:
                error = (
                    f"training ended before faults {[f'#{i} {f.kind} at {f.when()}' for i, f in pending]} "
                    f"fired (last committed step {self.max_step}); raise steps or step_delay"
                )
        except DrillError as exc:
            error = str(exc)
        finally:
            # Workers orphaned by a kill_agent fault must have left by themselves; note any that
            # did not before the cleanup below kills them.
            self.orphans_alive = [p for f in self.fired for p in f.detail.get("orphans", []) if procs.alive(p)]
            self._cleanup()
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
        t_end = time.time()
        verification: dict = {}
        if error is None or s.expect_failure:
            self.on_progress({"phase": "verify", "step": self.max_step, "steps": s.steps})
            try:
                verification = verify(self.out / "run", self.script)
            except LossDetected as exc:
                verification = {"ok": False, "error": str(exc), "findings": exc.findings}
                error = error or str(exc)
            except Exception as exc:  # noqa: BLE001 - reported, not swallowed
                verification = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                error = error or verification["error"]
        return DrillResult(
            scenario=s,
            out=self.out,
            ok=error is None and verification.get("ok", False),
            verification=verification,
            error=error,
            t0=self.t0,
            t_end=t_end,
            events=reader.events,
            faults=self.fired,
            nodes=list(self.nodes.values()),
            network=self.network.kind if self.network else "none",
            orphans_alive_at_end=self.orphans_alive,
        )

    def _cleanup(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                procs.kill_tree(node.proc.pid, signal.SIGKILL)
            else:
                # The agent is gone but orphaned workers may remain (FACTS item 4).
                procs.signal_all(self._orphans(node), signal.SIGKILL)
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("drill_agent_unkillable", node=node.name, pid=node.proc.pid)
            if node.exit_code is None:
                node.exit_code = node.proc.returncode
                node.ended = time.time()
        if self.etcd is not None:
            self.etcd.stop()
        if self.store_proc is not None and self.store_proc.poll() is None:
            procs.kill_tree(self.store_proc.pid, signal.SIGKILL)
            self.store_proc.wait(timeout=10)
        if self.network is not None:
            self.network.teardown()

    def _orphans(self, node: Node) -> list[int]:
        """Workers of a dead agent: processes running our script with this node's id."""
        marker = f"ELASTIC_EMB_STATE_DIR={self.out / 'state' / node.name}".encode()
        out = []
        for pid in procs.all_pids():
            if str(self.script) not in procs.cmdline(pid):
                continue
            try:
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(pid)
            except OSError:
                continue
        return out


def worker_error(path: Path, limit: int = 500) -> str:
    """The cause of a node's failure, from its log: the last error a worker printed.

    Preference: the exception line (and innermost frame) of the last Python traceback that is not
    torchrun's own ``ChildFailedError`` summary; else the last lines that mention an error (e.g.
    ``python: can't open file ...``), leaving out torchrun's failure box; else the log's tail.

    Args:
        path: the node's log file.
        limit: the most characters returned.

    Returns:
        One line, or ``"<no log>"`` / ``"<empty log>"``.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    lines = [re.sub(r"^\[(rank|default)\d+\]:", "", ln).rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    found: list[str] = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        frame = ""
        for follow in lines[i + 1 :]:
            if follow.startswith(" "):
                if follow.lstrip().startswith("File "):
                    frame = follow.strip()
                continue
            if "ChildFailedError" not in follow:
                found.append(f"{follow.strip()} [{frame}]" if frame else follow.strip())
            break
    if found:
        return found[-1][:limit]
    noise = ("ChildFailedError", "error_file", "errors.html", "traceback :", "Failures:", "Root Cause", "=====")
    hits = [
        ln.strip()
        for ln in lines
        if re.search(r"error|can't open file|exception|killed", ln, re.IGNORECASE) and not any(n in ln for n in noise)
    ]
    if hits:
        return " | ".join(hits[-3:])[-limit:]
    return " ".join(lines)[-limit:] or "<empty log>"
