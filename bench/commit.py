"""Cost of a commit every step: full snapshots against incremental (base + deltas) commits.

Starts ``--world`` rank processes (gloo on CPU), each its own "node" (so every commit also sends a
replica to the next node, ``replication=1``), each holding one fp32 table of ``--sizes-mb`` MB
with a row-wise Adagrad accumulator, in plain tensors that track the rows they write as
EmbContext does (``take_changed_rows``: the written rows, deduplicated at the commit). A step: ``--ids`` random ids among the rank's rows (duplicates
allowed), a gradient per id, the Adagrad update of the distinct rows. Per size, in the same
processes, with ``--steps`` steps each:

* ``none``: the step alone (the baseline);
* ``full``: the step, then ``SnapshotTier.commit`` of the whole shard (today's snapshot);
* ``incremental``: the step, then a delta commit of the rows written (a new base every
  ``--max-chain`` deltas, which is in the figures);
* ``restore``: restoring from a base alone, and from a base plus a chain of ``--max-chain``
  deltas, into a fresh context.

Reported (medians, the slowest rank of each step): step time per mode, the commit's share of the
step, commit time, bytes written and replicated per commit, and the ratios the issue's targets
name: incremental / full commit time, and the incremental commit time at 2x the table against 1x.
Every restore is checked row for row. JSON to ``--json``.

  python bench/commit.py --sizes-mb 64,128 --ids 2000 --steps 20      # CPU, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_emb.testing.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, as a script or as -m bench.*
from _ranks import collect  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DIM = 64


def worker(args) -> None:
    import torch

    from elastic_emb.protocol import ContextBase, ShardData
    from elastic_emb.sharding import owned_range
    from elastic_emb.state import Comm, SnapshotTier, restore
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology

    topo = Topology.from_env()
    store = worker_store(topo, timeout=120)
    rows_total = args.size_mb * 2**20 // (DIM * 4 + 4) * topo.world_size
    comm = Comm(topo, store, None, timeout=300)

    class Ctx(ContextBase):
        tracks_changes = True

        def __init__(self):
            self.topology = topo
            self.rows = owned_range(rows_total, topo.ep_size, topo.rank)
            n = len(self.rows)
            self.w = (torch.arange(n, dtype=torch.float32)[:, None] + torch.arange(DIM, dtype=torch.float32)) / 1024
            self.acc = torch.zeros(n)
            self.written: list[torch.Tensor] = []  # the rows each step wrote, as EmbContext tracks them

        def shard_views(self):
            return {"emb": ShardData("emb", self.rows, self.w, {"acc": self.acc})}

        def export_shard(self):
            return {"emb": ShardData("emb", self.rows, self.w.clone(), {"acc": self.acc.clone()})}

        def import_shard(self, shards):
            self.w.copy_(shards["emb"].weight)
            self.acc.copy_(shards["emb"].slots["acc"])

        def take_changes(self):
            mask = torch.zeros(len(self.rows), dtype=torch.bool)
            for rows in self.written:
                mask[rows] = True
            self.written = []
            return {"emb": mask}

        def take_changed_rows(self):  # what the lifecycle uses: work grows with the rows written
            rows = torch.unique(torch.cat(self.written)) if self.written else torch.empty(0, dtype=torch.int64)
            self.written = []
            return {"emb": rows}

        def step(self, gen: torch.Generator) -> None:
            ids = torch.randint(0, len(self.rows), (args.ids,), generator=gen)
            grads = torch.randn(args.ids, DIM, generator=gen)
            uniq, inv = torch.unique(ids, return_inverse=True)
            g = torch.zeros(len(uniq), DIM).index_add_(0, inv, grads)
            self.acc[uniq] += (g * g).mean(dim=1)
            self.w[uniq] -= 0.01 * g / (self.acc[uniq].sqrt()[:, None] + 1e-10)
            self.written.append(uniq)

    num_rows = {"emb": rows_total}
    results = {}
    for mode in ("none", "full", "incremental"):
        tier = SnapshotTier(args.state_dir, "bench", f"node{topo.rank}", replication=1, keep=2, max_chain=args.max_chain)
        ctx = Ctx()
        gen = torch.Generator().manual_seed(topo.rank)
        steps, commits, written, replicated = [], [], [], []
        for step in range(args.steps + 1):
            comm.barrier(f"{mode}-{step}")
            t0 = time.perf_counter()
            ctx.step(gen)
            t1 = time.perf_counter()
            if mode == "full" or (mode == "incremental" and step == 0):
                w, r = tier.commit(step, ctx.export_shard(), comm, num_rows, changes=ctx.take_changed_rows() if mode == "incremental" else None)
            elif mode == "incremental":
                w, r = tier.commit(step, ctx.shard_views(), comm, num_rows, changes=ctx.take_changed_rows())
            else:
                w = r = 0
            if mode != "none":
                tier.prune(comm)
            t2 = time.perf_counter()
            if step:  # step 0 of incremental is the first base: measured in `full`
                steps.append(t2 - t0)
                commits.append(t2 - t1)
                written.append(w)
                replicated.append(r)
        results[mode] = {"step_s": steps, "commit_s": commits, "written": written, "replicated": replicated}
        if mode == "incremental":
            # Restore from the base + the longest chain, then from a full commit of the same rows.
            want = ctx.export_shard()["emb"]
            chain = args.max_chain
            for s in range(args.steps + 1, args.steps + 1 + chain + 1):
                ctx.step(gen)
                tier.commit(s, ctx.shard_views(), comm, num_rows, changes=ctx.take_changed_rows())
            want = ctx.export_shard()["emb"]
            comm.barrier("restore-chain")
            t0 = time.perf_counter()
            fresh = Ctx()
            rep = restore(fresh, comm, snapshot=tier, durable=None)
            results["restore_chain_s"] = time.perf_counter() - t0
            ok = torch.equal(fresh.w, want.weight) and torch.equal(fresh.acc, want.slots["acc"])
            tier.commit(10**6, ctx.export_shard(), comm, num_rows)  # a full base of the same rows
            comm.barrier("restore-full")
            t0 = time.perf_counter()
            fresh = Ctx()
            rep2 = restore(fresh, comm, snapshot=tier, durable=None)
            results["restore_full_s"] = time.perf_counter() - t0
            ok = ok and torch.equal(fresh.w, want.weight) and rep2.step == 10**6
            if not ok:
                raise SystemExit(f"rank {topo.rank}: restored rows differ from the committed rows (step {rep.step})")
        shutil.rmtree(Path(args.state_dir) / "bench", ignore_errors=True)
        comm.barrier(f"{mode}-cleaned")
    results["shard_bytes"] = len(Ctx().rows) * (DIM * 4 + 4)
    comm.close()
    print(json.dumps({"rank": topo.rank, "results": results}), flush=True)


def launch(args, size_mb: int) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(args.world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC_", "ELASTIC_EMB_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), GROUP_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="bench", ELASTIC_EMB_BACKEND="gloo",
                   TORCHELASTIC_USE_AGENT_STORE="False", OMP_NUM_THREADS="1", ELASTIC_EMB_LOG_LEVEL="warning",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        cmd = [sys.executable, __file__, "--worker", "--size-mb", str(size_mb), "--steps", str(args.steps),
               "--ids", str(args.ids), "--max-chain", str(args.max_chain), "--state-dir", args.state_dir]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return collect(procs, args.timeout, f"size {size_mb} MB")


def summarize(size_mb: int, per_rank: list[dict], args) -> dict:
    def slowest(mode, key):
        n = len(per_rank[0]["results"][mode][key])
        return [max(r["results"][mode][key][i] for r in per_rank) for i in range(n)]

    row = {"size_mb_per_rank": size_mb, "world": args.world, "ids_per_step": args.ids, "max_chain": args.max_chain,
           "shard_bytes": per_rank[0]["results"]["shard_bytes"]}
    for mode in ("none", "full", "incremental"):
        row[f"step_{mode}_ms"] = statistics.median(slowest(mode, "step_s")) * 1e3
        if mode != "none":
            row[f"commit_{mode}_ms"] = statistics.median(slowest(mode, "commit_s")) * 1e3
            row[f"written_{mode}_bytes"] = statistics.median(per_rank[0]["results"][mode]["written"])
            row[f"replicated_{mode}_bytes"] = statistics.median(per_rank[0]["results"][mode]["replicated"])
            row[f"overhead_{mode}_pct"] = 100 * (row[f"step_{mode}_ms"] / row["step_none_ms"] - 1)
    row["incremental_over_full"] = row["commit_incremental_ms"] / row["commit_full_ms"]
    row["restore_chain_s"] = max(r["results"]["restore_chain_s"] for r in per_rank)
    row["restore_full_s"] = max(r["results"]["restore_full_s"] for r in per_rank)
    row["restore_chain_over_full"] = row["restore_chain_s"] / row["restore_full_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="64,128", help="table MB per rank, comma-separated")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ids", type=int, default=2000, help="ids per step per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-chain", type=int, default=8)
    ap.add_argument("--state-dir", default=None, help="default: a fresh directory under /dev/shm")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", default="bench/commit.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size-mb", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    own_dir = args.state_dir is None
    args.state_dir = args.state_dir or tempfile.mkdtemp(prefix="elastic_emb-bench-commit-", dir="/dev/shm")
    rows = []
    try:
        for size in [int(s) for s in args.sizes_mb.split(",")]:
            row = summarize(size, launch(args, size), args)
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    finally:
        if own_dir:
            shutil.rmtree(args.state_dir, ignore_errors=True)
    if len(rows) >= 2:
        print(f"incremental commit at {rows[-1]['size_mb_per_rank']} MB / {rows[0]['size_mb_per_rank']} MB per rank: "
              f"{rows[-1]['commit_incremental_ms'] / rows[0]['commit_incremental_ms']:.2f}x")
    import torch

    Path(args.json).write_text(json.dumps({"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                           "args": {k: v for k, v in vars(args).items() if k not in ("worker", "size_mb")},
                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
