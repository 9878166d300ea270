"""Why a commit's device-to-host copy slows a training step, and how fast the host checksums it.

One process, one GPU. A "step" is a chain of bf16 matmuls (about ``--step-ms``) plus small reads
back to the host (``.item()``: torch.unique and a loss read do such reads), and a commit-sized
copy (``--copy-mb`` from device memory into pinned host memory) runs on a side stream from the
step's start, issued in one of several ways:

* ``none``: no copy (the baseline);
* ``whole``: one ``copy_`` (what the capture does today);
* ``pieces``: the same bytes in ``--piece-mb`` pieces, all enqueued at once;
* ``paced``: the pieces issued by a host thread, at most ``--in-flight`` enqueued at a time;
* ``pingpong``: the pieces enqueued at once, alternately on two streams, each piece waiting for
  the one before (so each stream's queue blocks between its pieces).

Printed, medians: the latency of one small read while such a copy is in flight, and the step
time in each mode. Then the host checksums of the landed bytes on the writer's threads: zlib's
CRC32 and XXH3-64 (``xxhash``), per 16 MiB chunk, alone and while the next copy lands.

  python bench/d2h_overlap.py --json d2h_overlap.json
  python bench/d2h_overlap.py --device cpu --copy-mb 16 --reps 1 --json out/d2h_overlap_cpu.json

``--device cpu`` (a smoke run of the script): the host checksums alone (the copies need CUDA streams;
their figures are ``null``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copy-mb", type=int, default=516)
    ap.add_argument("--piece-mb", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["pieces", "paced", "paced1", "pingpong"])
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default="d2h_overlap.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the host checksums alone")
    args = ap.parse_args()
    known = ("pieces", "paced", "paced1", "pingpong")
    if any(m not in known for m in args.modes) or args.copy_mb < 1 or args.reps < 1:
        ap.error(f"--modes of {', '.join(known)}; --copy-mb and --reps at least 1")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (run on the GPU machine, or --device cpu)")
    dev = torch.device(args.device)
    nbytes = args.copy_mb << 20
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    out: dict = {"copy_bytes": nbytes, "device": args.device}
    if cuda:
        copies(args, out, src, dst)
    else:
        dst.copy_(src)
        out.update(small_read_ms=None, copy_gbs=None, step_ms=None, dense_matmuls=None)
    checksums(args, out, src, dst, cuda)
    print(json.dumps(out, indent=1))
    write_json(args.json, "d2h_overlap", out, indent=1)


def copies(args, out: dict, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Parts 1 and 2: a small read's latency and a dense step's time with the copy in flight."""
    dev = src.device
    side = torch.cuda.Stream(dev)
    side2 = torch.cuda.Stream(dev)
    nbytes = src.numel()
    one = torch.ones(1, device=dev)

    def issue(mode: str, piece: int):
        """Start the copy on the side stream; returns a thread (paced) or None."""
        side.wait_stream(torch.cuda.current_stream())
        if mode == "none":
            return None
        if mode == "whole":
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            return None
        starts = list(range(0, nbytes, piece))
        if mode == "pieces":
            with torch.cuda.stream(side):
                for s in starts:
                    dst[s : s + piece].copy_(src[s : s + piece], non_blocking=True)
            return None
        if mode == "pingpong":
            prev = None
            for i, s in enumerate(starts):
                st = (side, side2)[i % 2]
                if prev is not None:
                    st.wait_event(prev)
                elif st is side2:
                    st.wait_stream(side)
                with torch.cuda.stream(st):
                    dst[s : s + piece].copy_(src[s : s + piece], non_blocking=True)
                prev = torch.cuda.Event()
                prev.record(st)
            side.wait_event(prev)
            return None
        in_flight = args.in_flight if mode == "paced" else 1

        def paced():
            events = []
            with torch.cuda.stream(side):
                for s in starts:
                    if len(events) >= in_flight:
                        events.pop(0).synchronize()
                    dst[s : s + piece].copy_(src[s : s + piece], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    events.append(ev)
            for ev in events:
                ev.synchronize()

        th = threading.Thread(target=paced)
        th.start()
        return th

    def finish(th) -> None:
        if th is not None:
            th.join()
        side.synchronize()
        side2.synchronize()

    modes = [("none", 0), ("whole", 0)] + [(m, p << 20) for p in args.piece_mb for m in args.modes]
    # 1. one small read's latency with the copy just started
    lat = {}
    for mode, piece in modes:
        xs = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            th = issue(mode, piece)
            time.sleep(0.001)  # the copy is running
            t0 = time.perf_counter()
            one.add_(0).item()
            xs.append(time.perf_counter() - t0)
            finish(th)
        lat[f"{mode}{piece >> 20 or ''}"] = statistics.median(xs) * 1e3
    out["small_read_ms"] = lat
    gbs = {}
    for mode, piece in modes[1:]:
        xs = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            finish(issue(mode, piece))
            xs.append(time.perf_counter() - t0)
        gbs[f"{mode}{piece >> 20 or ''}"] = nbytes / statistics.median(xs) / 1e9
    out["copy_gbs"] = gbs

    # 2. a dense step (matmuls + a small read at its start and its end) with the copy from its start
    mm = 8192
    x = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    w = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16) / mm**0.5

    def dense(reps):
        y = x
        for _ in range(reps):
            y = torch.tanh(y @ w)
        return y

    dense(3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dense(10)
    torch.cuda.synchronize()
    reps = max(1, round(args.step_ms / ((time.perf_counter() - t0) * 100)))
    steps = {}
    for reads in (False, True):
        for mode, piece in modes:
            xs = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                th = issue(mode, piece)
                if reads:
                    one.add_(0).item()  # as torch.unique's count read at a step's start
                y = dense(reps)
                y[0, 0].float().item()  # the loss read
                xs.append(time.perf_counter() - t0)
                finish(th)
            steps[f"{'reads' if reads else 'noreads'}_{mode}{piece >> 20 or ''}"] = statistics.median(xs) * 1e3
    out["step_ms"] = steps
    out["dense_matmuls"] = reps


def checksums(args, out: dict, src: torch.Tensor, dst: torch.Tensor, cuda: bool) -> None:
    """Part 3: host checksums of the landed bytes on the writer's threads (16 MiB chunks), alone
    and (CUDA) while the next copy lands; then the pinned device-to-host bandwidth (CUDA)."""
    nbytes = src.numel()
    side = torch.cuda.Stream(src.device) if cuda else None
    host = dst.numpy()
    nthreads = max(1, len(os.sched_getaffinity(0)) - 2)
    pool = ThreadPoolExecutor(nthreads)
    chunk = 16 << 20
    fns = {"zlib_crc32": lambda b: zlib.crc32(b)}
    try:
        import xxhash

        fns["xxh3_64"] = lambda b: xxhash.xxh3_64_intdigest(b)
        out["xxhash"] = xxhash.VERSION
    except ImportError:
        out["xxhash"] = None
    sums = {}
    for name, fn in fns.items():
        for busy in (False, True) if cuda else (False,):
            xs = []
            for _ in range(5):
                if cuda:
                    torch.cuda.synchronize()
                if busy:
                    src2 = src[: nbytes // 2]
                    with torch.cuda.stream(side):
                        dst[nbytes // 2 :].copy_(src2, non_blocking=True)
                t0 = time.perf_counter()
                list(
                    pool.map(
                        lambda s, fn=fn: fn(memoryview(host[s : s + chunk])),
                        range(0, nbytes // (2 if busy else 1), chunk),
                    )
                )
                xs.append((nbytes // (2 if busy else 1)) / (time.perf_counter() - t0) / 1e9)
                if cuda:
                    side.synchronize()
            sums[f"{name}{'_during_copy' if busy else ''}_gbs"] = statistics.median(xs)
    out["host_checksum"] = sums
    out["threads"] = nthreads
    pool.shutdown()
    out["pinned_d2h_gbs"] = None
    if cuda:
        t = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        out["pinned_d2h_gbs"] = nbytes / statistics.median(t) / 1e9


if __name__ == "__main__":
    main()
