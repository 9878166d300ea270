"""Where a GPU-captured delta can land on the host, and how fast: the bound of the commit path.

A delta of ``--mib`` MiB (default 512, about one 1M-id step of bench/commit_gpu.py) leaves the
GPU at the pinned D2H bandwidth; then it must be in a /dev/shm file. Measured, medians of
``--runs``:

* ``d2h_pinned``: device -> a pinned buffer (cudaHostAlloc), the copy engine's bound;
* ``copy_fresh``: a pinned buffer -> a fresh shm file through a shared mapping, ``--threads``
  threads (what the writer does today): page allocation + zeroing + copy;
* ``fallocate``: allocating a fresh shm file's pages (one call), and ``fallocate_parallel``: one
  file per thread at once (aggregate), i.e. preparing files ahead of time;
* ``copy_populated``: the copy into an already allocated file's mapping (threads);
* ``register`` / ``d2h_registered`` / ``unregister``: ``cudaHostRegister`` of an allocated
  file's mapping, the D2H copy straight into it, and the unregister: the zero-CPU-copy design.

  python3 bench/shm_landing.py --mib 512 --threads 14 --json shm_landing.json
  python3 bench/shm_landing.py --device cpu --mib 8 --threads 2 --runs 1 --json out/shm_landing_cpu.json

``--device cpu`` (a smoke run of the script): the host parts alone (the copies into and out of
the files, ``fallocate``); the CUDA parts are left out of the JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 2))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--json", default="shm_landing.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the host parts alone")
    args = ap.parse_args()
    if args.mib < 1 or args.threads < 1 or args.runs < 1:
        ap.error("--mib, --threads and --runs must be at least 1")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (run on the GPU machine, or --device cpu)")
    n = args.mib << 20
    d = Path(tempfile.mkdtemp(prefix="ee-landing-", dir=args.dir))
    pool = ThreadPoolExecutor(args.threads)
    chunk = -(-n // args.threads)
    res: dict[str, list[float]] = {}

    def rec(name: str, seconds: float) -> None:
        res.setdefault(name, []).append(seconds)

    def new_file(i: int, allocate: bool):
        p = d / f"f{i}"
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        (os.posix_fallocate if allocate else os.ftruncate)(fd, *((0, n) if allocate else (n,)))
        return p, fd

    def par_copy(dst: np.ndarray, src: np.ndarray) -> None:
        list(pool.map(lambda lo: np.copyto(dst[lo : lo + chunk], src[lo : lo + chunk]), range(0, n, chunk)))

    dev = torch.empty(n, dtype=torch.uint8, device=args.device).random_(0, 255)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    src = pinned.numpy()
    if not cuda:
        pinned.copy_(dev)
    cudart = torch.cuda.cudart() if cuda else None
    for _ in range(args.runs):
        if cuda:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinned.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            rec("d2h_pinned", time.perf_counter() - t0)

        p, fd = new_file(0, False)
        mm = mmap.mmap(fd, n)
        t0 = time.perf_counter()
        dst = np.frombuffer(mm, dtype=np.uint8)
        par_copy(dst, src)
        rec("copy_fresh", time.perf_counter() - t0)
        del dst
        mm.close()
        os.close(fd)
        p.unlink()

        t0 = time.perf_counter()
        p, fd = new_file(1, True)
        rec("fallocate", time.perf_counter() - t0)
        mm = mmap.mmap(fd, n)
        dst = np.frombuffer(mm, dtype=np.uint8)
        t0 = time.perf_counter()
        par_copy(dst, src)
        rec("copy_populated", time.perf_counter() - t0)
        del dst
        mm.close()
        os.close(fd)
        p.unlink()

        t0 = time.perf_counter()
        files = list(pool.map(lambda i: new_file(10 + i, True), range(args.threads)))
        rec("fallocate_parallel_each", (time.perf_counter() - t0))
        for p, fd in files:
            os.close(fd)
            p.unlink()
        if not cuda:
            continue

        p, fd = new_file(2, True)
        mm = mmap.mmap(fd, n)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        ptr = host.data_ptr()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, n, 0)
        rec("register", time.perf_counter() - t0)
        if int(err) != 0:
            raise SystemExit(f"cudaHostRegister failed: {err}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        rec("d2h_registered", time.perf_counter() - t0)
        ok = bool(torch.equal(host[: 1 << 20], dev[: 1 << 20].cpu()))
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(ptr)
        rec("unregister", time.perf_counter() - t0)
        del host
        mm.close()
        os.close(fd)
        p.unlink()
        if not ok:
            raise SystemExit("the registered mapping does not hold the copied bytes")
    os.rmdir(d)
    pool.shutdown()
    out = {"mib": args.mib, "threads": args.threads, "device": args.device}
    for k, v in res.items():
        s = statistics.median(v)
        out[f"{k}_ms"] = s * 1e3
        out[f"{k}_gbs"] = (n * (args.threads if k == "fallocate_parallel_each" else 1)) / s / 1e9
    print(json.dumps(out, indent=1))
    write_json(args.json, "shm_landing", out, indent=1)


if __name__ == "__main__":
    main()
