"""One GPU, world size 1: the lookup against the physical ceiling, its host cost, and its overlap.

Run through ``bench/lookup.py --device cuda --ranks 1`` (or directly). In one process, on one
GPU, with an EmbContext of world size 1 (NCCL) holding a ``--rows`` x ``--dim`` fp32 table and
two batches of ``--batch`` uniformly random ids, it measures, all in the same run:

- the *copy bound*: a device-to-device copy of the result's bytes (what a gather must at least
  read and write), as GPU time (CUDA events);
- ``torch.index_select`` of the same ids (the gather the lookup used to be measured against);
- the lookup, issued back to back (``lookup()`` for every batch, then ``wait()``), GPU time per
  lookup, and its fraction of the copy bound (target >= 0.6);
- the lookup in a plain loop (``lookup(ids).wait()`` each time), wall time per lookup;
- host time per ``lookup()`` call while the GPU is busy (a spin kernel of ~20 ms queued first),
  median over calls (target <= 100 us), and per ``wait()`` call in the same state;
- a prefetching loop (lookup i+1 issued before the rows of i are used) around a dense step (a
  chain of fp32 or bf16 matmuls sized to the lookup's GPU time), against the dense step alone:
  the step time ratio (target <= 1.10; the better of the two is the headline);
- that every result equals ``index_select`` bit for bit.

Medians of ``--runs`` runs of ``--iters`` iterations. Prints a table; ``--out`` writes JSON.

``--device cpu`` (a smoke run of the script, gloo): the same measures with wall times for GPU
times, no busy-GPU host times (``null``), and dense steps of ``--matmul``-sized matmuls at least.
"""

from __future__ import annotations

import datetime
import statistics
import time


