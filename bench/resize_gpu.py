"""World size 1 rebuilt in process on one GPU: the whole in-process resize path, phase by phase.

Issue 18's H200 figure. One process, one GPU, an ``EmbContext`` of world size 1 (NCCL) holding a
``--rows`` x ``--dim`` fp32 table (default 8M x 128: 4 GiB) with a row-wise Adagrad slot, driven by
the real in-process resize code: a :class:`~elastic_emb.inprocess.resize.InProcessResize` over a real
:class:`~elastic_emb.watch.watcher.Watcher`, whose reader polls a real torch rendezvous state (torch's own
``C10dRendezvousBackend`` on a loopback ``TCPStore``, the same store the decision, the agreement and
the new communicator use). The world's membership names this node and a second one that the
state no longer holds: the node that "left". Each run:

1. **detect**: the watcher polls the state (one read, the restricted decoder) and the step
   boundary check ``resize.pending()`` sees the departure;
2. ``resize.run(rebuild=True)``: **decide** (the decider's claim, the signed-if-secret record,
   read back), **agree**, **teardown** (``close(wait=False)``: the old communicator is released
   in the background), **construct** (a new context and a new NCCL communicator, generation + 1),
   **restore** (every row and slot from the live shard: the path of a scale-down's survivor);
3. **first step**: one lookup of ``--batch`` random ids, waited for, its gradients applied, the
   GPU synchronised; then ``commit`` (which completes the ``lifecycle.resize`` event). That
   commit is the new generation's first: a full base of the table (seconds for 4 GiB; the
   library may write it in the background), timed apart until it is complete as ``commit_s``
   (the call alone: ``commit_call_s``), not part of the path.

The membership is then set back to two nodes for the next run, and its step's commit waited for
(a commit still in flight would make the next run's teardown wait for it). The figure is the wall time from
the poll to the end of the first step (``path_s``; target <= 0.1 s), median of ``--runs``; each
phase is taken from the ``lifecycle.resize`` event of the run. Measured in the same invocation, as baselines:
``raw``: ``close(wait=False)`` + a new ``EmbContext`` + its first lookup, nothing else (what the
path adds to it is detect, decide, agree, restore, the step's update and bookkeeping); and
``restart`` (``--restart-runs``, 0 to skip): a new Python process that imports torch and
elastic_emb, builds the same context and looks up once, what a restarted worker pays at least.

    python3 bench/resize_gpu.py --runs 7 --out out/gpu/resize_gpu.json          # on one H200
    python3 bench/resize_gpu.py --device cpu --rows 65536 --dim 16 --runs 3     # a smoke run

Commits go to ``--state-dir`` (default: a fresh directory under /dev/shm): the first step commits a
full base of the table (seconds for 4 GiB, before the timed runs), later steps small deltas.
Without CUDA and without ``--device cpu`` it says so and exits 0 (a GPU benchmark; CI never runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

PHASES = ("detect_s", "drain_s", "decide_s", "teardown_s", "agreement_s", "construct_s", "restore_s", "first_step_s")
RUN_ID = "bench-resize-gpu"

RESTART = r"""
import sys, time
t0 = float(sys.argv[1])
import torch, torch.distributed as dist
from datetime import timedelta
from elastic_emb.context import EmbContext
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology
rows, dim, batch, device = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t_import = time.time()
if device == "cuda":
    torch.cuda.set_device(0)
port = free_port()
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=60))
topo = Topology.build(run_id="restart", generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1,
                      node_rank=0, num_nodes=1, ep_size=1, backend="nccl" if device == "cuda" else "gloo",
                      master_addr="127.0.0.1", master_port=port)
ctx = EmbContext(topo, store, tables=[TableSpec(name="t", num_rows=rows, dim=dim)],
                 optimizer=OptimizerSpec(kind="adagrad", lr=0.1), seed=None, timeout=120.0)
ids = torch.randint(0, rows, (batch,), device=device)
ctx.lookup("t", ids).wait(timeout=60)
if device == "cuda":
    torch.cuda.synchronize()
