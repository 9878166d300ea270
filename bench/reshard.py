"""Reshard throughput and rebuild latency of elastic_emb's state tiers, against plain DCP.

Starts ``--world`` real rank processes (gloo on CPU, NCCL with ``--device cuda``; one GPU per
rank), each holding an EmbContext with one fp32 table of ``--sizes-mb`` MB in total, and
measures per run, in the same processes:

* ``rebuild``: destroy + construct of the context as the lifecycle does it (``close(wait=False)``,
  whose communicator is destroyed by a background thread, + ``EmbContext(...)`` on a new
  generation's store prefix, ``seed=None`` since restore overwrites the rows anyway); the
  background destroy is then waited for and its time and errors recorded;
* ``live``: the lifecycle's live restore (inventory through the store, plan, rows moved by the
  transport: on CPU pulled out of the sender's memory by cross-memory attach, ``cma``, or gloo
  send/recv with ``--transport p2p``; on CUDA one all-to-all on the new context's communicator;
  ``live_transport`` in the JSON says which moved them, per rank and run) where every row
  changes owner: rank r's old rows become rank r+1's; GB/s per rank = bytes this rank sent / restore seconds, for the whole restore and for
  the row exchange alone; ``warm``: the same restore repeated on the now-connected communicator
  (NCCL sets up peer connections on a communicator's first collective);
* ``snap_commit`` / ``snap_restore``: node-local snapshot commit (write + replica to the next
  "node" over the communicator) and restore from the files (read, CRC32 check, place);
* ``durable_commit`` / ``durable_restore``: the durable tier (DCP, synchronous here);
* ``dcp_baseline``: plain ``torch.distributed.checkpoint`` save + load of the same DTensors
  through storage (``--dcp-dir``), the yardstick the ratios are against;
* ``crc32``: the checksum's GB/s on one rank's shard (the cost it adds to a snapshot).

Every number is the slowest rank of a run (a collective ends with its slowest member); the table
shows medians over ``--runs`` and ratios against the DCP baseline of the same run set. Results
also go to ``--json``. Rows are checked after every restore (each row holds its global index).

  python bench/reshard.py --sizes-mb 256,2048 --runs 3                       # CPU, 2 ranks
  python bench/reshard.py --device cuda --world 2 --sizes-mb 8192 --runs 3   # 2 GPUs, 4 GiB each
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import collect, start, torchrun_env

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
METHODS = ("rebuild", "live", "snapshot", "durable", "dcp")


# ---------------------------------------------------------------------------------------------
# Worker (one rank)
# ---------------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from elastic_emb.context import EmbContext, wait_releases
    from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec
    from elastic_emb.sharding import owned_range
    from elastic_emb.state import Comm, DurableTier, SnapshotTier, checksum, restore
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology

    topo0 = Topology.from_env()
    rank, world = topo0.rank, topo0.world_size
    store = worker_store(topo0, timeout=300)
    cuda = args.device == "cuda"
    device = torch.device("cuda", topo0.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo",
        store=dist.PrefixStore("bench_default/", store),
        rank=rank,
        world_size=world,
    )
    dim = 128
    num_rows = (args.size_mb * 2**20 // (dim * 4)) // world * world
    spec = TableSpec(name="emb", num_rows=num_rows, dim=dim)

    def factory(t):
        return EmbContext(
            t,
            store,
            tables=[spec],
            optimizer=OptimizerSpec(kind="sgd"),
            device=device,
            seed=None,
            timeout=300.0,
            staging_rows_per_rank=16,
        )

    gen = [0]

    def next_topo():
        gen[0] += 1
        return topo0.with_changes(generation=gen[0])

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def fill(ctx):
        rr = owned_range(num_rows, world, rank)
        w = torch.arange(rr.start, rr.stop, dtype=torch.float32, device=device)[:, None].expand(-1, dim)
        ctx.import_shard({"emb": ShardData("emb", rr, w, {})})

    def check(ctx, shift: int, what: str):
        """Each row must hold its global index; ``shift``: rows relabelled by that many ranks."""
        rr = owned_range(num_rows, world, rank)
        src = owned_range(num_rows, world, (rank - shift) % world)
        w = ctx.export_shard()["emb"].weight
        probe = [0, len(rr) // 2, len(rr) - 1]
        got = w[probe, 0].tolist()
        want = [float(src.start + i) for i in probe]
        if got != want or not bool((w[:, -1] == w[:, 0]).all()):
            raise SystemExit(f"rank {rank}: {what}: rows {probe} hold {got}, expected {want}")

    state_root = Path(args.state_dir) / f"elastic_emb-bench-{os.getppid()}-r{rank}"
    results: list[dict] = []
    ctx = factory(next_topo())
    fill(ctx)
    bench_start = time.monotonic()
    for run in range(args.runs):
        r: dict = {}
        sync()
        # -- rebuild: destroy + construct --------------------------------------------------
        old = ctx.export_shard()["emb"]
        old_topo = ctx.topology
        t0 = time.perf_counter()
        ctx.close(wait=False)  # as the lifecycle does: the communicator is destroyed in the background
        t1 = time.perf_counter()
        ctx = factory(next_topo())
        t2 = time.perf_counter()
        r["close_s"], r["construct_s"], r["rebuild_s"] = t1 - t0, t2 - t1, t2 - t0
        released = wait_releases(120)
        r["background_release_s"] = max((x["seconds"] or 0.0 for x in released), default=0.0)
        r["background_release_errors"] = [x for x in released if x["error"] or not x["done"]]
        # -- live: every row changes owner -------------------------------------------------
        if "live" in args.methods:
            piece = ShardData("emb", owned_range(num_rows, world, (rank + 1) % world), old.weight, {})
            comm = Comm(ctx.topology, store, ctx.process_group, timeout=300)
            # Twice on the same communicator: "live" is the first restore after construction,
            # "live_warm" the same restore repeated, the data path alone (it shows any set-up
            # the first collective of a new communicator still pays).
            for key in ("live", "live_warm"):
                sync()
                t0 = time.perf_counter()
                rep = restore(
                    ctx,
                    comm,
                    snapshot=None,
                    durable=None,
                    live=[piece],
                    live_commit=(run, old_topo.generation, old_topo.fingerprint()),
                )
                if cuda:
                    torch.cuda.synchronize()
                r[f"{key}_s"] = time.perf_counter() - t0
                r[f"{key}_transfer_s"] = rep.transfer_seconds
                r[f"{key}_bytes"] = rep.bytes_moved
                r[f"{key}_transport"] = rep.transport
                check(ctx, -1 if world > 1 else 0, key)
        # The rebuilt context's rows are lazily zero (seed=None) unless restored: the tiers below
        # must commit the indexed rows that check() expects, whichever methods ran.
        fill(ctx)
        del old
        shard_bytes = len(owned_range(num_rows, world, rank)) * dim * 4
        # -- crc32 of the shard ------------------------------------------------------------
        host = ctx.export_shard()["emb"].weight.cpu()
        t0 = time.perf_counter()
        checksum(host)
        r["crc32_s"] = time.perf_counter() - t0
        del host
        # -- snapshot ----------------------------------------------------------------------
        if "snapshot" in args.methods:
            tier = SnapshotTier(state_root, "bench", f"node{rank}", replication=1 if world > 1 else 0, keep=1)
            comm = Comm(ctx.topology, store, ctx.process_group, timeout=300)
            sync()
            t0 = time.perf_counter()
            tier.commit(run, ctx.export_shard(), comm, {"emb": num_rows})
            sync()
            r["snap_commit_s"] = time.perf_counter() - t0
            ctx.close()
            ctx = factory(next_topo())
            comm = Comm(ctx.topology, store, ctx.process_group, timeout=300)
            sync()
            t0 = time.perf_counter()
            rep = restore(ctx, comm, snapshot=tier, durable=None)
            if cuda:
                torch.cuda.synchronize()
            r["snap_restore_s"] = time.perf_counter() - t0
            assert rep.step == run, rep
            check(ctx, 0, "snapshot")
            sync()
            shutil.rmtree(tier.node_dir, ignore_errors=True)
        # -- durable tier ------------------------------------------------------------------
        if "durable" in args.methods:
            # The tier takes only manifests of its own run id (the topology's); each run its own root.
            dtier = DurableTier(Path(args.dcp_dir) / "durable" / f"run{run}", ctx.topology.run_id)
            comm = Comm(ctx.topology, store, ctx.process_group, timeout=300)
            sync()
            t0 = time.perf_counter()
            dtier.commit(run, ctx.export_shard(), comm, {"emb": num_rows}, dist.group.WORLD)
            sync()
            r["durable_commit_s"] = time.perf_counter() - t0
            ctx.close()
            ctx = factory(next_topo())
            comm = Comm(ctx.topology, store, ctx.process_group, timeout=300)
            sync()
            t0 = time.perf_counter()
            rep = restore(ctx, comm, snapshot=None, durable=dtier, durable_group=dist.group.WORLD)
            if cuda:
                torch.cuda.synchronize()
            r["durable_restore_s"] = time.perf_counter() - t0
            assert rep.source_tiers == ["durable"], rep
            check(ctx, 0, "durable")
            sync()
            if rank == 0:
                shutil.rmtree(dtier.root, ignore_errors=True)
        # -- plain DCP save + load through storage (the baseline) ---------------------------
        if "dcp" in args.methods:
            mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
            shape = torch.Size((num_rows, dim))

            def sd_of(t):
                return {
                    "emb.weight": DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape, stride=(dim, 1))
                }

            path = Path(args.dcp_dir) / f"baseline{run}"
            sync()
            t0 = time.perf_counter()
            dcp.save(sd_of(ctx.export_shard()["emb"].weight), checkpoint_id=str(path))
            sync()
            t1 = time.perf_counter()
            target = torch.zeros(len(owned_range(num_rows, world, rank)), dim, device=device)
            dcp.load(sd_of(target), checkpoint_id=str(path))
            ctx.import_shard({"emb": ShardData("emb", owned_range(num_rows, world, rank), target, {})})
            sync()
            t2 = time.perf_counter()
            r["dcp_save_s"], r["dcp_load_s"], r["dcp_s"] = t1 - t0, t2 - t1, t2 - t0
            check(ctx, 0, "dcp")
            del target
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        r["shard_bytes"] = shard_bytes
        results.append(r)
        # Stop early (all ranks alike, rank 0 decides) when another run would not fit the budget.
        elapsed = time.monotonic() - bench_start
        go = [elapsed + 1.2 * elapsed / (run + 1) < args.max_seconds]
        dist.broadcast_object_list(go, src=0)
        if not go[0] and run + 1 < args.runs:
            print(f"rank {rank}: stopping after {run + 1} runs (--max-seconds {args.max_seconds})", file=sys.stderr)
            break
    ctx.close()
    shutil.rmtree(state_root, ignore_errors=True)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "runs": results}), flush=True)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def launch(args, size_mb: int) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(args.world):
        # one node, every rank a local rank of it (one GPU each with --device cuda)
        extra = {
            "ELASTIC_EMB_BACKEND": "nccl" if args.device == "cuda" else "gloo",
            "OMP_NUM_THREADS": str(args.threads),
            "ELASTIC_EMB_LOG_LEVEL": "warning",
            "NCCL_NVLS_ENABLE": "0",
        }
        if args.transport:
            extra["ELASTIC_EMB_TRANSPORT"] = args.transport
        env = torchrun_env(rank, args.world, port, run_id="bench", extra=extra)
        cmd = [
            "python",
            __file__,
            "--worker",
            "--size-mb",
            str(size_mb),
            "--runs",
            str(args.runs),
            "--device",
            args.device,
            "--state-dir",
            args.state_dir,
            "--dcp-dir",
            args.dcp_dir,
            "--methods",
            ",".join(args.methods),
            "--max-seconds",
            str(args.max_seconds),
        ]
        procs.append(start(cmd, env))
    return collect(procs, args.timeout, f"size {size_mb} MB")


def summarize(size_mb: int, per_rank: list[dict], world: int) -> dict:
    runs = len(per_rank[0]["runs"])
    keys = sorted({k for r in per_rank for run in r["runs"] for k in run if k.endswith("_s")})
    slowest = {k: [max(r["runs"][i][k] for r in per_rank) for i in range(runs)] for k in keys}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    shard = max(r["runs"][0]["shard_bytes"] for r in per_rank)
    total = size_mb * 2**20
    row = {
        "size_mb": size_mb,
        "world": world,
        "shard_bytes_per_rank": shard,
        "runs": runs,
        "median_s": med,
        "per_run_slowest_rank_s": slowest,
    }
    if "live_s" in med:
        sent = [statistics.median(run["live_bytes"] for run in r["runs"]) for r in per_rank]
        row["live_gbps_per_rank"] = min(s / med["live_s"] for s in sent) / 1e9
        row["live_transfer_gbps_per_rank"] = min(s / med["live_transfer_s"] for s in sent) / 1e9
        row["live_warm_gbps_per_rank"] = min(s / med["live_warm_s"] for s in sent) / 1e9
        row["live_warm_transfer_gbps_per_rank"] = min(s / med["live_warm_transfer_s"] for s in sent) / 1e9
        row["live_bytes_per_rank"] = min(sent)
        # What moved the rows, per rank and run (cma+p2p / p2p: some or all pairs fell back to gloo).
        row["live_transports"] = sorted(
            {run.get(f"{k}_transport") or "?" for r in per_rank for run in r["runs"] for k in ("live", "live_warm")}
        )
    if "crc32_s" in med:
        row["crc32_gbps"] = shard / med["crc32_s"] / 1e9
    if "dcp_s" in med:
        base = med["dcp_s"]
        row["dcp_gbps"] = total / base / 1e9
        ratios = {}
        for k in ("live_s", "snap_restore_s", "durable_restore_s"):
            if k in med:
                ratios[k.removesuffix("_s") + "_vs_dcp_save_load"] = base / med[k]
        if "snap_commit_s" in med:
            ratios["snap_commit+restore_vs_dcp_save_load"] = base / (med["snap_commit_s"] + med["snap_restore_s"])
        if "durable_commit_s" in med:
            ratios["durable_commit+restore_vs_dcp_save_load"] = base / (
                med["durable_commit_s"] + med["durable_restore_s"]
            )
        row["speedup"] = ratios
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes-mb",
        default=None,
        help="total table sizes (MB, comma-separated; default 256,2048 on CPU, 8192 on CUDA: 4 GiB per GPU at --world 2)",
    )
    ap.add_argument("--world", type=int, default=2, help="rank processes (one GPU each with --device cuda)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument(
        "--transport",
        choices=("cma", "p2p", "alltoall"),
        default=None,
        help="row transport (default: cma on CPU, i.e. cross-memory attach with gloo p2p "
        "for peers it cannot read; alltoall on CUDA)",
    )
    ap.add_argument(
        "--methods", default=",".join(METHODS[1:]), help="subset of live,snapshot,durable,dcp (rebuild always runs)"
    )
    ap.add_argument(
        "--state-dir", default=None, help="snapshot root (default /dev/shm if it has room, else a temp dir)"
    )
    ap.add_argument("--dcp-dir", default=None, help="DCP checkpoints (storage; default a temp dir on disk)")
    ap.add_argument(
        "--json", "--out", dest="json", default=None, help="write results here (default out/reshard-<device>.json)"
    )
    ap.add_argument("--timeout", type=float, default=580.0, help="hard limit per table size (seconds)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="per table size, start no run that would end past this (default: 230 on CUDA, "
        "so 3 runs of a 8 GiB table fit a 300 s slot; unlimited on CPU); fewer runs are "
        "recorded in the JSON",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size-mb", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(args.methods) - set(METHODS))
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS[1:])}")
    if args.worker:
        worker(args)
        return
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    args.sizes_mb = args.sizes_mb or ("8192" if args.device == "cuda" else "256,2048")
    if args.max_seconds is None:
        args.max_seconds = 230.0 if args.device == "cuda" else 1e9
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    biggest = max(sizes) * 2**20
    tmp = tempfile.mkdtemp(prefix="elastic_emb_bench_", dir=os.environ.get("TMPDIR", "/var/tmp"))
    if args.state_dir is None:
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        args.state_dir = "/dev/shm" if shm_free > 2.5 * biggest else os.path.join(tmp, "state")
    args.dcp_dir = args.dcp_dir or os.path.join(tmp, "dcp")
    rows = []
    try:
        for size in sizes:
            per_rank = launch(args, size)
            rows.append(summarize(size, per_rank, args.world))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    hdr = [
        "size MB",
        "rebuild s",
        "live s",
        "live GB/s/rank",
        "transfer GB/s/rank",
        "warm live GB/s/rank",
        "warm transfer GB/s/rank",
        "snap commit s",
        "snap restore s",
        "durable c+r s",
        "DCP save+load s",
        "live x",
        "snap restore x",
        "snap c+r x",
        "crc32 GB/s",
    ]
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        m, sp = r["median_s"], r.get("speedup", {})

        def f(v, p=3):
            return "-" if v is None else f"{v:.{p}f}"

        print(
            " | ".join(
                [
                    str(r["size_mb"]),
                    f(m.get("rebuild_s")),
                    f(m.get("live_s")),
                    f(r.get("live_gbps_per_rank"), 2),
                    f(r.get("live_transfer_gbps_per_rank"), 2),
                    f(r.get("live_warm_gbps_per_rank"), 2),
                    f(r.get("live_warm_transfer_gbps_per_rank"), 2),
                    f(m.get("snap_commit_s")),
                    f(m.get("snap_restore_s")),
                    f(m["durable_commit_s"] + m["durable_restore_s"]) if "durable_commit_s" in m else "-",
                    f(m.get("dcp_s")),
                    f(sp.get("live_vs_dcp_save_load"), 1),
                    f(sp.get("snap_restore_vs_dcp_save_load"), 1),
                    f(sp.get("snap_commit+restore_vs_dcp_save_load"), 1),
                    f(r.get("crc32_gbps"), 2),
                ]
            )
        )
    for r in rows:
        if "live_transports" in r:
            print(f"size {r['size_mb']} MB: live rows moved by {', '.join(r['live_transports'])}")
    doc = {
        "device": args.device,
        "world": args.world,
        "runs": args.runs,
        "transport": args.transport or ("alltoall" if args.device == "cuda" else "cma"),
        "state_dir": args.state_dir,
        "argv": sys.argv[1:],
        "results": rows,
        "note": "times are the slowest rank per run, medians over runs; x = DCP save+load time / method time",
    }
    path = Path(args.json or REPO / "out" / f"reshard-{args.device}.json")
    write_json(path, "reshard", doc)


if __name__ == "__main__":
    main()
