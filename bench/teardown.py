"""Communicator teardown on NCCL: destroy (shutdown) against abort, healthy and with a dead peer,
and the context's destroy + reconstruct time.

Each trial starts two fresh worker processes (one GPU each) that build an EmbContext, look up
once, then:

1. destroy + reconstruct: ``close()`` then a new ``EmbContext`` for the next generation and its
   first lookup, timed as one figure and by part; then the same the way the lifecycle does it,
   ``close(wait=False)`` (the old communicator is destroyed by a background thread while the new
   one forms), with that release waited for and its errors reported;
2. teardown, by mode (``shutdown`` = ncclCommDestroy path, ``abort`` = ncclCommAbort path):
   ``healthy``: both ranks close together; ``broken``: rank 1 exits hard (``os._exit``) and
   rank 0 closes. Every close is bounded by the context's timeout, so a hang shows as a time at
   the bound rather than a stuck benchmark.

    python3 bench/teardown.py --runs 3 --out out/teardown.json      # on the 2-GPU machine

Prints a table of medians and writes JSON. Without two CUDA devices it says so and exits 0 with
no figures (it is a GPU benchmark; CI never runs it). ``--device cpu`` is a smoke run of the
script: the same trials on gloo (two CPU ranks), whose teardown has no NCCL to destroy or abort.

    python3 bench/teardown.py --device cpu --runs 1 --rows 4096 --timeout 5 --out out/teardown_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import start

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from elastic_emb.context import EmbContext
from elastic_emb.protocol import TableSpec
from elastic_emb.topology import Topology

rank, port, mode, scenario, rows = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
cuda = sys.argv[7] == "cuda"
device = f"cuda:{rank}" if cuda else "cpu"
sync = torch.cuda.synchronize if cuda else (lambda: None)
if cuda:
    torch.cuda.set_device(rank)
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60))
tables = [TableSpec(name="t", num_rows=rows, dim=128)]

def topo(gen):
    return Topology.build(run_id="teardown", generation=gen, rank=rank, world_size=2, local_rank=rank,
                          local_world_size=2, node_rank=0, num_nodes=1, ep_size=2, backend="nccl" if cuda else "gloo",
                          master_addr="127.0.0.1", master_port=port)

def barrier(name):
    deadline = time.monotonic() + 60

    def wait(key, count):
        while int(store.add(key, 0)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {name} timed out")
            time.sleep(0.001)

    store.add(name, 1)
    wait(name, 2)
    # Rank 0 hosts the store: it returns only once the peer has stopped polling this barrier, so
    # that rank 0 exiting next never resets the peer's connection mid-poll.
    if rank == 0:
        wait(name + "/seen", 1)
    else:
        store.add(name + "/seen", 1)

ids = torch.randint(0, rows, (1 << 16,), device=device)
t0 = time.perf_counter()
# seed=None: a rebuilt context's rows are overwritten by the restore, so nothing is initialised
# (seeding 4M rows on the CPU took 13 s here and is not part of a resize).
ctx = EmbContext(topo(0), store, tables=tables, timeout=float(sys.argv[6]), seed=None)
ctx.lookup("t", ids).wait(); sync()
first_build = time.perf_counter() - t0

barrier("rebuild")
t0 = time.perf_counter()
ctx.close()
t1 = time.perf_counter()
ctx = EmbContext(topo(1), store, tables=tables, timeout=float(sys.argv[6]), seed=None)
t2 = time.perf_counter()
ctx.lookup("t", ids).wait(); sync()
t3 = time.perf_counter()
out = {"rank": rank, "first_build_s": first_build, "close_s": t1 - t0, "construct_s": t2 - t1,
       "first_lookup_s": t3 - t2, "rebuild_s": t3 - t0}

# The library's resize path: close(wait=False) hands the old communicator to a background thread
# (bounded) and the new context forms meanwhile; then wait for that release and report it.
from elastic_emb.context import wait_releases

barrier("overlap")
t0 = time.perf_counter()
ctx.close(wait=False)
t1 = time.perf_counter()
ctx = EmbContext(topo(2), store, tables=tables, timeout=float(sys.argv[6]), seed=None)
ctx.lookup("t", ids).wait(); sync()
out["overlapped_rebuild_s"] = time.perf_counter() - t0
out["overlapped_close_s"] = t1 - t0
rel = wait_releases(60)
out["overlapped_close_done_s"] = time.perf_counter() - t0
out["release"] = rel
if any(r["error"] or not r["done"] for r in rel):
    out["overlapped_error"] = repr(rel)[:300]

barrier("teardown")
if scenario == "broken" and rank == 1:
    print(json.dumps(out), flush=True)
    os._exit(0)
if scenario == "broken":
    time.sleep(0.5)  # let the peer be gone
t0 = time.perf_counter()
ctx.close(abort=(mode == "abort"))
out["teardown_s"] = time.perf_counter() - t0
print(json.dumps(out), flush=True)
os._exit(0)
"""