def _gpu_time(torch, fn, iters: int, runs: int) -> list[float]:
    """Seconds of GPU time per call of ``fn`` (``iters`` calls per run, bracketed by events)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / iters)
    return out


def _wall_time(torch, fn, iters: int, runs: int, cuda: bool = True) -> list[float]:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters)
    return out


def _busy(torch, dev, ms: float):
    """A function that queues about ``ms`` of GPU work (fp32 matmuls, one timed here first)."""
    a = torch.randn(2048, 2048, device=dev)
    one = min(_gpu_time(torch, lambda: a @ a, 5, 3))
    count = max(1, round(ms / 1e3 / one))

    def queue():
        for _ in range(count):
            torch.mm(a, a)

    return queue


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from elastic_emb.context import EmbContext
    from elastic_emb.context.gather import kernel_status
    from elastic_emb.protocol import OptimizerSpec, TableSpec
    from elastic_emb.testing.ports import free_port
    from elastic_emb.topology import Topology

    med = statistics.median
    cuda = getattr(args, "device", "cuda") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)

    def gpu_time(fn, iters: int, runs: int) -> list[float]:  # (on the CPU: wall time)
        return _gpu_time(torch, fn, iters, runs) if cuda else _wall_time(torch, fn, iters, runs, cuda=False)

    def wall_time(fn, iters: int, runs: int) -> list[float]:
        return _wall_time(torch, fn, iters, runs, cuda=cuda)

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=60))
    topo = Topology.build(
        run_id="bench-lookup-1gpu",
        generation=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="nccl" if cuda else "gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )
    ctx = EmbContext(
        topo,
        store,
        tables=[TableSpec(name="t", num_rows=args.rows, dim=args.dim)],
        optimizer=OptimizerSpec(),
        device=dev,
        seed=None,
        timeout=120.0,
    )
    w = ctx.shard_views()["t"].weight
    w.uniform_(-1, 1)
    g = torch.arange(args.rows, device=dev)
    w[:, 0], w[:, 1] = (g % 4096).float(), (g // 4096).float()  # each row spells its index
    del g
    ctx.mark_restored()
    gen = torch.Generator(device=dev).manual_seed(1234)
    batches = [torch.randint(0, args.rows, (args.batch,), device=dev, generator=gen) for _ in range(2)]
    unique_fraction = torch.unique(batches[0]).numel() / args.batch

    # -- exactness ----------------------------------------------------------------------------
    exact = all(torch.equal(ctx.lookup("t", b).wait(), torch.index_select(w, 0, b)) for b in batches)

    # -- GPU time: copy bound, index_select, lookup back to back -----------------------------
    def copy_bound() -> list[float]:
        src = torch.empty(args.batch, args.dim, device=dev).uniform_(-1, 1)
        dst = torch.empty_like(src)
        return gpu_time(lambda: dst.copy_(src), args.iters, args.runs)

    copy_s = copy_bound()
    state = {"i": 0}

    def index_select():
        state["i"] += 1
        return torch.index_select(w, 0, batches[state["i"] % 2])

    index_select_s = gpu_time(index_select, args.iters, args.runs)

    def back_to_back():
        hs = [ctx.lookup("t", batches[i % 2]) for i in range(args.iters)]
        for h in hs:
            h.wait()

    lookup_s = [t * 1 for t in gpu_time(back_to_back, 1, args.runs)]
    lookup_s = [t / args.iters for t in lookup_s]
    loop_s = wall_time(lambda: ctx.lookup("t", batches[0]).wait(), args.iters, args.runs)

    # -- host time with the GPU busy ------------------------------------------------------------
    host_lookup, host_wait, busy_ok = [], [], []
    busy = _busy(torch, dev, 20.0) if cuda else None
    for _ in range(args.runs if cuda else 0):  # (the CPU has no queue to keep busy)
        torch.cuda.synchronize()
        busy()  # ~20 ms of GPU work queued ahead
        hs = []
        for i in range(20):
            t0 = time.perf_counter()
            hs.append(ctx.lookup("t", batches[i % 2]))
            host_lookup.append(time.perf_counter() - t0)
        mark = torch.cuda.Event()
        mark.record()
        busy_ok.append(not mark.query())  # the GPU was still busy after the 20 calls
        torch.cuda.synchronize()
        for h in hs:
            t0 = time.perf_counter()
            h.wait()
            host_wait.append(time.perf_counter() - t0)

    # -- prefetching loop around a dense step of the lookup's GPU time -------------------------
    def prefetch(dtype) -> dict:
        """The step time of a prefetching loop over the dense step alone, for a dense step of
        ``dtype`` matmuls (fp32: CUDA cores; bf16: tensor cores) sized to the lookup's GPU time."""
        target, m = med(lookup_s), getattr(args, "matmul", 1024)
        while True:
            a = torch.randn(m, m, device=dev, dtype=dtype)
            t = med(gpu_time(lambda: a @ a, 5, 3))
            if t >= target / 4 or m >= 8192:
                break
            m *= 2
        scale = max(1, round(target / t))
        b = torch.randn(m, m, device=dev, dtype=dtype)

        def dense(rows=None):
            y = a
            for _ in range(scale):
                y = y @ b
            if rows is not None:
                y[0, :1] += rows[:1, :1].sum().to(dtype)  # the step uses the rows it looked up
            return y

        def loop():
            h = ctx.lookup("t", batches[0])
            for i in range(1, args.iters + 1):
                nxt = ctx.lookup("t", batches[i % 2])
                dense(h.wait())
                h = nxt
            h.wait()

        dense_wall = wall_time(dense, args.iters, args.runs)
        step = [t / args.iters for t in wall_time(loop, 1, args.runs)]
        return {
            "dtype": str(dtype),
            "matmul": m,
            "chain": scale,
            "dense_gpu_s": gpu_time(dense, args.iters, args.runs),
            "dense_wall_s": dense_wall,
            "prefetch_step_s": step,
            "step_over_dense": med(step) / med(dense_wall),
        }

    overlap = [prefetch(torch.float32), prefetch(torch.bfloat16)]
    ctx.check_errors()
    ctx.close()

    copy_bound = med(copy_s)
    report = {
        "assembly": kernel_status(),
        "config": {
            "rows": args.rows,
            "dim": args.dim,
            "batch": args.batch,
            "runs": args.runs,
            "iters": args.iters,
            "unique_fraction": unique_fraction,
        },
        "exact_vs_index_select": exact,
        "copy_bound_s": copy_s,
        "index_select_s": index_select_s,
        "lookup_back_to_back_s": lookup_s,
        "lookup_loop_wall_s": loop_s,
        "fraction_of_copy_bound": copy_bound / med(lookup_s),
        "index_select_fraction_of_copy_bound": copy_bound / med(index_select_s),
        "speedup_vs_index_select": med(index_select_s) / med(lookup_s),
        "copy_bound_bytes_per_s": 2 * args.batch * args.dim * 4 / copy_bound,
        "host_lookup_us_median": 1e6 * med(host_lookup) if cuda else None,
        "host_lookup_us_p90": 1e6 * sorted(host_lookup)[int(0.9 * len(host_lookup))] if cuda else None,
        "host_wait_us_median": 1e6 * med(host_wait) if cuda else None,
        "gpu_busy_during_calls": all(busy_ok) if cuda else None,
        "device": str(dev),
        "prefetch": overlap,
        "prefetch_step_over_dense": min(o["step_over_dense"] for o in overlap),
        "targets": {},
    }
    report["targets"] = {
        "host_lookup_le_100us": report["host_lookup_us_median"] <= 100 if cuda else None,
        "fraction_of_copy_bound_ge_0.6": report["fraction_of_copy_bound"] >= 0.6,
        "prefetch_within_10pct": report["prefetch_step_over_dense"] <= 1.10,
    }
    return report


