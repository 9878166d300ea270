"""Sharded lookup throughput of EmbContext against what one process (or the hardware) can do.

CPU (default): for each world size in ``--ranks`` (1, 2, 4), real gloo ranks (one process each,
OMP_NUM_THREADS=1) look up ``--batch`` uniformly random ids each from a table of ``--rows`` x
``--dim`` fp32 sharded over them; the baseline is ``torch.nn.functional.embedding`` in this
process (one thread) on the same total table with the same total number of ids, measured in the
same invocation. Reported: rows/s (ids served per second, all ranks together) as the median of
``--runs`` runs of ``--iters`` lookups, and the ratio to the baseline.

One GPU (``--device cuda --ranks 1``, the default on a one-GPU machine): world size 1 in this
process, measured against the physical copy bound in the same run, with host time per call and a
prefetching loop's overlap; see bench/lookup_one_gpu.py.

GPU (``--device cuda``, two or more ranks): NCCL ranks, one per GPU. Each rank also measures, on its own GPU and
communicator, the two ceilings a sharded lookup cannot beat: the *gather*
ceiling (``F.embedding`` of ``--batch`` random ids from its local shard) and the *all-to-all*
ceiling (``all_to_all_single`` of ``--batch`` rows of ``--dim`` fp32, evenly split), both as rows/s
summed over ranks; the lookup's fraction of ``min(gather, all-to-all)`` is the figure of merit
(target >= 0.5 for ``--batch`` >= 1M, ``--dim`` 128). The single-GPU ``F.embedding`` on the whole
table is reported as well. ``--chunks`` measures several ``pipeline_chunks`` settings of one
context in the same run (default 3 2 4 on cuda). Also reported per setting: where one lookup's
time goes on the host (``phases``); ``--profile DIR`` writes a torch.profiler trace.

    python bench/lookup.py --runs 5 --out out/lookup_cpu.json
    python bench/lookup.py --device cuda --runs 5 --out out/gpu/lookup.json
        (defaults on cuda: --ranks <GPU count> --rows 20000000 --dim 128 --batch 1048576)

Prints a table and writes JSON (configuration, per-run samples, medians, ratios) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import collect, start, torchrun_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


def draw_ids(n: int, rows: int, skew: float, device, gen):
    """``n`` ids in ``[0, rows)``: uniform for skew 0; for skew > 1 a power law (``rows * u**skew``,
    hot ids many times over, as in recommendation traffic), scattered over the table by a
    multiplicative hash so that the hot rows do not all live on one owner."""
    import torch

    if skew <= 0:
        return torch.randint(0, rows, (n,), device=device, generator=gen)
    u = torch.rand(n, device=device, generator=gen, dtype=torch.float64)
    base = (u.pow(skew) * rows).long().clamp_(max=rows - 1)
    return (base * 2654435761) % rows


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    from elastic_emb.context import EmbContext
    from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology

    t = Topology.from_env()
    if t.backend == "nccl":
        torch.cuda.set_device(t.local_rank)
    store = worker_store(t, timeout=120)
    spec = TableSpec(name="t", num_rows=args.rows, dim=args.dim)
    ctx = EmbContext(
        t,
        store,
        tables=[spec],
        optimizer=OptimizerSpec(),
        timeout=120.0,
        seed=None,
        staging_rows_per_rank=max(1, args.batch // t.world_size + 1),
        high_priority_stream=not args.normal_priority,
    )
    dev = ctx.device
    mine = ctx.owned("t")
    w = torch.empty(len(mine), args.dim, device=dev).uniform_(-1, 1)
    # Columns 0 and 1 spell each row's global index (exact in fp32), so every timed path is
    # checked against the ids it was asked for (see verify below).
    g = torch.arange(mine.start, mine.stop, device=dev)
    w[:, 0], w[:, 1] = (g % 4096).float(), (g // 4096).float()
    del g
    ctx.import_shard({"t": ShardData("t", mine, w)})
    del w
    gen = torch.Generator(device=dev).manual_seed(1234 + t.rank)
    batches = [draw_ids(args.batch, args.rows, args.skew, dev, gen) for _ in range(2)]

    def timed_runs(run_once, warm) -> list[float]:
        """Per-run seconds per iteration (``run_once`` does ``--iters`` of them), bracketed by
        barriers so the slowest rank counts; ``warm()`` first."""
        warm()
        _sync(dev)
        out = []
        for _ in range(args.runs):
            ctx.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            run_once()
            _sync(dev)
            ctx.barrier()
            _sync(dev)
            out.append((time.perf_counter() - t0) / args.iters)
        return out

    def timed(fn) -> list[float]:
        def calls(count: int) -> None:
            for i in range(count):
                fn(i)  # the result is dropped at once: its memory serves the next call, as in a loop

        return timed_runs(lambda: calls(args.iters), lambda: calls(args.warmup))

    def timed_in_flight() -> list[float]:
        """``--in-flight``: per-run seconds per lookup when the next lookup is started before the
        current one is waited on (a training loop that prefetches the next batch's rows); the
        results are checked against the ids."""

        def run_once(check: bool) -> None:
            h, prev = ctx.lookup("t", batches[0]), batches[0]
            for i in range(1, args.iters):
                nxt = ctx.lookup("t", batches[i % 2])
                got = h.wait()
                if check:
                    back = got[:, 0].long() + 4096 * got[:, 1].long()
                    if not torch.equal(back, prev):
                        raise SystemExit(f"rank {t.rank}: a lookup with another in flight returned other rows")
                h, prev = nxt, batches[i % 2]
            h.wait()

        return timed_runs(lambda: run_once(False), lambda: [run_once(True) for _ in range(args.warmup)])

    def phases(n: int = 10) -> dict:
        """Host-side split of single lookups (medians, ms): until lookup() returns (validation,
        dedup, the count exchange's sync, launching the exchanges), until wait() returns
        (launching the reorders), until the device is done."""
        marks = []
        for i in range(n):
            ctx.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            h = ctx.lookup("t", batches[i % 2])
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            _sync(dev)
            marks.append((t1 - t0, t2 - t0, time.perf_counter() - t0))
        med = lambda j: round(1e3 * statistics.median(m[j] for m in marks), 3)  # noqa: E731
        return {"lookup_returned_ms": med(0), "wait_returned_ms": med(1), "done_ms": med(2)}

    def verify(key: str) -> None:
        for ids in batches:
            got = ctx.lookup("t", ids).wait()
            back = got[:, 0].long() + 4096 * got[:, 1].long()
            if not torch.equal(back, ids):
                raise SystemExit(
                    f"rank {t.rank}: lookup ({key}) returned rows of other ids at "
                    f"{int((back != ids).sum())} of {ids.numel()} positions"
                )

    variants = [("", True)]
    if args.compare_capture:
        variants.append(("-eager", False))
    result = {"rank": t.rank, "world_size": t.world_size, "arena": ctx.arena_report(), "lookup_s": {}, "phases": {}}
    for chunks in args.chunks:
        for suffix, capture in variants:
            # Every rank changes them between the same two calls, as the contract requires.
            ctx.pipeline_chunks = chunks
            ctx.capture_dedup = capture
            key = f"{chunks}{suffix}"
            result["lookup_s"][key] = timed(lambda i: ctx.lookup("t", batches[i % 2]).wait())
            if args.in_flight:
                result.setdefault("lookup_in_flight_s", {})[key] = timed_in_flight()
            result["phases"][key] = phases()
            verify(key)
    ctx.capture_dedup = True
    from elastic_emb.context.gather import kernel_status

    result["assembly"] = kernel_status()  # how the result rows were gathered (Triton kernel or torch ops)
    uniq = torch.unique(batches[0]).numel()
    result["unique_fraction"] = uniq / args.batch
    if args.profile:
        # Where a lookup's time goes: a torch.profiler trace of a few lookups (Chrome trace JSON
        # for chrome://tracing or Perfetto) and the per-op table, written by rank 0.
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        ctx.pipeline_chunks = args.chunks[0]
        ctx.barrier()
        with profile(activities=acts) as prof:
            for i in range(4):
                ctx.lookup("t", batches[i % 2]).wait()
            _sync(dev)
        if t.rank == 0:
            os.makedirs(args.profile, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.profile, "lookup_trace.json"))
            key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
            with open(os.path.join(args.profile, "lookup_ops.txt"), "w") as fh:
                fh.write(prof.key_averages().table(sort_by=key, row_limit=60))
    if args.device == "cuda":
        import torch.distributed as dist

        local = torch.empty(max(1, len(mine)), args.dim, device=dev).uniform_(-1, 1)
        local_ids = [torch.randint(0, local.shape[0], (args.batch,), device=dev, generator=gen) for _ in range(2)]
        result["gather_s"] = timed(lambda i: F.embedding(local_ids[i % 2], local))
        del local
        send = torch.empty(args.batch, args.dim, device=dev).uniform_(-1, 1)
        recv = torch.empty_like(send)
        per = args.batch // t.world_size
        splits = [per] * (t.world_size - 1) + [args.batch - per * (t.world_size - 1)]
        # Every rank sends the same split sizes, so what it receives equals what it sends.
        result["alltoall_s"] = timed(
            lambda i: ctx.process_group.alltoall_base(recv, send, splits, splits, dist.AllToAllOptions()).wait()
        )
    ctx.close()
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def baseline(args, total_ids: int) -> list[float]:
    """Single-process F.embedding on the whole table: seconds per lookup of total_ids ids."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    table = torch.empty(args.rows, args.dim, device=dev).uniform_(-1, 1)
    gen = torch.Generator(device=dev).manual_seed(99)
    ids = [draw_ids(total_ids, args.rows, args.skew, dev, gen) for _ in range(2)]
    for i in range(args.warmup):
        F.embedding(ids[i % 2], table)
    out = []
    for _ in range(args.runs):
        _sync(dev)
        t0 = time.perf_counter()
        for i in range(args.iters):
            F.embedding(ids[i % 2], table)
        _sync(dev)
        out.append((time.perf_counter() - t0) / args.iters)
    del table, ids
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def launch(args, world: int) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        # one node, every rank a local rank of it, as torchrun would start them
        extra = {
            "ELASTIC_EMB_BACKEND": "nccl" if args.device == "cuda" else "gloo",
            "ELASTIC_EMB_EP_SIZE": str(world),
            "ELASTIC_EMB_LOG_LEVEL": "warning",
        }
        env = torchrun_env(rank, world, port, run_id=f"bench-lookup-{world}", extra=extra)
        if args.device == "cuda":
            env.setdefault("NCCL_NVLS_ENABLE", "0")
        flags = {
            "--normal-priority": args.normal_priority,
            "--compare-capture": args.compare_capture,
            "--in-flight": args.in_flight,
        }
        cmd = [
            "python",
            os.path.abspath(__file__),
            "--worker",
            "--device",
            args.device,
            "--rows",
            str(args.rows),
            "--dim",
            str(args.dim),
            "--batch",
            str(args.batch),
            "--runs",
            str(args.runs),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            "--skew",
            str(args.skew),
            "--chunks",
            *map(str, args.chunks),
            *(f for f, on in flags.items() if on),
            *(["--profile", args.profile] if args.profile else []),
        ]
        procs.append(start(cmd, env))
    return collect(procs, args.timeout, f"world {world}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="world sizes (default: 1 2 4 on cpu, GPU count on cuda)"
    )
    ap.add_argument("--rows", type=int, default=None, help="total table rows (default 1M on cpu, 20M on cuda)")
    ap.add_argument("--dim", type=int, default=None, help="row width (default 64 on cpu, 128 on cuda)")
    ap.add_argument(
        "--batch", type=int, default=None, help="ids per rank per lookup (default 65536 on cpu, 1M on cuda)"
    )
    ap.add_argument("--runs", type=int, default=5, help="timed runs; medians are reported")
    ap.add_argument("--skew", type=float, default=0.0, help="0: uniform ids; > 1: power-law ids (duplicates)")
    ap.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=None,
        help="EmbContext pipeline_chunks values to measure (default: 1 on cpu; 3 2 4 on cuda)",
    )
    ap.add_argument("--iters", type=int, default=5, help="lookups per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for one world size's ranks")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument(
        "--compare-capture",
        action="store_true",
        help="also measure each --chunks with the dedup kernels launched eagerly (capture_dedup=False)",
    )
    ap.add_argument(
        "--in-flight",
        action="store_true",
        help="also measure with the next lookup started before each wait (one lookup in flight)",
    )
    ap.add_argument(
        "--normal-priority",
        action="store_true",
        help="EmbContext(high_priority_stream=False): NCCL kernels on a normal-priority stream",
    )
    ap.add_argument(
        "--profile", default=None, metavar="DIR", help="also write a torch.profiler trace of 4 lookups (rank 0) to DIR"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"cpu": (1_000_000, 64, 65536), "cuda": (20_000_000, 128, 1 << 20)}[args.device]
    for name, value in zip(("rows", "dim", "batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.chunks is None:
        args.chunks = [3, 2, 4] if args.device == "cuda" else [1]
    if any(not 1 <= c <= 16 for c in args.chunks):
        ap.error(f"--chunks {args.chunks}: each must be in [1, 16] (EmbContext's limit)")
    for name in ("rows", "dim", "batch", "runs", "iters"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.worker:
        worker(args)
        return

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (run on the GPU machine)")
    if args.ranks is None:
        args.ranks = [torch.cuda.device_count()] if args.device == "cuda" else [1, 2, 4]
    if args.device == "cuda" and max(args.ranks) > torch.cuda.device_count():
        ap.error(f"--ranks {args.ranks} needs more than the {torch.cuda.device_count()} GPUs here")
    torch.set_num_threads(1)
    if args.device == "cuda" and args.ranks == [1]:
        import lookup_one_gpu

        report = lookup_one_gpu.run(args)
        lookup_one_gpu.print_report(report)
        if args.out:
            write_json(args.out, "lookup_one_gpu", report)
        return

    rows = []
    for world in args.ranks:
        total_ids = args.batch * world
        base = baseline(args, total_ids)
        per_rank = launch(args, world)
        # barriers bracket each run, so every rank measured the same span: take rank 0's.
        for key in per_rank[0]["lookup_s"]:
            chunks = int(key.split("-")[0])
            lookup = per_rank[0]["lookup_s"][key]
            entry = {
                "world_size": world,
                "pipeline_chunks": chunks,
                "dedup": ("eager" if key.endswith("-eager") or args.device != "cuda" else "graph"),
                "assembly": per_rank[0].get("assembly"),
                "total_ids": total_ids,
                "baseline_s": base,
                "lookup_s": lookup,
                "baseline_rows_per_s": total_ids / statistics.median(base),
                "lookup_rows_per_s": total_ids / statistics.median(lookup),
                "unique_fraction": per_rank[0]["unique_fraction"],
                "arena_bytes_rank0": per_rank[0]["arena"]["total_bytes"],
                "phases_rank0": per_rank[0]["phases"][key],
                "lookup_in_flight_s": per_rank[0].get("lookup_in_flight_s", {}).get(key),
            }
            entry["ratio_to_baseline"] = entry["lookup_rows_per_s"] / entry["baseline_rows_per_s"]
            if entry["lookup_in_flight_s"]:
                entry["lookup_in_flight_rows_per_s"] = total_ids / statistics.median(entry["lookup_in_flight_s"])
            if args.device == "cuda":
                gather = total_ids / statistics.median(per_rank[0]["gather_s"])
                a2a = total_ids / statistics.median(per_rank[0]["alltoall_s"])
                entry.update(
                    gather_s=per_rank[0]["gather_s"],
                    alltoall_s=per_rank[0]["alltoall_s"],
                    gather_ceiling_rows_per_s=gather,
                    alltoall_ceiling_rows_per_s=a2a,
                    fraction_of_ceiling=entry["lookup_rows_per_s"] / min(gather, a2a),
                )
                if entry["lookup_in_flight_s"]:
                    entry["in_flight_fraction_of_ceiling"] = entry["lookup_in_flight_rows_per_s"] / min(gather, a2a)
            rows.append(entry)

    report = {
        "device": args.device,
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "results": rows,
    }
    head = f"{'ranks':>5} {'chunks':>6} {'ids/step':>10} {'F.embedding rows/s':>19} {'sharded rows/s':>15} {'ratio':>6}"
    if args.device == "cuda":
        head += f" {'gather ceil':>12} {'a2a ceil':>12} {'of min ceil':>11}"
    print(head)
    for e in rows:
        line = (
            f"{e['world_size']:>5} {e['pipeline_chunks']:>6}{'e' if e['dedup'] == 'eager' else ' '} {e['total_ids']:>9} {e['baseline_rows_per_s']:>19.3e} "
            f"{e['lookup_rows_per_s']:>15.3e} {e['ratio_to_baseline']:>6.2f}"
        )
        if args.device == "cuda":
            line += (
                f" {e['gather_ceiling_rows_per_s']:>12.3e} {e['alltoall_ceiling_rows_per_s']:>12.3e}"
                f" {e['fraction_of_ceiling']:>11.2f}"
            )
        print(line)
    for e in rows:
        if e.get("lookup_in_flight_s"):
            frac = e.get("in_flight_fraction_of_ceiling")
            print(
                f"  ranks {e['world_size']} chunks {e['pipeline_chunks']} with the next lookup started before each wait: "
                f"{e['lookup_in_flight_rows_per_s']:.3e} rows/s, ratio {e['lookup_in_flight_rows_per_s'] / e['baseline_rows_per_s']:.2f}"
                + (f", {frac:.2f} of min ceiling" if frac else "")
            )
    for e in rows:
        ph = e["phases_rank0"]
        print(
            f"  ranks {e['world_size']} chunks {e['pipeline_chunks']} dedup {e['dedup']}: one lookup on rank 0: lookup() returned at "
            f"{ph['lookup_returned_ms']} ms, wait() at {ph['wait_returned_ms']} ms, device done at {ph['done_ms']} ms"
        )
    print(
        f"(medians of {args.runs} runs x {args.iters} lookups; table {args.rows} x {args.dim} fp32; "
        f"{args.batch} ids per rank, skew {args.skew}, unique fraction {rows[0]['unique_fraction']:.3f}; "
        f"chunks marked e: eager dedup; result assembled by {rows[0].get('assembly')})"
    )
    if args.out:
        write_json(args.out, "lookup", report)


if __name__ == "__main__":
    main()
