"""Run real worker processes for tests: each rank is a separate Python interpreter.

``run_ranks(code, env_per_rank, timeout)`` starts one process per rank running ``code`` (a
Python source string; its last printed line must be JSON), waits with a hard timeout, kills
stragglers, and returns per-rank ``Result``s. Nothing is mocked: the processes talk over a real
TCPStore and real gloo process groups on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Result:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def value(self):
        """The JSON of the last stdout line that parses as JSON."""
        for line in reversed(self.stdout.strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
        raise AssertionError(f"rank {self.rank} printed no JSON (rc={self.returncode}); stderr:\n{self.stderr[-3000:]}")


def torchrun_env(rank: int, world_size: int, port: int, *, local_world_size: int | None = None,
                 node_rank: int | None = None, num_nodes: int | None = None, run_id: str = "test",
                 generation: int = 0, extra: dict | None = None) -> dict:
    """The environment torchrun would give ``rank`` (one node unless told otherwise)."""
    lws = local_world_size or world_size
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC_", "ELASTIC_EMB_"))
    }
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % lws), LOCAL_WORLD_SIZE=str(lws),
        GROUP_RANK=str(rank // lws if node_rank is None else node_rank),
        GROUP_WORLD_SIZE=str(num_nodes or max(1, world_size // lws)),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
        ELASTIC_EMB_GENERATION=str(generation), ELASTIC_EMB_BACKEND="gloo",
        TORCHELASTIC_USE_AGENT_STORE="False", OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p),
        ELASTIC_EMB_LOG_FORMAT="json",
    )
    env.update(extra or {})
    return env


def run_ranks(code: str, envs: list[dict], timeout: float = 60.0) -> list[Result]:
    """Start one process per env (rank order), wait at most ``timeout`` s for all, kill the rest."""
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(0.1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n[procs] rank {rank} killed after the {timeout}s test timeout"
        results.append(Result(rank, p.returncode, out, err, time.monotonic() - start))
    return results