print("RESTART", t_import - t0, time.time() - t0, flush=True)
ctx.close()
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rows", type=int, default=8 << 20)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1 << 16)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--restart-runs", type=int, default=2)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs={args.runs} must be >= 1")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: bench/resize_gpu.py measures on a GPU (use --device cpu for a smoke run)")
        return 0
    state_dir = args.state_dir or tempfile.mkdtemp(
        prefix="resize_gpu_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        result = measure(args, state_dir)
    finally:
        if args.state_dir is None:
            shutil.rmtree(state_dir, ignore_errors=True)
    report(result)
    if args.out:
        write_json(args.out, "resize_gpu", result, indent=1)
    return 0


def _rendezvous(port: int, alive: str):
    """torch's own rendezvous state in the store: round 1, complete, ``alive`` its one participant."""
    from datetime import timezone

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    master = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
        use_libuv=True,
    )
    backend = C10dRendezvousBackend(master, RUN_ID)
    addr, pid, local = alive.rsplit("_", 2)
    node = _NodeDesc(addr, int(pid), int(local))
    state = _RendezvousState()
    state.round, state.complete = 1, True
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.datetime.now(timezone.utc)
    got = backend.set_state(pickle.dumps(state), None)
    if got is None or not got[2]:
        raise RuntimeError("could not write the rendezvous state into a fresh store")
    return master


def measure(args, state_dir: str) -> dict:
    import torch

    from elastic_emb import InProcessResize, Lifecycle, LifecycleConfig
    from elastic_emb.context import EmbContext
    from elastic_emb.inprocess.interruptible import InterruptibleStore
    from elastic_emb.protocol import OptimizerSpec, TableSpec
    from elastic_emb.testing.ports import free_port
    from elastic_emb.watch.watcher import RendezvousReader, Watcher

    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    me, gone = "127.0.0.1_101_0", "127.0.0.1_102_0"
    port = free_port()
    master = _rendezvous(port, me)
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": RUN_ID,
        "ELASTIC_EMB_GENERATION": "1",
        "ELASTIC_EMB_BACKEND": "nccl" if cuda else "gloo",
        "ELASTIC_EMB_RESIZE": "in_process",
        "ELASTIC_EMB_MEMBERSHIP": json.dumps([me, gone]),
    }
    reader = RendezvousReader("c10d", f"127.0.0.1:{port}", RUN_ID, timeout=10.0)
    watcher = Watcher(reader, round_=1, rank=0, world_size=1, node=me, agent_pid=os.getppid(), interval=0.1)
    tables = [TableSpec(name="t", num_rows=args.rows, dim=args.dim)]
    opt = OptimizerSpec(kind="adagrad", lr=0.1)

    def factory(topology, store):
        return EmbContext(topology, store, tables=tables, optimizer=opt, device=dev, seed=None, timeout=120.0)

    gen = torch.Generator(device=dev).manual_seed(7)

    def batch():
        ids = torch.randint(0, args.rows, (args.batch,), device=dev, generator=gen)
        return ids, torch.full((args.batch, args.dim), 0.25, device=dev)

    def step(lc, ids, grads, commit=True):
        lc.context.lookup("t", ids).wait(timeout=60)
        lc.context.apply_gradients("t", ids, grads)
        if cuda:
            torch.cuda.synchronize()
        if commit:
            lc.commit(lc.next_step)

    world_store = InterruptibleStore(reader.world_store(60.0), lambda: bool(watcher.gone()))
    config = LifecycleConfig(state_dir=state_dir, node_id=me, commit_every=1, agree_timeout=60.0)
    t0 = time.perf_counter()
    lc = Lifecycle.start(factory, config, env=env, store=world_store, watcher=None)
    resize = InProcessResize(lc, watcher, env=env)
    setup = {"start_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    step(lc, *batch())  # step 0: a full base of the table (not timed)
    setup["first_commit_s"] = time.perf_counter() - t0
    for _ in range(2):
        step(lc, *batch())  # warm: deltas
    runs = []
    for r in range(args.runs):
        ids, grads = batch()
        if cuda:
            torch.cuda.synchronize()
        pid = os.getpid()
        t0 = time.perf_counter()
        watcher.poll()  # what the watcher thread does every interval: read and decode torch's state
        if not resize.pending():
            raise RuntimeError(f"run {r}: the step-boundary check did not see node {gone} gone")
        t_detect = time.perf_counter() - t0
        resize.run(rebuild=True)
        t_reformed = time.perf_counter() - t0
        step(lc, ids, grads, commit=False)
        path = time.perf_counter() - t0
        lc.commit(lc.next_step)
        commit_call = time.perf_counter() - t0 - path
        lc.wait_commit()  # the new generation's first commit, a full base, may be written in the background
        commit = time.perf_counter() - t0 - path
        ev = lc.events[-1]
        if ev.first_step_s is None or ev.mode != "in_process" or ev.pid != pid or ev.kind != "rebuild":
            raise RuntimeError(f"run {r}: unexpected resize event {ev}")
        if lc.topology.world_size != 1 or lc.topology.generation != 2 + r:
            raise RuntimeError(f"run {r}: topology after the re-form is {lc.topology}")
        runs.append(
            {
                "path_s": path,
                "commit_s": commit,
                "commit_call_s": commit_call,
                "detect_wall_s": t_detect,
                "reformed_s": t_reformed,
                **{k: getattr(ev, k) for k in PHASES},
                "generation": ev.new_generation,
                "restored_step": ev.restored_step,
                "source_tiers": ev.source_tiers,
            }
        )
        print(
            f"  run {r}: {path * 1e3:.1f} ms, then commit {commit:.2f} s ("
            + ", ".join(f"{k[:-2]} {getattr(ev, k) * 1e3:.1f}" for k in PHASES)
            + ")",
            flush=True,
        )
        # The node "comes back" for the next run: two members again, the other one gone.
        resize.nodes = (me, gone)
        watcher.adopt((me, gone), 0, 1)
        step(lc, *batch())
        lc.wait_commit()  # nothing in flight when the next run starts: its teardown would wait for it
    lc.close()
    raw = _raw(args, factory, lc.topology, world_store, batch, cuda)
    restart = [_restart(args) for _ in range(args.restart_runs)]
    del master
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "device": args.device,
        "rows": args.rows,
        "dim": args.dim,
        "table_bytes": args.rows * args.dim * 4,
        "batch": args.batch,
        "runs": runs,
        "setup": setup,
        "raw_runs": raw,
        "restart_runs": restart,
        "median": {k: statistics.median(r[k] for r in runs) for k in ("path_s", "commit_s", "detect_wall_s", *PHASES)},
        "raw_median_s": statistics.median(raw) if raw else None,
        "restart_median_s": statistics.median(x["total_s"] for x in restart) if restart else None,
        "target_s": 0.1,
    }


