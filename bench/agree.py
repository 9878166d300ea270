"""Topology agreement latency with simulated ranks against one real TCPStore on loopback.

Each simulated rank is a thread with its own TCPStore client connection (as a worker process
would have); all start together behind a barrier. One trial = one generation: the time from the
barrier until the last rank returns from agree(). Prints a table of medians and writes JSON.

    .venv/bin/python bench/agree.py --ranks 8 64 256 --runs 7 --out out/agree.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elastic_emb.topology import Topology, agree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


def trial(port: int, world_size: int, generation: int, clients: list) -> dict:
    barrier = threading.Barrier(world_size + 1)
    per_rank = [0.0] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        t = Topology.build(
            run_id="bench",
            generation=generation,
            rank=rank,
            world_size=world_size,
            local_rank=rank % 8,
            local_world_size=8 if world_size % 8 == 0 else world_size,
            node_rank=rank // 8 if world_size % 8 == 0 else 0,
            num_nodes=world_size // 8 if world_size % 8 == 0 else 1,
            ep_size=world_size if world_size & (world_size - 1) == 0 else 1,
            backend="gloo",
            master_addr="127.0.0.1",
            master_port=port,
        )
        barrier.wait(timeout=60)
        start = time.perf_counter()
        try:
            agree(t, clients[rank], timeout=60)
        except BaseException as exc:  # reported below, never swallowed
            errors.append(exc)
        per_rank[rank] = time.perf_counter() - start

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for th in threads:
        th.start()
    barrier.wait(timeout=60)
    start = time.perf_counter()
    for th in threads:
        th.join(timeout=120)
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"agreement failed in the benchmark: {errors[0]!r}")
    return {"wall_s": wall, "rank_median_s": statistics.median(per_rank), "rank_max_s": max(per_rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="out/agree.json")
    args = ap.parse_args()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port = master.port
    results = []
    generation = 0
    for ws in args.ranks:
        clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)) for _ in range(ws)]
        trial(port, ws, generation, clients)  # warm-up (connections, imports)
        generation += 1
        runs = []
        for _ in range(args.runs):
            runs.append(trial(port, ws, generation, clients))
            generation += 1
        row = {
            "ranks": ws,
            "runs": args.runs,
            "wall_median_ms": 1000 * statistics.median(r["wall_s"] for r in runs),
            "wall_min_ms": 1000 * min(r["wall_s"] for r in runs),
            "wall_max_ms": 1000 * max(r["wall_s"] for r in runs),
            "per_rank_median_ms": 1000 * statistics.median(r["rank_median_s"] for r in runs),
        }
        results.append(row)
        print(
            f"ranks={ws:4d}  median {row['wall_median_ms']:8.1f} ms  (min {row['wall_min_ms']:.1f}, max {row['wall_max_ms']:.1f}; "
            f"per-rank median {row['per_rank_median_ms']:.1f} ms)",
            flush=True,
        )
        del clients
    write_json(args.out, "agree", {"results": results})


if __name__ == "__main__":
    main()