def trial(mode: str, scenario: str, rows: int, timeout: float, device: str) -> list[dict]:
    port = free_port()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", ELASTIC_EMB_LOG_LEVEL="warning")
    procs = [
        start(["python", "-c", WORKER, str(r), str(port), mode, scenario, str(rows), str(timeout), device], env)
        for r in range(2)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60 + 3 * timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"worker printed no result (rc={p.returncode}):\n{err[-2000:]}")
        results.append(json.loads(lines[-1]))
    print(
        f"  trial {scenario}/{mode}: rank0 teardown {results[0].get('teardown_s', float('nan')):.4f} s, "
        f"rebuild {results[0]['rebuild_s']:.4f} s",
        file=sys.stderr,
        flush=True,
    )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description="NCCL teardown: destroy vs abort, and rebuild time")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1 << 22, help="rows of the one table (dim 128, fp32)")
    ap.add_argument("--timeout", type=float, default=10.0, help="the context's timeout: bounds every close")
    ap.add_argument("--out", default="out/teardown.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run on gloo")
    ap.add_argument("--scenarios", nargs="+", choices=("healthy", "broken"), default=["healthy", "broken"])
    ap.add_argument("--modes", nargs="+", choices=("shutdown", "abort"), default=["shutdown", "abort"])
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("bench/teardown.py: needs 2 CUDA devices; none measured (--device cpu: a smoke run on gloo)")
        return
    rows: dict[tuple[str, str], list[list[dict]]] = {}
    for _ in range(args.runs):
        for scenario in args.scenarios:
            for mode in args.modes:
                rows.setdefault((scenario, mode), []).append(
                    trial(mode, scenario, args.rows, args.timeout, args.device)
                )
    med = statistics.median
    table = []
    for (scenario, mode), trials in rows.items():
        r0 = [t[0] for t in trials]
        table.append(
            {
                "scenario": scenario,
                "mode": mode,
                "runs": len(trials),
                "teardown_rank0_s": med(t["teardown_s"] for t in r0),
                "teardown_rank0_max_s": max(t["teardown_s"] for t in r0),
            }
        )
    rebuild = [t[0] for trials in rows.values() for t in trials]
    summary = {
        "rebuild_s": med(t["rebuild_s"] for t in rebuild),
        "close_s": med(t["close_s"] for t in rebuild),
        "construct_s": med(t["construct_s"] for t in rebuild),
        "first_lookup_s": med(t["first_lookup_s"] for t in rebuild),
        "first_build_s": med(t["first_build_s"] for t in rebuild),
        "overlapped_rebuild_s": med(
            [t["overlapped_rebuild_s"] for t in rebuild if "overlapped_rebuild_s" in t] or [float("nan")]
        ),
        "overlapped_rebuild_max_s": max(
            [t["overlapped_rebuild_s"] for t in rebuild if "overlapped_rebuild_s" in t] or [float("nan")]
        ),
        "background_release_s": med(
            [r["seconds"] for t in rebuild for r in t.get("release", []) if r["seconds"]] or [float("nan")]
        ),
        "overlapped_errors": sorted({t["overlapped_error"] for t in rebuild if "overlapped_error" in t}),
        "samples": len(rebuild),
    }
    print(f"{'scenario':9} {'mode':9} {'teardown median s':>18} {'max s':>8}")
    for row in table:
        print(f"{row['scenario']:9} {row['mode']:9} {row['teardown_rank0_s']:18.4f} {row['teardown_rank0_max_s']:8.4f}")
    print(
        f"destroy + reconstruct (close, construct, first lookup): median {summary['rebuild_s']:.4f} s "
        f"= {summary['close_s']:.4f} + {summary['construct_s']:.4f} + {summary['first_lookup_s']:.4f} "
        f"(cold first build {summary['first_build_s']:.3f} s; n={summary['samples']})"
    )
    print(
        f"destroy + reconstruct as the lifecycle does it (close(wait=False)): median "
        f"{summary['overlapped_rebuild_s']:.4f} s to the first lookup (max {summary['overlapped_rebuild_max_s']:.4f}); "
        f"background destroy took {summary['background_release_s']:.4f} s; errors: {summary['overlapped_errors'] or 'none'}"
    )
    write_json(args.out, "teardown", {"rows": args.rows, "device": args.device, "teardown": table, "rebuild": summary})


if __name__ == "__main__":
    main()
