"""What a new NCCL communicator costs to set up, by part and by configuration (2 GPUs).

A context's construction on NCCL is dominated by the communicator: ``ncclCommInitRank`` and the
connections its first collectives set up. This measures, for each configuration in ``--configs``
(environment variables and ``ProcessGroupNCCL.Options`` settings, each in fresh processes):

* ``init``: ``ProcessGroupNCCL`` + ``eager_connect_single_device`` (ncclCommInitRank);
* ``first_allreduce`` / ``first_alltoall``: the first collective of each kind (connection set-up);
* ``alltoall_GBps``: all-to-all throughput at ``--mib`` MiB per rank once connected (bytes leaving
  each GPU per second), so a cheaper set-up that costs bandwidth shows it;
* ``destroy``: ``shutdown()`` of the communicator;
* ``init_bg``: init while the previous communicator is destroyed by a background thread.

Trial 0 of each process is cold (NCCL loads its kernels); trials 1.. are what a rebuild pays.

    python3 bench/nccl_setup.py --out out/gpu/nccl_setup.json          # on the 2-GPU machine

Prints a table of medians over the warm trials of rank 0 and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from elastic_emb.testing.ports import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

CONFIGS = {
    "default": {},
    "cumem-off": {"env": {"NCCL_CUMEM_ENABLE": "0"}},
    "p2p-channels-8": {"env": {"NCCL_MAX_P2P_NCHANNELS": "8"}},
    "p2p-channels-4": {"env": {"NCCL_MAX_P2P_NCHANNELS": "4"}},
    "max-ctas-8": {"config": {"max_ctas": 8}},
    "max-ctas-16": {"config": {"max_ctas": 16}},
    "ib-off": {"env": {"NCCL_IB_DISABLE": "1"}},
    "a2a-only": {"skip_allreduce": True},
}

WORKER = r"""
import json, os, statistics, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist

rank, port, trials, mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = json.loads(sys.argv[5])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
torch.zeros(1, device=dev); torch.cuda.synchronize()
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60))

def barrier(name):
    deadline = time.monotonic() + 60

    def wait(key, count):
        while int(store.add(key, 0)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {name} timed out")
            time.sleep(0.0005)

    store.add(name, 1)
    wait(name, 2)
    # Rank 0 hosts the store: it returns only once the peer has stopped polling this barrier, so
    # that rank 0 exiting next never resets the peer's connection mid-poll.
    if rank == 0:
        wait(name + "/seen", 1)
    else:
        store.add(name + "/seen", 1)

def build(gen):
    opts = dist.ProcessGroupNCCL.Options()
    for k, v in cfg.get("config", {}).items():
        setattr(opts.config, k, v)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"gen{gen}/", store), rank, 2, opts)
    pg.eager_connect_single_device(dev)
    return pg

def a2a(pg, n):
    x = torch.full((n,), float(rank), device=dev)
    y = torch.empty_like(x)
    pg.alltoall_base(y, x, [n // 2, n - n // 2], [n // 2, n - n // 2], dist.AllToAllOptions()).wait()
    torch.cuda.synchronize()
    return y

out = {"rank": rank, "trials": []}
old = None
for trial in range(trials):
    barrier(f"t{trial}")
    r = {}
    closer = None
    if old is not None:
        if cfg.get("_bg", True):
            closer = threading.Thread(target=old.shutdown); closer.start()
        else:
            t0 = time.perf_counter(); old.shutdown(); r["destroy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pg = build(trial)
    r["init_s"] = time.perf_counter() - t0
    if not cfg.get("skip_allreduce"):
        t0 = time.perf_counter()
        x = torch.ones(1, device=dev); pg.allreduce([x]).wait(); torch.cuda.synchronize()
        r["first_allreduce_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    a2a(pg, 256)
    r["first_alltoall_s"] = time.perf_counter() - t0
    r["ready_s"] = r["init_s"] + r.get("first_allreduce_s", 0) + r["first_alltoall_s"]
    if closer is not None:
        t0 = time.perf_counter(); closer.join(60); r["bg_destroy_tail_s"] = time.perf_counter() - t0
    n = mib * (1 << 20) // 4
    y = a2a(pg, n)
    assert float(y[0]) == 0 and float(y[-1]) == 1, "all-to-all delivered wrong data"
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); a2a(pg, n); times.append(time.perf_counter() - t0)
    r["alltoall_GBps"] = (n * 4 / 2) / statistics.median(times) / 1e9
    out["trials"].append(r)
    old = pg
t0 = time.perf_counter(); old.shutdown(); out["last_destroy_s"] = time.perf_counter() - t0
print(json.dumps(out), flush=True)
"""


def run_config(name: str, cfg: dict, trials: int, mib: int, debug: bool) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **cfg.get("env", {}))
    if debug:
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(port), str(trials), str(mib), json.dumps(cfg)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    res = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"config": name, "error": "timed out after 90 s: " + (p.communicate()[1] or "")[-800:]}
        lines = [ln for ln in o.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            return {"config": name, "error": f"rc={p.returncode}: {e[-1500:]}"}
        res.append(json.loads(lines[-1]))
        if debug and not res[1:]:
            res[0]["nccl_timings"] = [ln for ln in e.splitlines() if "timing" in ln.lower() or "Init COMPLETE" in ln][
                :20
            ]
    warm = res[0]["trials"][1:]
    med = lambda k: statistics.median(t[k] for t in warm) if warm and k in warm[0] else None  # noqa: E731
    row = {"config": name, "settings": cfg, "cold_ready_s": res[0]["trials"][0]["ready_s"]}
    for k in ("init_s", "first_allreduce_s", "first_alltoall_s", "ready_s", "bg_destroy_tail_s", "alltoall_GBps"):
        row[k] = med(k)
    row["destroy_s"] = res[0]["last_destroy_s"]
    row["raw"] = res
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description="NCCL communicator set-up cost by part and configuration")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--trials", type=int, default=4, help="communicators per process (the first is cold)")
    ap.add_argument("--mib", type=int, default=1024, help="all-to-all size per rank for the bandwidth figure")
    ap.add_argument("--debug", action="store_true", help="collect NCCL's own init timings (NCCL_DEBUG=INFO)")
    ap.add_argument("--out", default="out/nccl_setup.json")
    args = ap.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print("bench/nccl_setup.py: needs 2 CUDA devices; none measured (an NCCL benchmark: nothing runs on the CPU)")
        return
    rows = []
    print(
        f"{'config':16} {'init':>7} {'1st ar':>7} {'1st a2a':>8} {'ready':>7} {'cold':>7} {'destroy':>8} {'a2a GB/s':>9}"
    )
    f = lambda v, w=7: f"{v:{w}.3f}" if isinstance(v, float) else f"{'-':>{w}}"  # noqa: E731
    for name in args.configs:
        r = run_config(name, CONFIGS[name], args.trials, args.mib, args.debug)
        rows.append(r)
        if "error" in r:
            print(f"{r['config']:16} ERROR {r['error'][:300]}")
            continue
        print(
            f"{r['config']:16} {f(r['init_s'])} {f(r['first_allreduce_s'])} {f(r['first_alltoall_s'], 8)} "
            f"{f(r['ready_s'])} {f(r['cold_ready_s'])} {f(r['destroy_s'], 8)} {f(r['alltoall_GBps'], 9)}"
        )
        for line in r["raw"][0].get("nccl_timings", []):
            print("    " + line[-200:])
        sys.stdout.flush()
    write_json(args.out, "nccl_setup", {"rows": rows})


if __name__ == "__main__":
    main()
