"""The README's training script, exactly as printed, survives a scale-down and a join bit for bit.

Its first ```python block of "A training script" is written to a file and run by real torchrun
agents (``--rdzv-backend=elastic_emb``, loopback, gloo) on nodes a and b; b's whole node is
killed (2 -> 1), then node c starts (1 -> 2), in both resize modes. The rows the job committed
last, read back by ``Lifecycle.start`` at world size 1 in a fresh process, equal those of a
fault-free run of the same script bit for bit.

The script runs under ``tests/helpers/readme_runner.py``, which hands its ``run_elastic`` hooks
that hold a worker between steps while the test's hold file exists: each fault lands while the
world waits at a step boundary, so no outcome depends on how fast the machine trains.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_emb.testing.ports import free_port
from tests.helpers.agents import FAST_CONF

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "helpers" / "readme_runner.py"
STEPS = 40  # the script's step count (its first argument); the holds come within its first few steps
WAIT = 60.0

READER = """
import importlib.util, sys
import torch
from elastic_emb import Lifecycle
script, out = sys.argv[1], sys.argv[2]
sys.argv = [script]  # the script reads an optional step count from its arguments
spec = importlib.util.spec_from_file_location("train", script)
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
lc = Lifecycle.start(train.factory)
try:
    rows = {name: s.weight.detach().cpu().clone() for name, s in lc.context.export_shard().items()}
    torch.save({"step": lc.step, "rows": rows}, out)
finally:
    lc.close()
"""


def readme_script() -> str:
    """The first Python block of the README's section "A training script"."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## A training script\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert m, "README.md: no ```python block in the section 'A training script'"
    return m.group(1)


def _env(tmp: Path, node: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_EMB_", "TORCHELASTIC_", "READMETEST_"))}
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        ELASTIC_EMB_BACKEND="gloo",
        ELASTIC_EMB_LOG_FORMAT="json",
        ELASTIC_EMB_STATE_DIR=str(tmp / "state"),
        ELASTIC_EMB_NODE_ID=node,
        READMETEST_OUT=str(tmp),
    )
    return env


class Cluster:
    """The torchrun agents of one job on loopback; :meth:`kill_all` leaves nothing running."""

    def __init__(self, tmp: Path, run_id: str, *, resize: str) -> None:
        self.tmp, self.run_id, self.port = tmp, run_id, free_port()
        self.conf = f"{FAST_CONF},inner=c10d,drain=1,drain_timeout=30,resize={resize}"
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, node: str, script: Path, *, gated: bool = True, host: bool = False) -> subprocess.Popen:
        """Start node ``node``'s agent; ``host``: it hosts the c10d rendezvous store (a node that
        is never killed, since losing the host ends the job)."""
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:3",
            "--nproc-per-node=1",
            "--rdzv-backend=elastic_emb",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={self.conf},is_host={str(host).lower()},event_file={self.tmp / f'events-{node}.jsonl'}",
            "--max-restarts=3",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
            *([str(RUNNER)] if gated else []),
            str(script),
            str(STEPS),
        ]
        with open(self.tmp / f"agent-{node}.log", "w") as log:
            proc = subprocess.Popen(
                cmd,
                env=_env(self.tmp, node),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.tmp,
            )
        self.agents[node] = proc
        return proc

    def kill_node(self, node: str) -> None:
        """SIGKILL a node: its agent's process group and every worker it ran."""
        _kill_group(self.agents[node].pid)
        for pid in {line["pid"] for line in progress(self.tmp) if line["node"] == node}:
            _kill_group(pid)
        self.agents[node].wait(timeout=10)

    def kill_all(self) -> None:
        for node in list(self.agents):
            _kill_group(self.agents[node].pid)
        for pid in {line["pid"] for line in progress(self.tmp)}:
            _kill_group(pid)
        for proc in self.agents.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait_done(self, *nodes: str, timeout: float = WAIT) -> None:
        """Wait for the agents of ``nodes`` to exit; each must exit 0."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                rc = self.agents[node].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {node} still running after {timeout} s\n{self.logs()}") from None
            assert rc == 0, f"agent {node} exited {rc}\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(
            f"--- agent {n} (rc {p.poll()}):\n{(self.tmp / f'agent-{n}.log').read_text()[-3000:]}"
            for n, p in self.agents.items()
        )


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # torch starts each worker as a session leader
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def progress(tmp: Path) -> list[dict]:
    """Every line the workers' hooks wrote, in time order (lines cut by a kill are skipped)."""
    lines = []
    for path in sorted((tmp / "progress").glob("*.jsonl")):
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                continue
    return sorted(lines, key=lambda line: line["t"])


