"""A small gloo worker for the rendezvous tests and bench/resize.py, run under real torchrun agents.

Each generation: topology from torchrun's environment -> agreement over the worker store -> a
gloo process group on a store prefix of its own -> steps. A step is one all_reduce of the step
number over every rank (a collective the whole world takes part in), then a commit: the step is
appended to the rank's JSON-lines log. The next generation resumes after the highest step every
rank of the previous world committed (the max over the logs, agreed by an all_reduce MAX), so a
lost step shows up as a gap or a repeat in the logs.

With the elastic_emb watcher (``ELASTIC_EMB_RDZV_ENDPOINT`` set) the worker drains: after each
commit it asks ``drain_requested(step)``, and once the agreed last step is committed it
acknowledges and idles until the agent's SIGTERM.

Environment: ``RDZV_TEST_LOG_DIR`` (where the per-rank logs go), ``RDZV_TEST_MODE`` (``busy``:
step continuously; ``idle``: one step per generation, then sleep), ``RDZV_TEST_STEP_S`` (sleep
per step, default 0.05), ``RDZV_TEST_MAX_STEPS`` (stop after this step, default 100000).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.store import generation_store, worker_store
from elastic_emb.topology import Topology, agree
from elastic_emb.watch import Watcher

LOG_DIR = os.environ["RDZV_TEST_LOG_DIR"]
MODE = os.environ.get("RDZV_TEST_MODE", "busy")
STEP_S = float(os.environ.get("RDZV_TEST_STEP_S", "0.05"))
MAX_STEPS = int(os.environ.get("RDZV_TEST_MAX_STEPS", "100000"))


def log(record: dict) -> None:
    record["t"] = time.time()
    record["pid"] = os.getpid()
    with open(os.path.join(LOG_DIR, f"worker-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def last_committed() -> int:
    best = -1
    for name in os.listdir(LOG_DIR):
        if not name.startswith("worker-"):
            continue
        with open(os.path.join(LOG_DIR, name)) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if rec.get("ev") == "commit":
                    best = max(best, rec["step"])
    return best


def main() -> int:
    t_start = time.time()
    topo = Topology.from_env()
    store = worker_store(topo, timeout=30.0)
    topo = agree(topo, store, timeout=30.0)
    dist.init_process_group(
        "gloo", store=generation_store(store, topo, "pg"), rank=topo.rank, world_size=topo.world_size,
        timeout=timedelta(seconds=30),
    )
    watcher = Watcher.from_env()
    if watcher is not None:
        watcher.start()
    t = torch.tensor([last_committed()], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step = int(t.item()) + 1
    log({"ev": "ready", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "resume": step,
         "boot_s": time.time() - t_start, "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
         "node": os.environ.get("ELASTIC_EMB_NODE_ID"), "agent_pid": os.getppid()})
    while step <= MAX_STEPS:
        if watcher is not None and watcher.evicted:
            log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
            return 3
        log({"ev": "start", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "step": step})
        x = torch.tensor([step], dtype=torch.int64)
        dist.all_reduce(x)
        if int(x.item()) != step * topo.world_size:
            raise RuntimeError(f"step {step}: all_reduce gave {int(x.item())}, expected {step * topo.world_size}")
        log({"ev": "commit", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "step": step})
        if watcher is not None and watcher.drain_requested(step):
            watcher.ack_drain(step)
            log({"ev": "drained", "gen": topo.generation, "rank": topo.rank, "step": step})
            break
        step += 1
        if MODE == "idle":
            break
        time.sleep(STEP_S)
    # Idle (or drained): no collectives, wait for the agent to restart or stop us.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if watcher is not None and watcher.evicted:
            log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
            return 3
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    # The agent's SIGTERM ends the generation: every step is already committed (logged), so exit
    # at once rather than through a slow interpreter teardown the restart would wait for.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sys.exit(main())
