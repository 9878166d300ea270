"""Commit every step on one GPU: the step alone, incremental commits (sync and async), a full
snapshot, and torch's DCP ``async_save`` as the anchor, from one process and the same table.

World size 1, no replica (the node-local log only), one fp32 table of ``--table-gib`` GiB on the
GPU (``--dim`` columns) with a row-wise Adagrad slot, in plain tensors that track the rows they
write (the ``take_changes`` contract: a bool mask on the device). A step: ``--ids`` random ids
(duplicates allowed), a gradient per id, the Adagrad update of the distinct rows; then a dense
part (bf16 matmuls, the count calibrated so the step takes at least ``--min-step-ms``; 0: none,
the embedding-only loop). Each step ends by reading its loss (``.item()``), as a training step does:
that waits for the training stream, not for the whole device, so a commit's copy on the side
stream may still run into the next step (a device-wide synchronize would charge it to the step).

Measured, medians over ``--steps`` steps:

* ``none``: the step alone (the baseline), with and without the dense part;
* ``full``: the first commit of the tier, a base (the whole shard: today's full snapshot);
* ``incremental``: the step, then ``SnapshotTier.commit`` of the rows it wrote (a delta);
* ``async``: the step, then ``SnapshotTier.capture`` + :class:`CommitWriter` (the background
  writer of ``async_commit``); its latency (call to complete) is measured on separate commits;
* the device path (``elastic_emb.state.capture``), dense loop: windows of ``--window`` steps in
  each of ``--modes``, interleaved in this process for ``--rounds`` rounds (a new random order each);
  per round each mode's median step against that round's baseline window, the figure the median
  over the rounds with their range; per step the training thread's spans (embedding part, dense
  launch, loss read, commit call) and the parts of the commit call (the views, taking the rows,
  ``SnapshotTier.capture``, the hand-over to the writer). Modes: none, commit, nowrite (the
  writer only waits for the copy), si (a short ``sys.setswitchinterval``), bigpiece (64 MiB
  pieces), piece4 / piece8 (4 / 8 MiB pieces);
  ``MODE@issue``: in the issue's step order (lookup, dense part, row update); ``MODE@lib``: the
  same order through the library itself, an ``EmbContext`` of world size 1 (its ``lookup(ids).wait()``,
  the dense part, ``apply_gradients`` of a random gradient per id: the context's own dedup, device
  checks, Adagrad and change tracking with its written values) instead of the bench's tensors,
  ``torch.unique`` and update (both on the same table: the bench's context works on the library
  context's arena); ``MODE@early`` (``MODE@issue+early``): the commit called before the loss
  read, while the GPU still runs the step, instead of after it. Then the embedding-only loop.
  Modes of earlier versions of this bench (nocopy, gather, deferred, sm4/8/16, fewthreads, crc8,
  plaincrc, ``+cecheck``, the writer woken per piece) measured approaches not kept, or needed the
  library's internals; their results stay in BENCHMARKS.md;
* ``dcp``: the step, then ``torch.distributed.checkpoint.async_save`` of the table (blocking part,
  and the time until its future completes);
* the pinned device-to-host bandwidth (``--d2h-mib``), the bound of any commit path that leaves the GPU.

``--device cpu`` is a smoke run of the script itself (the test suite runs it at a tiny size):
the same loops, the device path's windows committing through the host path instead
(``SnapshotTier.capture`` without a ``DeviceCapture``, each delta once its parent is written);
the modes that need CUDA (nowrite and the piece sizes) are left out, saying so.

  python bench/commit_gpu.py --table-gib 16 --ids 1000000 --min-step-ms 20 --json commit_gpu.json
  python bench/commit_gpu.py --table-gib 16 --ids 1000000 --min-step-ms 20 --device-only --dcp-steps 0 \
      --modes none,commit,none@issue,commit@issue,none@lib,commit@lib --rounds 30 --window 8
  python bench/commit_gpu.py --device cpu --table-gib 0.001 --dim 16 --ids 64 --steps 3 --rounds 1 \
      --window 2 --d2h-mib 1 --min-step-ms 0 --json out/commit_gpu_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

MODES = ("none", "commit", "nowrite", "si", "bigpiece", "piece4", "piece8")
CUDA_ONLY = ("nowrite", "bigpiece", "piece4", "piece8")  # the device path's own settings
ORDERS = ("issue", "lib", "early")  # the "@" suffixes, joined by "+"


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def pick_dir(need: int, explicit: str | None) -> Path:
    """A directory on a filesystem with ``need`` bytes free: /dev/shm first (the node-local tier's
    home), else the temporary directory."""
    if explicit:
        return Path(explicit)
    for base in ("/dev/shm", tempfile.gettempdir()):
        if shutil.disk_usage(base).free > need:
            return Path(tempfile.mkdtemp(prefix="ee-commit-", dir=base))
    raise SystemExit(f"no filesystem with {need / 2**30:.1f} GiB free for the commits; pass --state-dir")


def parse_modes(text: str, cuda: bool) -> tuple[list[str], list[str]]:
    """The dense windows' modes (every order with its baseline, ``commit`` always) and the ones
    left out on the CPU; SystemExit naming an unknown mode."""
    modes, left_out = [], []
    for m in (x for x in text.split(",") if x):
        mode, _, suffix = m.partition("@")
        if mode not in MODES or any(s not in ORDERS for s in suffix.split("+") if suffix):
            raise SystemExit(
                f"--modes: unknown mode {m!r}; modes are {', '.join(MODES)}, each optionally "
                f"@ORDER[+ORDER] of {', '.join(ORDERS)} (the modes of earlier versions of this "
                f"bench are gone: see its docstring)"
            )
        (left_out if mode in CUDA_ONLY and not cuda else modes).append(m)
    if "commit" not in modes:
        modes.append("commit")
    for m in list(modes):  # every order measured has its baseline
        base = "none" + m[len(m.split("@")[0]) :]
        if base not in modes:
            modes.insert(0, base)
    return modes, left_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table-gib", type=float, default=16.0, help="weight GiB (the Adagrad slot adds 1/dim)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--min-step-ms", type=float, default=20.0)
    ap.add_argument("--latency-commits", type=int, default=3)
    ap.add_argument("--dcp-steps", type=int, default=1, help="0: skip the DCP anchor")
    ap.add_argument("--state-dir", default=None)
    ap.add_argument(
        "--device-only",
        action="store_true",
        help="after the base, measure only the device path (skip host-path commits and DCP)",
    )
    ap.add_argument(
        "--ring",
        type=int,
        default=24,
        help="log segments the device path copies deltas into (0: pinned buffers + file copies)",
    )
    ap.add_argument("--json", default="bench/commit_gpu.json")
    ap.add_argument(
        "--copy-piece-mb",
        type=float,
        default=None,
        help="the capture's device-to-host copy in pieces of this many MiB (0: one copy; default: the library's)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="dense loop: rounds of interleaved windows")
    ap.add_argument("--window", type=int, default=8, help="dense loop: measured steps per window")
    ap.add_argument(
        "--modes",
        default="none,commit",
        help="dense loop: the modes interleaved, of " + ",".join(MODES) + " (each optionally "
        "@issue, @lib, @early, @issue+early, ...)",
    )
    ap.add_argument("--switch-short", type=float, default=2e-4, help="the 'si' mode's sys.setswitchinterval (s)")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) for the run: how long a thread may keep the GIL from another",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="a path (.json.gz): a torch.profiler trace of a few dense steps of the device path",
    )
    ap.add_argument(
        "--d2h-mib", type=int, default=512, help="MiB of the device-to-host bandwidth and host checksum measures"
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (see the docstring)")
    args = ap.parse_args()
    for name in ("steps", "rounds", "window", "ids", "dim", "d2h_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")

    import torch
    import torch.distributed as dist

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    from elastic_emb.context.changes import RowsTaken
    from elastic_emb.protocol import ContextBase, ShardData
    from elastic_emb.state import Comm, SnapshotTier
    from elastic_emb.state.capture import DELTA_CHECKSUM, DeviceCapture
    from elastic_emb.state.ring import Segment
    from elastic_emb.state.writer import CommitWriter
    from elastic_emb.testing.ports import free_port
    from elastic_emb.topology import Topology

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench/commit_gpu.py: no CUDA device (use --device cpu for a smoke run)")
    modes, left_out = parse_modes(args.modes, cuda)
    if left_out:
        print(
            f"on {dev.type}: modes {', '.join(left_out)} left out (they measure the CUDA device path's own settings)",
            flush=True,
        )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = int(args.table_gib * 2**30) // (args.dim * 4)
    if rows < 2:
        ap.error(f"--table-gib {args.table_gib} with --dim {args.dim} makes {rows} rows: at least 2")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    topo = Topology.build(
        run_id="bench",
        generation=1,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )
    comm = Comm(topo, store, None, timeout=600)
    # The library's own context (world size 1: its lookup and apply_gradients, change tracking
    # and written values): the "@lib" modes of the dense windows train through it. The bench's
    # context below holds no table of its own: it works on this context's arena (one table on
    # the GPU, one base on the host for both loops).
    from elastic_emb.context import EmbContext
    from elastic_emb.protocol import OptimizerSpec, TableSpec

    lib_topo = Topology.build(
        run_id="bench-lib",
        generation=1,
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
    lctx = EmbContext(
        lib_topo,
        store,
        tables=[TableSpec(name="emb", num_rows=rows, dim=args.dim)],
        optimizer=OptimizerSpec(kind="adagrad", lr=0.01),
        device=dev,
        timeout=600.0,
        seed=None,
    )

    class Ctx(ContextBase):
        tracks_changes = True

        def __init__(self):
            self.topology = topo
            self.rows = range(rows)
            view = lctx.shard_views()["emb"]  # the library context's arena (see lctx above)
            self.w = view.weight.uniform_(-0.01, 0.01)
            self.acc = view.slots["accumulator"].zero_()
            lctx.mark_restored()  # every row written (here): no lazy fill from the seed
            lctx.take_changed_rows()  # and the baseline of its change tracking
            self.changed = torch.zeros(rows, dtype=torch.bool, device=dev)
            self.written: list[torch.Tensor] = []  # as EmbContext tracks: the rows of each write
            # the new values each write computed, as the optimizer materialises them
            # (elastic_emb.context.optim.apply_rows) and EmbContext's tracker hands them over
            self.values: list[dict[str, torch.Tensor]] = []
            self.held: list = []  # GPU captures still reading rows (hold_writes)

        def shard_views(self):
            return {"emb": ShardData("emb", self.rows, self.w, {"accumulator": self.acc})}

        export_shard = shard_views

        def import_shard(self, shards):
            raise AssertionError("not used")

        def take_changes(self):
            out, self.changed = self.changed, torch.zeros(rows, dtype=torch.bool, device=dev)
            self.written, self.values = [], []
            return {"emb": out}

        def take_changed_rows(self, unique: bool = True):
            # raw (the device path): as EmbContext's tracker takes them, one write's rows as they
            # are, several concatenated; unique (the host path): sorted and distinct
            w = self.written
            out = w[0] if len(w) == 1 else torch.cat(w) if w else torch.empty(0, dtype=torch.int64, device=dev)
            written = {"emb": self.values[0]} if len(w) == 1 and len(self.values) == 1 and not unique else {}
            self.written, self.values = [], []
            return RowsTaken({"emb": torch.unique(out) if unique else out}, written)

        def hold_writes(self, event) -> None:
            self.held.append(event)

        def before_write(self) -> None:
            for event in self.held:
                event.wait(torch.cuda.current_stream(dev))
            self.held = []

    ctx = Ctx()
    gen = torch.Generator(device=dev).manual_seed(0)
    mm = 8192 if cuda else 256
    x = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    wd = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16) / math.sqrt(mm)

    def emb_step() -> torch.Tensor:
        ids = torch.randint(0, rows, (args.ids,), device=dev, generator=gen)
        grads = torch.randn(args.ids, args.dim, device=dev, generator=gen)
        uniq, inv = torch.unique(ids, return_inverse=True)
        g = torch.zeros(len(uniq), args.dim, device=dev).index_add_(0, inv, grads)
        update(uniq, g)
        return g

    def update(uniq: torch.Tensor, g: torch.Tensor) -> None:
        """Row-wise Adagrad on the distinct rows ``uniq``, as elastic_emb.context.optim.apply_rows
        computes it (the new accumulator and rows materialised, then index_copy_), and the marks."""
        ctx.before_write()  # a GPU capture still reading rows finishes first (EmbContext does the same)
        new_acc = ctx.acc.index_select(0, uniq) + (g * g).mean(dim=1)
        ctx.acc.index_copy_(0, uniq, new_acc)
        new_rows = ctx.w.index_select(0, uniq) - 0.01 * g / (new_acc.sqrt()[:, None] + 1e-10)
        ctx.w.index_copy_(0, uniq, new_rows)
        ctx.changed[uniq] = True
        ctx.written.append(uniq)
        if len(ctx.values) < 2:  # (two: more than one write since the take, the capture gathers)
            ctx.values.append({"weight": new_rows, "accumulator": new_acc})

    def dense(reps: int) -> torch.Tensor:
        y = x
        for _ in range(reps):
            y = torch.tanh(y @ wd)
        return y

    def timed(fn, n=3) -> float:
        xs = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs)

    emb_s = timed(emb_step)
    mm_s = timed(lambda: dense(1))
    reps = max(0, math.ceil((args.min_step_ms / 1e3 - emb_s) / mm_s)) if args.min_step_ms else 0

    def step(with_dense: bool) -> float:
        loss = emb_step().sum()
        if with_dense:
            loss = loss + dense(reps).float().mean()
        return loss.item()  # waits for the training stream only, as reading a real loss does

    def bandwidths(nbytes: int) -> tuple[float, float, float | None, int]:
        """The pinned device-to-host copy's GB/s (the bound of a commit that leaves the GPU; on
        the CPU a host copy), and the writer's checksums of the same bytes on the host: CRC32 and
        XXH3-64 GB/s (elastic_emb.state.crc and .digest: chunks on their threads), their threads."""
        from elastic_emb.state.crc import checksum_ranges, threads

        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        d2h = nbytes / timed(lambda: pinned.copy_(src, non_blocking=True), 5) / 1e9
        host = pinned.numpy()
        crc = nbytes / timed(lambda: checksum_ranges(host, [(0, nbytes)]), 5) / 1e9
        try:
            from elastic_emb.state.digest import digest_ranges
        except ImportError:  # a library from before XXH3-64 (a before/after run)
            xxh = None
        else:
            xxh = nbytes / timed(lambda: digest_ranges(host, [(0, nbytes)], "xxh3_64"), 5) / 1e9
        return d2h, crc, xxh, threads()

    d2h_gbs, crc_gbs, xxh_gbs, crc_threads = bandwidths(args.d2h_mib << 20)

    out: dict = {
        "table_gib": args.table_gib,
        "dim": args.dim,
        "rows": rows,
        "ids_per_step": args.ids,
        "dense_matmuls": reps,
        "pinned_d2h_gbs": d2h_gbs,
        "host_crc32_gbs": crc_gbs,
        "host_xxh3_gbs": xxh_gbs,
        "host_crc32_threads": crc_threads,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "switch_interval_s": sys.getswitchinterval(),
    }
    shard_bytes = rows * (args.dim * 4 + 4)
    state = pick_dir(int(shard_bytes * 1.6) + (4 * 2**30 if cuda else 0), args.state_dir)
    out["state_dir"] = str(state)

    # The device-path loops time the writer's stages: the library's tier, its write and prune
    # timed while ``timing`` is set (the CommitWriter calls them in its thread).
    done: dict[int, float] = {}  # step -> when its commit was complete
    stages: dict[int, dict] = {}
    prunes: list[float] = []

    class Landing:  # the capture's copy event, noting when the whole copy had landed
        def __init__(self, inner, at: list) -> None:
            self.inner, self.at = inner, at

        def synchronize(self) -> None:
            self.inner.synchronize()
            self.at.append(time.perf_counter())

        def landed(self):  # the writer checksums each piece as it lands (elastic_emb.state.digest)
            yield from self.inner.landed()
            self.at.append(time.perf_counter())

    class TimedTier(SnapshotTier):
        timing = False
        skip = False  # the "nowrite" mode: the writer only waits for the copy, writes nothing

        def write(self, cap, c):
            if not self.timing:
                return super().write(cap, c)
            t0, at = time.perf_counter(), []
            if self.skip:  # only wait for the copy: no checksums, no manifest
                cap.copied.synchronize()
                done[cap.step] = time.perf_counter()
                stages[cap.step] = {
                    "wait_copy_s": done[cap.step] - t0,
                    "crc_write_manifest_s": 0.0,
                    "write_s": done[cap.step] - t0,
                    "bytes": int(cap.blob.numel()),
                    "ring": False,
                }
                return 0, 0
            if cap.copied is not None:
                cap = dataclasses.replace(cap, copied=Landing(cap.copied, at))
            r = super().write(cap, c)
            done[cap.step] = time.perf_counter()
            t1 = at[-1] if at else t0
            # wait_copy: until the whole copy had landed (checksumming what landed meanwhile);
            # crc_write_manifest: the writer's work left after that (checksums, manifest)
            stages[cap.step] = {
                "wait_copy_s": t1 - t0,
                "crc_write_manifest_s": done[cap.step] - t1,
                "write_s": done[cap.step] - t0,
                "bytes": int(cap.blob.numel()),
                "ring": isinstance(cap.buffer, Segment),
            }
            return r

        def prune(self, c, **kw):
            if not self.timing:
                return super().prune(c, **kw)
            if self.skip:
                return []
            t0 = time.perf_counter()
            try:
                return super().prune(c, **kw)
            finally:
                prunes.append(time.perf_counter() - t0)

    tier = TimedTier(state, "bench", "node0", replication=0, keep=2, max_chain=10**6)
    num_rows = {"emb": rows}

    for label, with_dense in (("dense", True), ("emb_only", False)):
        base = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(with_dense)
            base.append(time.perf_counter() - t0)
        out[f"step_none_{label}_ms"] = _median_ms(base)

    # The first commit is a base: the whole shard, today's full snapshot.
    ctx.take_changes()
    t0 = time.perf_counter()
    tier.commit(0, ctx.shard_views(), comm, num_rows, changes=ctx.take_changes())
    out["commit_full_s"] = time.perf_counter() - t0
    out["full_bytes"] = shard_bytes
    base_commit = max(m.commit for _, m in tier.manifests() if m.parent is None)
    step_no = 1

    # The device path (elastic_emb.state.capture): gather on a side stream, async copy to pinned
    # memory, checksums and the write in the background writer, up to 3 commits in flight. On the
    # CPU the same loops through the host path (see the docstring).
    if cuda:
        pieces = {} if args.copy_piece_mb is None else {"piece_bytes": int(args.copy_piece_mb * 2**20)}
        device = DeviceCapture(dev, buffers=3, timeout=600, **pieces)
        out["copy_piece_bytes"] = device.piece_bytes
        # The dense windows' other capture settings: larger and smaller pieces of the copy.
        variants = {
            "commit": device,
            "bigpiece": DeviceCapture(dev, buffers=3, timeout=600, piece_bytes=64 << 20),
            "piece4": DeviceCapture(dev, buffers=3, timeout=600, piece_bytes=4 << 20),
            "piece8": DeviceCapture(dev, buffers=3, timeout=600, piece_bytes=8 << 20),
        }
    else:
        device, variants = None, {"commit": None}
    out["delta_checksum"] = DELTA_CHECKSUM if cuda else "crc32"
    out["capture_path"] = "device" if cuda else "host"
    dwriter = CommitWriter(tier, comm, timeout=600, depth=3)
    if cuda:
        tier.enable_spares(4)  # as the lifecycle does: data files allocated ahead
        if args.ring:  # the log ring, made (and registered) at the first delta, a warm-up one
            tier.enable_ring(args.ring)
    # (GPU deltas are never folded; nor are the host path's here, so every window starts at the base)
    plain_fold, tier.fold, tier.timing = tier.fold, False, True

    def take(c):
        """The rows ``c`` wrote since the last take: raw for the device path, distinct for the host's."""
        return c.take_changed_rows(unique=not cuda)

    def capture(c, n: int, views, taken, cur):
        """``SnapshotTier.capture`` of a delta, on the device with the capture ``cur``; on the CPU
        through the host path, whose delta names its parent once that is written."""
        if cuda:
            return tier.capture(n, views, topo, num_rows, taken, device=cur, hold=c.hold_writes)
        dwriter.wait()
        return tier.capture(n, views, topo, num_rows, taken)

    # The dense loop: windows of --window steps in each mode, interleaved round after round in
    # this process (the baseline beside the commits, so drifts of the machine hit both); per
    # round the overhead of each mode against that round's baseline window; the figure is the
    # median over the rounds, with its spread. Modes: none (no commit), commit (the device
    # path), nowrite (the writer only waits for the copy: no checksums, manifest, prune), si
    # (commit, with a short sys.setswitchinterval), the piece sizes. Per step the training
    # thread's spans: the embedding part (to its row update, a host sync inside), launching the
    # dense part, the loss read, the commit call.

    def spans_step(order: str, early=None) -> tuple[float, float, float, float, float]:
        """One dense step: ``update-first`` (the loop above: the row update, then the dense
        part), or ``issue`` (issue 17's shape: lookup, dense part, apply_gradients; the next
        step's row update, which waits for a capture's gather, then comes after its dense part),
        or ``lib`` (the same shape through the library's EmbContext: ``lookup(...).wait()``,
        the dense part, ``apply_gradients`` of a random gradient per id; no torch.unique of the
        bench's, the context's own sort-based dedup and its device-side checks instead).
        ``early``: called between the launches and the loss read (the commit, while the GPU
        still runs the step). Times: start, end of the first part (a host sync inside:
        torch.unique's count), end of the launches, end of ``early``, end of the loss read."""
        t0 = time.perf_counter()
        if order == "update-first":
            g = emb_step()
            t1 = time.perf_counter()
            loss = g.sum() + dense(reps).float().mean()
        elif order == "lib":
            ids = torch.randint(0, rows, (args.ids,), device=dev, generator=gen)
            looked = lctx.lookup("emb", ids).wait()  # (waits for the lookup's device-side check)
            t1 = time.perf_counter()
            y = dense(reps)
            grads = torch.randn(args.ids, args.dim, device=dev, generator=gen)
            lctx.apply_gradients("emb", ids, grads)
            loss = y.float().mean() + looked.mean()
        else:
            ids = torch.randint(0, rows, (args.ids,), device=dev, generator=gen)
            uniq, inv = torch.unique(ids, return_inverse=True)
            looked = ctx.w[uniq]  # the lookup (a real one gathers per id; per distinct row here)
            t1 = time.perf_counter()
            y = dense(reps)
            grads = torch.randn(args.ids, args.dim, device=dev, generator=gen)
            g = torch.zeros(len(uniq), args.dim, device=dev).index_add_(0, inv, grads)
            update(uniq, g)
            loss = y.float().mean() + looked.mean()
        t2 = time.perf_counter()
        if early is not None:
            early()
        t2e = time.perf_counter()
        loss.item()
        return t0, t1, t2, t2e, time.perf_counter()

    called: dict[int, float] = {}
    call_ms: dict[str, dict[str, list[float]]] = {}  # mode -> part of the commit call -> ms per call

    def forget_deltas() -> None:
        """After a drained window, outside every measured span: the deltas written go (their
        log segments free again) and the next delta extends the base again. Without this the
        chain grows without end (the bench keeps the base: a new one is a 17 GB host copy)
        and its deltas hold every segment of the ring, so later windows fall back to files."""
        tier.rewind(base_commit)

    def window(name: str) -> tuple[list[tuple], list[float]]:
        nonlocal step_no
        # "MODE@issue": in the issue's step order; "MODE@early" / "MODE@issue+early": the
        # commit called before the loss read (the GPU still busy with the step), not after it
        mode, _, suffix = name.partition("@")
        # "MODE@lib": the library's own loop (spans_step's "lib" order) on its EmbContext
        order = next((o for o in ("issue", "lib") if o in suffix.split("+")), "update-first")
        c = lctx if order == "lib" else ctx  # the context the step writes and the commit takes
        early = "early" in suffix.split("+")
        commit = mode != "none"
        tier.skip = mode == "nowrite"
        cur = variants.get(mode, device)
        if mode == "si":
            sys.setswitchinterval(args.switch_short)
        got, lats, first = [], [], step_no
        try:

            def do_commit() -> None:
                nonlocal step_no
                called[step_no] = ta = time.perf_counter()
                views = c.shard_views()
                tb = time.perf_counter()
                taken = take(c)
                tc = time.perf_counter()
                cap = capture(c, step_no, views, taken, cur)
                td = time.perf_counter()
                assert cap.parent is not None, "the dense windows capture deltas"
                dwriter.submit(cap)
                te = time.perf_counter()
                if step_no - first >= 2:  # (the call's parts: views, take, SnapshotTier.capture, submit)
                    for label, dt in (
                        ("call_views", tb - ta),
                        ("call_take", tc - tb),
                        ("call_tier_capture", td - tc),
                        ("call_submit", te - td),
                    ):
                        call_ms.setdefault(name, {}).setdefault(label, []).append(dt * 1e3)
                step_no += 1

            for i in range(args.window + 2):  # the first two fill the pipeline
                t0, t1, t2, t2e, t3 = spans_step(order, do_commit if commit and early else None)
                if commit and not early:
                    do_commit()
                elif not commit and c is ctx:
                    ctx.written.clear()  # as a commit's take would (outside no measured span)
                    ctx.values.clear()
                t4 = time.perf_counter()
                if not commit and c is lctx:  # as a commit's take would, after the step's span
                    take(lctx)
                if i >= 2:  # (spans: first part, launches, loss read, commit call, step)
                    got.append((t1 - t0, t2 - t1, t3 - t2e, (t2e - t2) + (t4 - t3), t4 - t0))
            dwriter.wait()
            forget_deltas()
        finally:
            tier.skip = False
            sys.setswitchinterval(switch_default)
        if commit:
            lats = [done[k] - called[k] for k in range(first + 2, step_no)]
        return got, lats

    switch_default = sys.getswitchinterval()
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    spans: dict[str, list[tuple]] = {m: [] for m in modes}
    lat_all: list[float] = []
    lat_issue: list[float] = []
    lat_lib: list[float] = []
    for _ in range(2):  # warm-up windows (the ring's segments, the allocator, the threads)
        window("commit")
        if any("lib" in m.partition("@")[2].split("+") for m in modes):
            window("commit@lib")  # (and the library's lookup kernel, its tracker's written values)
    call_ms.clear()
    for r in range(args.rounds):
        # A fresh random order each round (seeded): with a plain rotation the mode listed after
        # "none" followed a window without commits in all rounds but one, and measured 1.5-2
        # points above the same code in another position (three H200 runs)
        seq = random.Random(r).sample(modes, len(modes))
        meds = {}
        for m in seq:
            got, lats = window(m)
            spans[m] += got
            meds[m] = statistics.median(x[4] for x in got)
            if m == "commit":
                lat_all += lats
            elif m == "commit@issue":
                lat_issue += lats
            elif m == "commit@lib":
                lat_lib += lats
        for m in modes:
            base = "none" + m[len(m.split("@")[0]) :]
            per_round[m].append(meds[m] / meds[base] - 1 if m != base else meds[m])
    names = ("emb_ms", "dense_launch_ms", "loss_read_ms", "commit_call_ms", "step_ms")
    out["dense_windows"] = {
        "rounds": args.rounds,
        "window_steps": args.window,
        "modes": modes,
        "switch_short_s": args.switch_short,
    }
    for m in modes:
        is_base = m.startswith("none")
        out["dense_windows"][m] = {
            "spans_median_ms": {n: _median_ms([x[j] for x in spans[m]]) for j, n in enumerate(names)},
            "overhead_pct_per_round": None if is_base else [100 * v for v in per_round[m]],
            "overhead_pct_median": None if is_base else 100 * statistics.median(per_round[m]),
            "commit_call_parts_ms": {k: statistics.median(v) for k, v in call_ms.get(m, {}).items()},
        }
    out["step_none_dense_interleaved_ms"] = _median_ms(per_round["none"])
    ov = [100 * v for v in per_round["commit"]]
    out["overhead_device_dense_pct"] = statistics.median(ov)
    out["overhead_device_dense_pct_range"] = [min(ov), max(ov)]
    out["step_device_dense_ms"] = out["dense_windows"]["commit"]["spans_median_ms"]["step_ms"]
    out["commit_call_device_dense_ms"] = out["dense_windows"]["commit"]["spans_median_ms"]["commit_call_ms"]
    out["latency_device_dense_ms"] = _median_ms(lat_all)
    out["latency_device_dense_ms_max"] = max(lat_all) * 1e3
    out["latency_device_dense_steps"] = out["latency_device_dense_ms"] / out["step_none_dense_interleaved_ms"]
    if "commit@issue" in modes:
        ov = [100 * v for v in per_round["commit@issue"]]
        out["overhead_device_dense_issue_order_pct"] = statistics.median(ov)
        out["overhead_device_dense_issue_order_pct_range"] = [min(ov), max(ov)]
        out["step_none_dense_issue_order_ms"] = _median_ms(per_round["none@issue"])
        out["latency_device_dense_issue_order_ms"] = _median_ms(lat_issue)
        out["latency_device_dense_issue_order_ms_max"] = max(lat_issue) * 1e3
        out["latency_device_dense_issue_order_steps"] = (
            out["latency_device_dense_issue_order_ms"] / out["step_none_dense_issue_order_ms"]
        )
    if "commit@lib" in modes:  # the library's own loop (EmbContext lookup and apply_gradients)
        ov = [100 * v for v in per_round["commit@lib"]]
        out["overhead_device_dense_lib_pct"] = statistics.median(ov)
        out["overhead_device_dense_lib_pct_range"] = [min(ov), max(ov)]
        out["overhead_device_dense_lib_pct_quartiles"] = statistics.quantiles(ov, n=4) if len(ov) > 1 else ov
        out["overhead_device_dense_lib_rounds_at_most_2pct"] = sum(v <= 2.0 for v in ov)
        out["step_none_dense_lib_ms"] = _median_ms(per_round["none@lib"])
        out["latency_device_dense_lib_ms"] = _median_ms(lat_lib)
        out["latency_device_dense_lib_ms_max"] = max(lat_lib) * 1e3
        out["latency_device_dense_lib_steps"] = out["latency_device_dense_lib_ms"] / out["step_none_dense_lib_ms"]
    print(
        "dense loop, interleaved windows (median over %d rounds of %d steps; spans ms: emb, dense launch, "
        "loss read, commit call, step):" % (args.rounds, args.window),
        flush=True,
    )
    for m in modes:
        d = out["dense_windows"][m]
        ovs = d["overhead_pct_per_round"]
        print(
            f"  {m:8s} "
            + " ".join(f"{v:7.3f}" for v in d["spans_median_ms"].values())
            + (
                ""
                if ovs is None
                else f"  overhead {d['overhead_pct_median']:+.2f}% (rounds {min(ovs):+.2f}..{max(ovs):+.2f})"
            ),
            flush=True,
        )
        if d["commit_call_parts_ms"]:
            parts_text = " ".join(f"{k} {v:.3f}" for k, v in d["commit_call_parts_ms"].items())
            print(f"           commit call, ms: {parts_text}", flush=True)
    print(
        f"  commit latency {out['latency_device_dense_ms']:.1f} ms median "
        f"({out['latency_device_dense_steps']:.2f} steps), max {out['latency_device_dense_ms_max']:.1f} ms",
        flush=True,
    )
    if lat_lib:
        print(
            f"  commit@lib latency {out['latency_device_dense_lib_ms']:.1f} ms median "
            f"({out['latency_device_dense_lib_steps']:.2f} steps), "
            f"max {out['latency_device_dense_lib_ms_max']:.1f} ms; "
            f"rounds at most +2%: {out['overhead_device_dense_lib_rounds_at_most_2pct']} of {args.rounds}, "
            f"quartiles " + " ".join(f"{q:+.2f}%" for q in out["overhead_device_dense_lib_pct_quartiles"]),
            flush=True,
        )
    if lat_issue:
        print(
            f"  commit@issue latency {out['latency_device_dense_issue_order_ms']:.1f} ms median "
            f"({out['latency_device_dense_issue_order_steps']:.2f} steps), max "
            f"{out['latency_device_dense_issue_order_ms_max']:.1f} ms",
            flush=True,
        )

    # The embedding-only loop: the writer woken every MARK_BYTES landed (the library's). Where the
    # training thread's time in a commit goes, per part (host time): taking the rows, the tier's
    # capture (laying out the delta, its log segment, the "step done" event), the hand-over.
    label = "emb_only"
    parts: dict[str, list[float]] = {"take_rows": [], "tier_capture": [], "submit": []}
    prunes.clear()
    forget_deltas()
    steps, calls, lat = [], [], []
    first = step_no
    for i in range(args.steps + 2):  # the first two fill the pipeline and the pinned buffers
        t0 = time.perf_counter()
        step(False)
        t1 = time.perf_counter()
        taken = take(ctx)
        ta = time.perf_counter()
        cap = capture(ctx, step_no, ctx.shard_views(), taken, device)
        tb = time.perf_counter()
        assert cap.parent is not None, "the embedding-only loop captures deltas"
        dwriter.submit(cap)
        t2 = time.perf_counter()
        called[step_no] = t1
        if i >= 2:
            steps.append(t2 - t0)
            calls.append(t2 - t1)
            for key, dt in (("take_rows", ta - t1), ("tier_capture", tb - ta), ("submit", t2 - tb)):
                parts[key].append(dt)
        step_no += 1
    t_end = time.perf_counter()
    dwriter.wait()
    t_drained = time.perf_counter()
    lat = [done[k] - called[k] for k in range(first + 2, step_no)]
    byts = [stages[k]["bytes"] for k in range(first + 2, step_no)]
    out[f"step_device_{label}_ms"] = _median_ms(steps)
    out[f"commit_call_device_{label}_ms"] = _median_ms(calls)
    base_ms = out["step_none_emb_only_ms"]
    out[f"overhead_device_{label}_pct"] = 100 * (out[f"step_device_{label}_ms"] / base_ms - 1)
    out[f"latency_device_{label}_ms"] = _median_ms(lat)
    out[f"latency_device_{label}_steps"] = out[f"latency_device_{label}_ms"] / base_ms
    out[f"delta_bytes_device_{label}"] = statistics.median(byts)
    # Sustained: every delta of the measured steps written, over the time from the first
    # measured step to the last commit complete.
    span = done[step_no - 1] - (called[first + 2] - steps[0] + calls[0])
    out[f"sustained_device_{label}_gbs"] = sum(byts) / span / 1e9
    out[f"sustained_device_{label}_of_d2h"] = out[f"sustained_device_{label}_gbs"] / d2h_gbs
    # Steady: the rate between the first and the last measured commit complete, without
    # the pipeline's fill (the warm-up commits still copying when the window opens) and
    # drain that "sustained" charges to a window of only --steps commits.
    ks = list(range(first + 2, step_no))
    steady = sum(byts[1:]) / (done[ks[-1]] - done[ks[0]]) / 1e9 if len(ks) > 1 else None
    out[f"steady_device_{label}_gbs"] = steady
    out[f"steady_device_{label}_of_d2h"] = None if steady is None else steady / d2h_gbs
    out[f"stages_device_{label}_ms"] = {
        k: _median_ms([stages[j][k] for j in range(first + 2, step_no)])
        for k in ("wait_copy_s", "crc_write_manifest_s", "write_s")
    }
    out[f"drain_device_{label}_ms"] = (t_drained - t_end) * 1e3
    out[f"ring_commits_device_{label}"] = sum(stages[k]["ring"] for k in range(first + 2, step_no))
    if args.profile:  # the device timeline of a few dense steps, each committed
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(4):
                step(True)
                dwriter.submit(capture(ctx, step_no, ctx.shard_views(), take(ctx), device))
                step_no += 1
            dwriter.wait()
        prof.export_chrome_trace(args.profile)
    tier.timing, tier.fold = False, plain_fold
    out["writer_prune_ms"] = _median_ms(prunes) if prunes else None
    out["commit_call_parts_ms"] = {k: _median_ms(v) for k, v in parts.items()}
    dwriter.close()
    out["ring_segment_bytes"] = tier.ring.size if tier.ring is not None else 0
    tier.close_spares()  # and the log ring (unregistered; its segments go with the state dir)
    gbs = out["sustained_device_emb_only_gbs"]
    st = out["stages_device_emb_only_ms"]
    out["ring_segments"] = args.ring if cuda else 0
    # Per commit, the time of each stage of the pipeline; the slowest one bounds it: the call's
    # own work on the training thread (taking the rows, laying out and handing over the
    # capture; the rest of a call is waiting for a commit slot, i.e. back-pressure), the
    # copy at the pinned D2H bandwidth, and the writer's host work once the copy has landed (the
    # checksums not done while it landed, the manifest, the prune).
    own = out["commit_call_parts_ms"]["take_rows"] + out["commit_call_parts_ms"]["tier_capture"]
    copy_ms = out["delta_bytes_device_emb_only"] / d2h_gbs / 1e6
    host_ms = st["crc_write_manifest_s"] + (out["writer_prune_ms"] or 0.0)
    stage = {
        "the capture call in the training thread": own,
        "the pinned D2H copy": copy_ms,
        "the host side (the writer's checksums left after the copy, manifest and prune)": host_ms,
    }
    bound = max(stage, key=stage.get)
    out["device_emb_only_stage_ms"] = {"capture_call": own, "d2h_copy": copy_ms, "writer_host": host_ms}
    out["device_emb_only_bound_by"] = bound
    steady_text = "-" if steady is None else f"{steady:.1f} GB/s = {100 * steady / d2h_gbs:.0f}%"
    print(
        f"device path, embedding-only loop: {gbs:.1f} GB/s sustained = {100 * gbs / d2h_gbs:.0f}% of the pinned "
        f"D2H bandwidth ({d2h_gbs:.1f} GB/s), {steady_text} between the first "
        f"and the last commit complete; per commit: the copy {copy_ms:.1f} ms at that bandwidth, "
        f"the writer after it (checksums left, manifest, prune) {host_ms:.1f} ms, the capture call {own:.1f} ms: "
        f"bound by {bound}",
        flush=True,
    )
    if args.device_only:
        shutil.rmtree(state, ignore_errors=True) if not args.state_dir else None
        print(json.dumps(out, indent=1))
        write_json(args.json, "commit_gpu", out, indent=1)
        return

    forget_deltas()  # the host path's commits below extend the base, as the device path's did
    for label, with_dense in (("dense", True), ("emb_only", False)):
        steps, commits, written = [], [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(with_dense)
            t1 = time.perf_counter()
            w, _ = tier.commit(step_no, ctx.shard_views(), comm, num_rows, changes=ctx.take_changes())
            tier.prune(comm)
            t2 = time.perf_counter()
            steps.append(t2 - t0)
            commits.append(t2 - t1)
            written.append(w)
            step_no += 1
        out[f"step_incremental_{label}_ms"] = _median_ms(steps)
        out[f"commit_incremental_{label}_ms"] = _median_ms(commits)
        out[f"delta_bytes_{label}"] = statistics.median(written)
        out[f"overhead_incremental_{label}_pct"] = 100 * (
            out[f"step_incremental_{label}_ms"] / out[f"step_none_{label}_ms"] - 1
        )
        out[f"commit_gbs_{label}"] = out[f"delta_bytes_{label}"] / (out[f"commit_incremental_{label}_ms"] / 1e3) / 1e9

    writer = CommitWriter(tier, comm, timeout=600)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(True)
        writer.wait()  # as lc.commit does: the next capture follows the commit in flight (its parent)
        cap = tier.capture(step_no, ctx.shard_views(), topo, num_rows, ctx.take_changes())
        writer.submit(cap)
        steps.append(time.perf_counter() - t0)
        step_no += 1
    writer.wait()
    out["step_async_dense_ms"] = _median_ms(steps)
    out["overhead_async_dense_pct"] = 100 * (out["step_async_dense_ms"] / out["step_none_dense_ms"] - 1)
    lat = []
    for _ in range(args.latency_commits):
        step(True)
        t0 = time.perf_counter()
        writer.submit(tier.capture(step_no, ctx.shard_views(), topo, num_rows, ctx.take_changes()))
        writer.wait()
        lat.append(time.perf_counter() - t0)
        step_no += 1
    out["async_latency_ms"] = _median_ms(lat) if lat else None
    out["async_latency_steps"] = out["async_latency_ms"] / out["step_none_dense_ms"] if lat else None
    shutil.rmtree(state / "bench", ignore_errors=True)

    if args.dcp_steps:
        import torch.distributed.checkpoint as dcp

        dist.init_process_group("gloo", store=dist.PrefixStore("dcp/", store), rank=0, world_size=1)
        blocking, done_dcp = [], []
        for k in range(args.dcp_steps):
            step(True)
            t0 = time.perf_counter()
            fut = dcp.async_save({"w": ctx.w, "acc": ctx.acc}, checkpoint_id=str(state / f"dcp{k}"))
            blocking.append(time.perf_counter() - t0)
            fut.result()
            done_dcp.append(time.perf_counter() - t0)
            shutil.rmtree(state / f"dcp{k}", ignore_errors=True)
        out["dcp_async_save_blocking_ms"] = _median_ms(blocking)
        out["dcp_async_save_complete_ms"] = _median_ms(done_dcp)
        out["overhead_dcp_dense_pct"] = 100 * out["dcp_async_save_blocking_ms"] / out["step_none_dense_ms"]
        dist.destroy_process_group()
    writer.close()
    shutil.rmtree(state, ignore_errors=True) if not args.state_dir else None
    print(json.dumps(out, indent=1))
    write_json(args.json, "commit_gpu", out, indent=1)


if __name__ == "__main__":
    main()