def print_report(r: dict) -> None:
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    c = r["config"]
    import torch

    where = torch.cuda.get_device_name(0) if r.get("device", "cuda:0").startswith("cuda") else "cpu"
    print(
        f"one GPU ({where}, torch {torch.__version__}), table {c['rows']} x {c['dim']} fp32, "
        f"{c['batch']} ids (unique fraction {c['unique_fraction']:.3f}), assembly {r['assembly']}"
    )
    print(
        f"  copy bound            {ms(r['copy_bound_s']):8.3f} ms  ({r['copy_bound_bytes_per_s'] / 1e12:.2f} TB/s moved)"
    )
    print(
        f"  index_select          {ms(r['index_select_s']):8.3f} ms  {r['index_select_fraction_of_copy_bound']:.2f} of the bound"
    )
    print(
        f"  lookup (back to back) {ms(r['lookup_back_to_back_s']):8.3f} ms  {r['fraction_of_copy_bound']:.2f} of the bound, "
        f"{r['speedup_vs_index_select']:.2f}x index_select"
    )
    print(f"  lookup().wait() loop  {ms(r['lookup_loop_wall_s']):8.3f} ms wall per lookup")
    if r["host_lookup_us_median"] is not None:
        print(
            f"  host per lookup()     {r['host_lookup_us_median']:8.1f} us median "
            f"(p90 {r['host_lookup_us_p90']:.1f}), "
            f"GPU busy throughout: {r['gpu_busy_during_calls']}; per wait() {r['host_wait_us_median']:.1f} us"
        )
    for d in r["prefetch"]:
        print(
            f"  dense step alone      {ms(d['dense_wall_s']):8.3f} ms  ({d['chain']} x {d['dtype']} matmul {d['matmul']}); "
            f"prefetching loop {ms(d['prefetch_step_s']):.3f} ms per step = {d['step_over_dense']:.3f} of it"
        )
    print(f"  exact vs index_select: {r['exact_vs_index_select']}; targets: {r['targets']}")


if __name__ == "__main__":
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
    from _report import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1 << 20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (see the docstring)")
    ap.add_argument("--matmul", type=int, default=1024, help="the dense step's smallest matmul size")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False (run on the GPU machine, or --device cpu)")
    rep = run(a)
    print_report(rep)
    if a.out:
        write_json(a.out, "lookup_one_gpu", rep)