def wait_for(pred, what: str, cluster: Cluster, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{cluster.logs()}")


def held(tmp: Path, node: str, world: int, after_generation: int = -1) -> dict | None:
    """The newest ``held`` line of ``node`` in a world of ``world`` newer than ``after_generation``."""
    found = [
        line
        for line in progress(tmp)
        if line["event"] == "held" and line["node"] == node and line["world"] == world
        if line["generation"] > after_generation
    ]
    return found[-1] if found else None


def committed_rows(tmp: Path, script: Path, run_id: str, node: str) -> dict:
    """The newest complete commit of node ``node``'s directory, restored at world size 1."""
    out = tmp / f"rows-{run_id}.pt"
    env = _env(tmp, node)
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TORCHELASTIC_RUN_ID=run_id,
    )
    done = subprocess.run(
        [sys.executable, "-c", READER, str(script), str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("readme") / "train.py"
    path.write_text(readme_script())
    return path


@pytest.fixture(scope="module")
def reference(script, tmp_path_factory) -> dict:
    """The script's rows after ``STEPS`` steps on one node, with no fault and no hook."""
    tmp = tmp_path_factory.mktemp("reference")
    cluster = Cluster(tmp, "readme-ref", resize="restart")
    try:
        cluster.start("r", script, gated=False, host=True)
        cluster.wait_done("r", timeout=120)
    finally:
        cluster.kill_all()
    rows = committed_rows(tmp, script, "readme-ref", "r")
    assert rows["step"] == STEPS - 1, rows["step"]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("resize", ["in_process", "restart"])
def test_readme_script_survives_a_scale_down_and_a_join_bit_for_bit(resize, script, reference, tmp_path):
    run_id = f"readme-{resize.replace('_', '-')}"
    cluster = Cluster(tmp_path, run_id, resize=resize)
    try:
        # a and b train as a world of two, then wait at a step boundary
        (tmp_path / "hold-a").touch()
        (tmp_path / "hold-b").touch()
        cluster.start("a", script, host=True)
        cluster.start("b", script)
        two = wait_for(
            lambda: (a := held(tmp_path, "a", 2)) and (b := held(tmp_path, "b", 2, a["generation"] - 1)) and (a, b),
            "a and b held in one world of two",
            cluster,
        )
        assert two[0]["generation"] == two[1]["generation"], two
        # scale-down: b's whole node dies; a goes on alone, and waits again
        cluster.kill_node("b")
        one = wait_for(lambda: held(tmp_path, "a", 1, two[0]["generation"]), "a held in a world of one", cluster)
        # join: c starts; a includes it (in process) or drains for the agents' restart, then waits again
        cluster.start("c", script)
        again = wait_for(lambda: held(tmp_path, "a", 2, one["generation"]), "a held in a world of two with c", cluster)
        (tmp_path / "hold-a").unlink()
        cluster.wait_done("a", "c")
    finally:
        cluster.kill_all()

    lines = progress(tmp_path)
    c_steps = [line for line in lines if line["node"] == "c" and line["event"] == "step"]
    assert c_steps and {line["world"] for line in c_steps} == {2}, c_steps
    assert c_steps[0]["generation"] == again["generation"], (c_steps[0], again)
    finished = {line["node"]: line for line in lines if line["event"] == "finish"}
    assert sorted(finished) == ["a", "c"] and {f["step"] for f in finished.values()} == {STEPS - 1}, finished
    # a's worlds, as it started or re-formed: two, one, two (one process of a throughout in process)
    a_lines = [line for line in lines if line["node"] == "a" and line["event"] in ("start", "resized")]
    worlds = [line["world"] for line in a_lines]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]][-3:] == [2, 1, 2], a_lines
    if resize == "in_process":
        assert len({line["pid"] for line in lines if line["node"] == "a"}) == 1, a_lines

    rows = committed_rows(tmp_path, script, run_id, "a")
    assert rows["step"] == STEPS - 1, rows["step"]
    assert rows["rows"].keys() == reference["rows"].keys()
    for name, expected in reference["rows"].items():
        got = rows["rows"][name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        differ = (got.view(torch.int32) != expected.view(torch.int32)).any(dim=1).nonzero().flatten()
        assert differ.numel() == 0, f"table {name}: {differ.numel()} rows differ, first {differ[:10].tolist()}"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"steps": -1}, "steps=-1"), ({"steps": 2.5}, "steps=2.5"), ({"steps": 3, "drain_timeout": 0}, "drain_timeout=0")],
)
def test_run_elastic_refuses_bad_arguments_before_starting(kwargs, needle):
    """Bad arguments fail at once, naming the value, before a watcher or a store is touched."""
    from elastic_emb import LoopHooks, run_elastic

    with pytest.raises(ValueError, match=re.escape(needle)):
        run_elastic(lambda topology, store: None, lambda ctx, step: 0.0, hooks=LoopHooks(), **kwargs)
