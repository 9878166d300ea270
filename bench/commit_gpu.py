"""Commit every step on one GPU through the public API: a whole run against the same run without commits.

One process, one rank, one GPU (an NCCL world of one): ``Lifecycle.start`` with the default
``LifecycleConfig`` over an ``EmbContext`` on the GPU holding one fp32 table of ``--table-gib``
GiB (``--dim`` columns) with row-wise Adagrad (bench/_run_loop.py: the loop bench/commit.py and
the other commit benches share). A step is the library's own loop: ``--ids`` random ids on the
device looked up (``lookup(...).wait()``), the dense part (bf16 matmuls, as many as take
``--dense-ms`` by themselves, measured before the runs; 0: none), a gradient per id applied
(``apply_gradients``), then the loss read (``.item()``: it waits for the training stream, not for
the whole device, as a training step does, so a commit's copy on its side stream may run on into
the next step). The lifecycle picks the GPU capture path by itself (the context is on CUDA):
deltas gathered on a side stream, copied to pinned memory and written by the background writer,
with whatever periodic work the commit path does (``docs/COMMIT.md``) inside the run's steps.

In this process, as bench/commit.py: ``baseline`` (``--steps`` steps, default 200, no commit),
``commit`` (the same steps, each ended by ``lc.commit(step)``), each with a fresh state directory
(default under /dev/shm, the node-local tier's home), every row looked up once and two steps run
without a commit before its clock starts; then the restore (``Lifecycle.start`` of fresh objects from the last commit,
checked against the committed rows) beside its floors (the restored chain and the node
directory, each read once). Reported: mean, median, p99, max and first step, max / median, the
commit loop's mean over the baseline's, the drain after the last step, the restore.

``--phases run,breakdown`` adds references that are not run figures: the pinned device-to-host
bandwidth (the bound of any commit that leaves the GPU), the writer's host checksum rates (CRC32,
XXH3-64) and torch's DCP ``async_save`` of a table of the same size (its blocking part and its
completion), once.

Earlier versions timed windows of 8 steps, rewinding the chain to its base between windows outside
the measured spans, in a dozen modes of the device path's settings; a run never rewinds, so
they are gone (git history keeps them, and their figures BENCHMARKS.md's history).

``--device cpu`` runs the same on the CPU (the host capture path, a gloo world of one): the smoke
run the test suite makes of this script.

  python bench/commit_gpu.py --table-gib 16 --ids 1000000 --dense-ms 20 --json commit_gpu.json
  python bench/commit_gpu.py --table-gib 16 --ids 1000000 --dense-ms 20 --phases run,breakdown
  python bench/commit_gpu.py --device cpu --table-gib 0.001 --dim 16 --ids 64 --steps 4 --dense-ms 0
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import table, write_json  # noqa: E402

WARM = (
    "every row looked up once, the step's id count at a time (the first lookup fills the lazily seeded rows), "
    "the device synchronized"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-gib", type=float, default=16.0, help="weight GiB (the Adagrad slot adds 1/dim)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=1_000_000, help="random ids per step")
    ap.add_argument("--steps", type=int, default=200, help="steps per loop (issue 34: at least 200)")
    ap.add_argument("--dense-ms", type=float, default=20.0, help="the dense part's length per step (0: none)")
    ap.add_argument("--state-dir", default=None, help="where each loop's state directory goes (default /dev/shm)")
    ap.add_argument("--phases", default="run", help="run, and optionally breakdown (references, not run figures)")
    ap.add_argument("--d2h-mib", type=int, default=512, help="breakdown: MiB of the D2H and checksum measures")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke run (docstring)")
    ap.add_argument("--json", default="bench/commit_gpu.json")
    args = ap.parse_args(argv)
    for name in ("steps", "ids", "dim", "d2h_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.dense_ms < 0 or args.table_gib <= 0:
        ap.error(f"--dense-ms={args.dense_ms} must be >= 0 and --table-gib={args.table_gib} > 0")
    phases = args.phases.split(",")
    if "run" not in phases or not set(phases) <= {"run", "breakdown"}:
        ap.error(f"--phases={args.phases!r}: run, or run,breakdown (the breakdown is never reported alone)")
    args.rows = int(args.table_gib * 2**30) // (args.dim * 4)
    if args.rows < 2:
        ap.error(f"--table-gib {args.table_gib} with --dim {args.dim} makes {args.rows} rows: at least 2")
    return args


def timed(fn, sync, n: int = 5) -> float:
    """The median seconds of ``n`` calls of ``fn``, each between two ``sync()``."""
    xs = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def state_root(explicit: str | None, need: int) -> Path:
    """A fresh directory for the loops' state: under ``explicit``, else /dev/shm; SystemExit when
    it lacks ``need`` bytes free (naming the flags that help)."""
    base = Path(explicit or "/dev/shm")
    if not base.is_dir():
        raise SystemExit(f"--state-dir={str(base)!r} is not a directory: make it, or pass another")
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(
            f"{base} has {free / 2**30:.1f} GiB free; the commits need about {need / 2**30:.1f} GiB there "
            f"(three bases of the table): pass --state-dir on a larger filesystem or a smaller --table-gib"
        )
    return Path(tempfile.mkdtemp(prefix="elastic_emb-bench-commit-gpu-", dir=base))


def main() -> None:
    args = parse_args()

    import torch
    from _run_loop import (
        EmbStep,
        OneRank,
        baseline_and_commit,
        emb_factory,
        env_summary,
        exit_on_sigterm,
        look_up_every_row,
        print_run,
        table_bytes,
        warm_note,
    )

    exit_on_sigterm()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench/commit_gpu.py: no CUDA device; --device cpu runs the smoke run on the CPU")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # The dense part: matmuls (bf16 on the GPU, fp32 on the CPU), as many as take --dense-ms
    # (measured here, before the runs: a first guess from one, then corrected once).
    mm, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    x = torch.randn(mm, mm, device=dev, dtype=dtype)
    wd = torch.randn(mm, mm, device=dev, dtype=dtype) / math.sqrt(mm)

    def dense(reps: int) -> torch.Tensor:
        y = x
        for _ in range(reps):
            y = torch.tanh(y @ wd)
        return y

    reps, dense_ms = 0, 0.0
    if args.dense_ms:
        reps = math.ceil(args.dense_ms / 1e3 / timed(lambda: dense(1), sync))
        reps = max(1, round(reps * args.dense_ms / 1e3 / timed(lambda: dense(reps), sync)))
        dense_ms = timed(lambda: dense(reps), sync) * 1e3

    def middle(looked: torch.Tensor) -> torch.Tensor:
        loss = looked.mean()
        return loss + dense(reps).float().mean() if reps else loss

    def make_step():
        emb = EmbStep(args.rows, args.ids, args.dim, device=dev, middle=middle)

        def step(lc, s: int) -> None:
            emb(lc, s).item()  # the loss read: waits for the training stream

        return step

    tb = table_bytes(args.rows, args.dim)
    root = state_root(args.state_dir, 3 * tb)
    world = OneRank("bench", backend="nccl" if cuda else "gloo")
    out: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capture_path": "device" if cuda else "host",
        "rows": args.rows,
        "dim": args.dim,
        "ids": args.ids,
        "table_bytes": tb,
        "dense_matmuls": reps,
        "dense_ms": dense_ms,
        "warm": warm_note(WARM),
        "process": env_summary(),
    }
    try:
        out.update(
            baseline_and_commit(
                world,
                root,
                f"{args.table_gib:g} GiB",
                emb_factory(args.rows, args.dim, device=dev),
                make_step,
                steps=args.steps,
                warm=look_up_every_row(args.ids),
                sync=sync,
            )
        )
        if "breakdown" in args.phases.split(","):
            out["breakdown"] = breakdown(args, dev, world, root, sync)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["table"] = f"{args.table_gib:g} GiB x {args.dim}"
    print_run([out], ("table", "table"))
    if "breakdown" in out:
        print("\nBreakdown: references beside the run (NOT run figures)")
        rows = [{"measure": k, "value": v} for k, v in out["breakdown"].items()]
        print(table(rows, [("measure", "measure"), ("value", "value")], digits=3))
    write_json(args.json, "commit_gpu", {"args": vars(args), **out})


def breakdown(args, dev, world, root: Path, sync) -> dict:
    """References that are not run figures: the pinned device-to-host copy's GB/s (on the CPU a
    host copy), the writer's checksums of the same bytes (CRC32, XXH3-64: GB/s, their threads),
    and torch's DCP ``async_save`` of a table as large as the run's (blocking part, completion)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastic_emb.state.crc import checksum_ranges, threads
    from elastic_emb.state.digest import digest_ranges

    cuda = dev.type == "cuda"
    nbytes = args.d2h_mib << 20

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    out: dict = {"d2h_gbs": nbytes / timed(lambda: pinned.copy_(src, non_blocking=True), sync) / 1e9}
    host = pinned.numpy()
    out["host_crc32_gbs"] = nbytes / timed(lambda: checksum_ranges(host, [(0, nbytes)]), sync) / 1e9
    out["host_xxh3_gbs"] = nbytes / timed(lambda: digest_ranges(host, [(0, nbytes)], "xxh3_64"), sync) / 1e9
    out["checksum_threads"] = threads()
    # DCP: a table as large as the run's (its rows and Adagrad slot), saved once, asynchronously.
    w = torch.empty(args.rows, args.dim, device=dev).uniform_(-0.01, 0.01)
    acc = torch.zeros(args.rows, device=dev)
    dist.init_process_group("gloo", store=dist.PrefixStore("dcp/", world.store), rank=0, world_size=1)
    try:
        sync()
        t0 = time.perf_counter()
        fut = dcp.async_save({"w": w, "acc": acc}, checkpoint_id=str(root / "dcp"))
        out["dcp_async_save_blocking_s"] = time.perf_counter() - t0
        getattr(fut, "upload_completion", fut).result(timeout=600)  # (a Future, or an AsyncSaveResponse)
        out["dcp_async_save_complete_s"] = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root / "dcp", ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