def _raw(args, factory, topology, store, batch, cuda) -> list[float]:
    """``close(wait=False)`` + construct + first lookup, the lifecycle's bare rebuild."""
    import torch

    from elastic_emb.context.group import wait_releases

    out = []
    ctx = factory(topology.model_copy(update={"generation": 1000}), store)
    ctx.lookup("t", batch()[0]).wait(timeout=60)
    for r in range(args.runs):
        ids, _ = batch()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctx.close(wait=False)
        ctx = factory(topology.model_copy(update={"generation": 1001 + r}), store)
        ctx.lookup("t", ids).wait(timeout=60)
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    ctx.close()
    wait_releases()
    return out


def _restart(args) -> dict:
    """A new Python process up to its first lookup: import, CUDA context, context, lookup."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", RESTART, repr(t0), str(args.rows), str(args.dim), str(args.batch), args.device],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESTART ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"the restart baseline failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    _, imported, total = line[0].split()
    return {"import_s": float(imported), "total_s": float(total)}


def report(r: dict) -> None:
    m = r["median"]
    print(
        f"\nworld size 1 rebuilt in process, {r['device']} ({r['gpu'] or 'cpu'}), table {r['table_bytes'] / 2**30:.2f} GiB, "
        f"batch {r['batch']}, {len(r['runs'])} runs (medians)"
    )
    print(f"whole path, poll -> first step done : {m['path_s'] * 1e3:8.1f} ms   (target {r['target_s'] * 1e3:.0f} ms)")
    print(f"  detect (poll + boundary check)    : {m['detect_wall_s'] * 1e3:8.2f} ms")
    for k in PHASES[1:]:
        print(f"  {k[:-2]:<33}: {m[k] * 1e3:8.2f} ms")
    if r["raw_median_s"] is not None:
        print(
            f"raw close(wait=False)+construct+lookup: {r['raw_median_s'] * 1e3:8.1f} ms   "
            f"(path / raw {m['path_s'] / r['raw_median_s']:.2f}x)"
        )
    if r["restart_median_s"] is not None:
        print(
            f"restarted process to first lookup   : {r['restart_median_s'] * 1e3:8.1f} ms   "
            f"(restart / path {r['restart_median_s'] / m['path_s']:.1f}x)"
        )
    print(f"then the new generation's first commit (a full base): {m['commit_s']:.2f} s, not in the path")


if __name__ == "__main__":
    sys.exit(main())
