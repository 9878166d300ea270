"""Start and collect bench rank processes: the environment of a rank (:func:`rank_env`), and each
rank's result, one JSON line printed last, within one deadline (:func:`collect`).

Shared by the benches that start one process per rank themselves (bench/commit.py, bench/reshard.py,
bench/lookup.py); a rank that fails or overruns ends the bench with its stderr tail, and every rank is
killed (the others would wait for it in a collective until their own timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import time


def collect(procs: list[subprocess.Popen], timeout: float, what: str) -> list[dict]:
    """The last stdout line of each rank, parsed as JSON, in rank order; SystemExit naming ``what``."""
    out = []
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{what}: rank {rank} did not finish within {timeout}s") from None
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{what}: rank {rank} failed (rc={p.returncode}):\n{se[-4000:]}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


def rank_env(rank: int, world: int, port: int, run_id: str, repo, **extra: str) -> dict:
    """The environment torchrun would give ``rank`` of ``world``, each rank its own node, on
    loopback, without the caller's own torchrun or elastic_emb variables; ``repo`` first on
    PYTHONPATH; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC_", "ELASTIC_EMB_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
               GROUP_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
               ELASTIC_EMB_BACKEND="gloo", TORCHELASTIC_USE_AGENT_STORE="False", OMP_NUM_THREADS="1",
               ELASTIC_EMB_LOG_LEVEL="warning",
               PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p))
    env.update(extra)
    return env
