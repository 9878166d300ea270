"""The run the commit benches time: one rank, the public API, every step of a run.

bench/app_state.py, bench/commit.py, bench/commit_gpu.py and bench/commit_torchrec.py measure
what a user's training loop pays for ``lc.commit(step)`` (issue 34, point 6: a run, not a
window). This module is their common loop, so that they measure the same thing the same way:

* one rank in this process, on loopback (:class:`OneRank`: a TCPStore, and torchrun's variables
  passed as the ``env`` of ``Lifecycle.start``), each loop with a fresh state directory and a
  generation of its own;
* ``Lifecycle.start(factory, LifecycleConfig(), ...)``: the default configuration (the state
  directory and the node come from the environment: ``ELASTIC_EMB_STATE_DIR``,
  ``ELASTIC_EMB_NODE_ID``);
* the rows warmed before the clock starts: the bench's ``warm`` touches every row once (an
  ``EmbContext``: every row looked up, which also fills its lazily seeded rows), so that no loop
  pays the first touch of its arena's pages inside its steps (a job that trains has long paid
  it); then :data:`WARM_STEPS` steps without a commit, so that the process's one-off costs (the
  first backward, a kernel's first call, the allocator's growth) fall in neither loop (the first
  loop would pay them alone); the process's resident memory after the warm-up is recorded;
* ``steps`` steps, each timed from its start to the return of ``lc.commit(step)`` (the baseline:
  the same steps, no commit) with nothing left out: the first base and whatever periodic work the
  commit path does (a base, a fold, a write of deltas into their base), every wait for the
  background writer, falls in the step it delays; after the last step, the wait for the
  commits still in flight (``lc.wait_commit()``) is timed apart (``drain_ms``) and counted in
  ``total_s``;
* the restore (:func:`restore`): ``Lifecycle.start`` of fresh objects (a new context) from the
  commit loop's last commit, checked against the rows that loop left (float64 sums of every row
  and slot, taken in the same order), :data:`RESTORE_REPS` times, each followed by its floors'
  reads (medians reported, and every value); before each of the restore and the reads into
  fresh memory, as much memory as the node directory holds is touched and freed, untimed
  (:func:`touch_and_free`: on a VM that hands idle memory back to its host, a first touch
  otherwise costs whatever the host's state makes it, 0.2 to 8 s for 2 GiB here);
* its references (:func:`read_pieces`): the restored commit's chain (its base and deltas, the
  byte ranges a restore must read at least) and every file of the node directory, each read
  once into fresh memory (the first touch of that memory included, as a restore into a fresh
  arena pays it: the ratio's reference), and the chain once more into memory already touched
  (the read alone: how much of the floor is the first touch, which on a VM can be most of it);
* memory: the process's peak resident memory, and the peak of the used bytes of the state
  directory's filesystem during each loop (sampled once a second by a thread), for planning a
  larger run.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_emb import EmbContext, Lifecycle, LifecycleConfig, OptimizerSpec, TableSpec
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import torchrun_env

NODE = "n0"
TABLE = "t"
WARM_STEPS = 2  # untimed steps before the clock, no commit: the process's one-off costs out of both loops
SUM_ROWS = 1 << 16  # rows per piece of the checksums (float64 pieces, not a copy of the table)

StepFn = Callable[[Lifecycle, int], None]
WarmFn = Callable[[Lifecycle], None]


def rss_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    """Memory the kernel says is available (``MemAvailable``), or None where /proc does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def exit_on_sigterm() -> None:
    """A SIGTERM (a timeout's, a smoke test's) raises SystemExit in the main thread, so the bench's
    ``finally`` blocks close the lifecycle and remove its state directories: a killed run would
    otherwise leave gigabytes in /dev/shm. The lifecycle then installs no SIGTERM handler of its
    own (it never replaces one it did not install), which changes nothing a run measures."""

    def stop(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def in_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs or ramfs (its files take memory), by /proc/mounts."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    real = str(path.resolve())
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return best is not None and best[1] in ("tmpfs", "ramfs")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class FsPeak:
    """The peak of the used bytes of the filesystem holding ``path`` (its nearest existing
    folder), sampled every ``every`` seconds by a daemon thread while the ``with`` block runs:
    on a tmpfs, the memory the state takes (plus whatever else uses that filesystem)."""

    def __init__(self, path: Path, every: float = 1.0) -> None:
        while not path.exists() and path != path.parent:
            path = path.parent
        self.path, self.every, self.peak = path, every, shutil.disk_usage(path).used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-fs-peak", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used)

    def __enter__(self) -> "FsPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak = max(self.peak, shutil.disk_usage(self.path).used)


class OneRank:
    """A world of one rank on loopback: the store, and per ``Lifecycle.start`` an environment
    with the next generation (each start agrees afresh) and the given state directory.

    Args:
        run_id: ``TORCHELASTIC_RUN_ID`` (the state goes to ``<state dir>/<run_id>/n0``).
        backend: ``gloo`` (CPU contexts) or ``nccl`` (a context on the GPU).
        timeout: the store's, in seconds.
    """

    def __init__(self, run_id: str = "bench", backend: str = "gloo", timeout: float = 120.0) -> None:
        self.run_id = run_id
        self.backend = backend
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, 1, True, timeout=timedelta(seconds=timeout), use_libuv=True)
        self._generation = 0

    def env(self, state_dir: Path) -> dict[str, str]:
        self._generation += 1
        return torchrun_env(
            0,
            1,
            self.port,
            run_id=self.run_id,
            generation=self._generation,
            extra={
                "ELASTIC_EMB_STATE_DIR": str(state_dir),
                "ELASTIC_EMB_NODE_ID": NODE,
                "ELASTIC_EMB_BACKEND": self.backend,
            },
        )

    def node_dir(self, state_dir: Path) -> Path:
        """Where the lifecycle of ``state_dir`` writes this node's commits."""
        return state_dir / self.run_id / NODE

    def start(self, state_dir: Path, factory, app_state: Mapping | None = None) -> Lifecycle:
        """``Lifecycle.start`` with the default configuration over ``state_dir``."""
        return Lifecycle.start(
            factory, LifecycleConfig(), env=self.env(state_dir), store=self.store, app_state=app_state
        )


# -- an EmbContext with one table and row-wise Adagrad: the library's own context ---------------


def emb_factory(rows: int, dim: int, device: str | torch.device | None = None, timeout: float = 60.0):
    """The factory of an ``EmbContext`` holding one fp32 table ``t`` of ``rows`` x ``dim`` with
    row-wise Adagrad (seeded rows), on ``device`` (None: the context's default)."""
    spec = TableSpec(name=TABLE, num_rows=rows, dim=dim)

    def factory(topology, store):
        return EmbContext(
            topology,
            store,
            tables=[spec],
            optimizer=OptimizerSpec(kind="adagrad", lr=0.01),
            seed=0,
            device=device,
            timeout=timeout,
        )

    return factory


class EmbStep:
    """One step of the library's loop: ``ids`` random ids (duplicates allowed) looked up, then
    ``middle`` (the rest of the model: called with the looked-up rows, its result returned), then
    a gradient of 1e-3 per id applied (row-wise Adagrad). The same seed in every loop: the loops
    see the same ids."""

    def __init__(
        self,
        rows: int,
        ids: int,
        dim: int,
        device: str | torch.device = "cpu",
        seed: int = 1,
        middle: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self.rows, self.ids, self.device, self.middle = rows, ids, torch.device(device), middle
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.grads = torch.full((ids, dim), 1e-3, device=self.device)

    def __call__(self, lc: Lifecycle, step: int) -> Any:
        ids = torch.randint(0, self.rows, (self.ids,), generator=self.gen, device=self.device)
        looked = lc.context.lookup(TABLE, ids).wait(timeout=60)
        out = looked if self.middle is None else self.middle(looked)
        lc.context.apply_gradients(TABLE, ids, self.grads)
        return out


def look_up_every_row(chunk: int, table: str = TABLE) -> WarmFn:
    """A warm-up: every row of ``table`` looked up once, ``chunk`` ids at a time (the step's count,
    so the context's staging stays the size the steps need); the first lookup fills the
    context's lazily seeded rows, and the Adagrad slot was filled when the context was built."""

    def warm(lc: Lifecycle) -> None:
        ctx = lc.context
        n = ctx.tables[table].num_rows
        for lo in range(0, n, chunk):
            ids = torch.arange(lo, min(n, lo + chunk), device=ctx.device)
            ctx.lookup(table, ids).wait(timeout=60)

    return warm


# -- the loop --------------------------------------------------------------------------------


def row_sums(ctx) -> dict[str, float]:
    """Float64 sums of every row and slot of every table of ``ctx`` (its ``shard_views``), in
    pieces of :data:`SUM_ROWS` rows: the same values in the same order give the same sums."""
    out = {}
    for name, view in sorted(ctx.shard_views().items()):
        for what, t in [("weight", view.weight), *sorted(view.slots.items())]:
            acc = torch.zeros((), dtype=torch.float64, device=t.device)
            for piece in t.split(SUM_ROWS):
                acc += piece.sum(dtype=torch.float64)
            out[f"{name}.{what}"] = float(acc)
    return out


@dataclass
class Loop:
    """What one loop measured."""

    name: str
    commit: bool
    times_ms: list[float]
    drain_ms: float
    warm_s: float
    rss_after_warm: int | None
    last_step: int
    sums: dict[str, float] | None = None  # the rows after the loop (commit loops: for the restore's check)
    extra: dict[str, Any] = field(default_factory=dict)


def run_loop(
    world: OneRank,
    state_dir: Path,
    name: str,
    factory,
    step: StepFn,
    *,
    steps: int,
    commit: bool,
    warm: WarmFn | None = None,
    warm_steps: int = WARM_STEPS,
    app_state: Mapping | None = None,
    sync: Callable[[], None] = lambda: None,
) -> Loop:
    """Start a lifecycle over ``state_dir``, warm it (``warm``, then ``warm_steps`` steps without
    a commit), run ``steps`` timed steps (each ended by ``lc.commit(step)`` when ``commit``), wait
    for the commits in flight, close it.

    ``sync`` is called after the warm-up and after the drain (``torch.cuda.synchronize`` for a
    context on the GPU: the warm-up's work is not charged to the first step).
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    with FsPeak(state_dir) as fs:
        loop = _run_loop(world, state_dir, name, factory, step, steps, commit, warm, warm_steps, app_state, sync)
    loop.extra.update(state_fs_used_peak_bytes=fs.peak, peak_rss_bytes=peak_rss_bytes())
    return loop


def _run_loop(world, state_dir, name, factory, step, steps, commit, warm, warm_steps, app_state, sync) -> Loop:
    lc = world.start(state_dir, factory, app_state)
    try:
        t0 = time.perf_counter()
        if warm is not None:
            warm(lc)
        for s in range(warm_steps):
            step(lc, s)
        sync()
        warm_s = time.perf_counter() - t0
        rss = rss_bytes()
        times = []
        for s in range(warm_steps, warm_steps + steps):
            t0 = time.perf_counter()
            step(lc, s)
            if commit:
                lc.commit(s)
            times.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        lc.wait_commit()
        sync()
        drain_ms = (time.perf_counter() - t0) * 1e3
        sums = row_sums(lc.context) if commit else None
    finally:
        lc.close()
    return Loop(name, commit, times, drain_ms, warm_s, rss, warm_steps + steps - 1, sums, {"warm_steps": warm_steps})


def stats(times_ms: list[float]) -> dict[str, float | int]:
    """Mean, median, p99 (the value at rank ceil(0.99 n)), max and the first step (ms), and how
    many steps took more than 3x the median."""
    s = sorted(times_ms)
    med = statistics.median(s)
    return {
        "steps": len(s),
        "mean_ms": statistics.fmean(s),
        "median_ms": med,
        "p99_ms": s[min(len(s) - 1, -(-99 * len(s) // 100) - 1)],
        "max_ms": s[-1],
        "first_ms": times_ms[0],
        "max_over_median": s[-1] / med if med > 0 else None,
        "steps_over_3x_median": sum(t > 3 * med for t in s),
    }


def loop_report(loop: Loop, baseline: Loop | None = None) -> dict[str, Any]:
    """A loop's figures: :func:`stats`, the drain, the whole loop's time, the warm-up; against
    ``baseline`` the ratios of the means, medians and p99s."""
    out: dict[str, Any] = {
        **stats(loop.times_ms),
        "drain_ms": loop.drain_ms,
        "total_s": (sum(loop.times_ms) + loop.drain_ms) / 1e3,
        "warm_s": loop.warm_s,
        "rss_after_warm_bytes": loop.rss_after_warm,
        **loop.extra,
        "times_ms": [round(t, 3) for t in loop.times_ms],  # every timed step, in order
    }
    if baseline is not None:
        b = stats(baseline.times_ms)
        out["mean_over_baseline"] = out["mean_ms"] / b["mean_ms"]
        out["median_over_baseline"] = out["median_ms"] / b["median_ms"]
        out["p99_over_baseline"] = out["p99_ms"] / b["p99_ms"]
        out["total_over_baseline"] = out["total_s"] / ((sum(baseline.times_ms) + baseline.drain_ms) / 1e3)
    return out


# -- the restore and its references ----------------------------------------------------------


def chain_pieces(tier, step: int) -> tuple[list[tuple[Path, int, int]], str | None]:
    """The byte ranges ``(file, offset, bytes)`` a restore of this node's own copy of commit
    ``step`` reads, by the library's own rules: its chain as restore resolves it (a base written
    in place stands for the newest delta in it, whose predecessors it no longer needs), each
    commit's data, a mutable base's per-row hash file, and the commit's app state file.
    ``([], reason)`` when the node does not hold that chain whole."""
    from elastic_emb.state.delta import resolve_chains
    from elastic_emb.state.inplace import present
    from elastic_emb.state.manifest import commit_dirname

    chains, _ = resolve_chains(present([(p, m) for p, m in tier.manifests() if not m.replica]))
    tops = [chain for chain in chains.values() if chain[-1][1].step == step]
    if len(tops) != 1:
        return [], f"{len(tops)} chains for step {step} in {tier.node_dir}"
    pieces = []
    for path, m in tops[0]:
        pieces.append((path, m.segment_offset if m.segment else 0, m.data_bytes))
        if m.row_hashes:
            hashes = path.parent / m.row_hashes
            pieces.append((hashes, 0, hashes.stat().st_size))
    top = tops[0][-1][1]
    app = tier.node_dir / commit_dirname(top.step, top.fingerprint) / (top.app_file or "")
    if top.app_file and app.is_file():
        pieces.append((app, 0, app.stat().st_size))
    return pieces, None


def read_pieces(pieces: list[tuple[Path, int, int]], into: np.ndarray | None = None) -> dict[str, float | int]:
    """Read each ``(file, offset, bytes)`` once: into fresh memory (``into`` None: the first touch
    of that memory included, as a restore into a fresh arena pays it), or into ``into``, a buffer
    already touched and at least as large as the largest piece (the read alone). The seconds,
    bytes, pieces."""
    t0 = time.perf_counter()
    total = 0
    for path, offset, nbytes in pieces:
        buf = np.empty(nbytes, dtype=np.uint8) if into is None else into[:nbytes]
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(offset)
            got = 0
            while got < nbytes:
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: {nbytes} bytes expected from offset {offset}, the file ended after {got}")
                got += n
        total += got
        del view, buf
    return {"s": time.perf_counter() - t0, "bytes": total, "pieces": len(pieces)}


def dir_pieces(root: Path) -> list[tuple[Path, int, int]]:
    """Every file under ``root``, whole."""
    return [(p, 0, p.stat().st_size) for p in sorted(root.rglob("*")) if p.is_file()]


RESTORE_REPS = 3  # restores (each followed by the reads of its floors): medians, on a machine whose load drifts


def touch_and_free(nbytes: int) -> None:
    """Write ``nbytes`` of fresh memory, then free it: the next allocation of that size finds its
    pages in this machine's free lists. A VM that hands idle free memory back to its host (free
    page reporting) makes a later first touch cost far more than a bare-metal host's page zeroing
    (:func:`first_touch_probe`); touching and freeing just before a timed allocation takes that
    back out, for the restore and its floors alike."""
    if nbytes > 0:
        buf = np.empty(nbytes, dtype=np.uint8)
        buf.fill(0)
        del buf


def first_touch_probe(nbytes: int, idle_s: float = 5.0) -> dict[str, float]:
    """What a first touch of ``nbytes`` costs on this machine: into memory freed ``idle_s``
    seconds before (a VM may have handed it back to its host meanwhile) and into memory freed
    just before. Seconds each, and their ratio."""

    def fill() -> float:
        t0 = time.perf_counter()
        touch_and_free(nbytes)
        return time.perf_counter() - t0

    fill()
    time.sleep(idle_s)
    after_idle = fill()
    reused = fill()
    return {"bytes": nbytes, "idle_s": idle_s, "after_idle_s": after_idle, "reused_s": reused}


def restore_once(world: OneRank, state_dir: Path, factory, loop: Loop, app_state, sync) -> tuple[float, Any, list]:
    """One timed ``Lifecycle.start`` of fresh objects over ``loop``'s state, checked; its seconds,
    start event and the restored chain's pieces (or the reason they are not known)."""
    t0 = time.perf_counter()
    lc = world.start(state_dir, factory, app_state)
    try:
        sync()
        start_s = time.perf_counter() - t0
        got = row_sums(lc.context)
        if lc.step != loop.last_step or got != loop.sums:
            raise SystemExit(
                f"the restore from {state_dir} gave step {lc.step} and row sums {got}; the commit "
                f"loop {loop.name!r} ended at step {loop.last_step} with row sums {loop.sums}: the "
                f"restored rows are not the committed ones (a bug of the commit or restore path)"
            )
        return start_s, lc.events[0], chain_pieces(lc.snapshot, lc.step)
    finally:
        lc.close()


def restore(
    world: OneRank,
    state_dir: Path,
    factory,
    loop: Loop,
    *,
    app_state: Mapping | None = None,
    sync: Callable[[], None] = lambda: None,
    reps: int = RESTORE_REPS,
) -> dict[str, Any]:
    """``reps`` times: ``Lifecycle.start`` of fresh objects over the state ``loop`` committed,
    timed and checked against the rows ``loop`` left (SystemExit naming what differs), then its
    floors read: the chain into fresh memory, the chain into touched memory, the node directory
    into fresh memory; memory touched and freed, untimed, before the restore and each read into
    fresh memory (:func:`touch_and_free`). ``app_state`` is loaded by every restore.

    Returns:
        Medians over the repetitions (every value in ``reps``): ``restore_s`` (the whole
        ``Lifecycle.start``: agreement, the context built, the restore), the start event's
        phases (``restore_phase_s``: its restore alone), the reads, and ``restore_s``'s ratio to
        the reads' medians; the restored step and bytes.
    """
    if reps < 1:
        raise ValueError(f"reps={reps} must be >= 1")
    runs: dict[str, list[float]] = {
        k: [] for k in ("restore_s", "agreement_s", "construct_s", "restore_phase_s", "read_chain_s")
    }
    runs.update(read_chain_touched_s=[], read_node_dir_s=[])
    out: dict[str, Any] = {}
    node_dir = world.node_dir(state_dir)
    for _ in range(reps):
        prime = sum(n for _, _, n in dir_pieces(node_dir))  # at least the arena and the chain
        touch_and_free(prime)
        start_s, ev, (pieces, why) = restore_once(world, state_dir, factory, loop, app_state, sync)
        for key, value in (
            ("restore_s", start_s),
            ("agreement_s", ev.agreement_s),
            ("construct_s", ev.construct_s),
            ("restore_phase_s", ev.restore_s),
        ):
            runs[key].append(value)
        out.update(restored_step=ev.restored_step, bytes_local=ev.bytes_local, source_tiers=ev.source_tiers)
        if pieces:
            touch_and_free(prime)
            chain = read_pieces(pieces)
            runs["read_chain_s"].append(chain["s"])
            out.update(chain_bytes=chain["bytes"], chain_pieces=chain["pieces"])
            touched = np.zeros(max(n for _, _, n in pieces), dtype=np.uint8)  # written: every page resident
            runs["read_chain_touched_s"].append(read_pieces(pieces, into=touched)["s"])
            del touched
        else:
            out.update(chain_bytes=None, chain_pieces=None, chain_not_read=why)
        touch_and_free(prime)
        node = read_pieces(dir_pieces(node_dir))
        runs["read_node_dir_s"].append(node["s"])
        out.update(node_dir_bytes=node["bytes"], node_dir_files=node["pieces"])
    for key, values in runs.items():
        out[key] = statistics.median(values) if values else None
    for ref, key in (("read_chain_s", "restore_over_read_chain"), ("read_node_dir_s", "restore_over_read_node_dir")):
        out[key] = out["restore_s"] / out[ref] if out[ref] else None
    out["reps"] = {k: v for k, v in runs.items() if v}
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def baseline_and_commit(
    world: OneRank,
    root: Path,
    label: str,
    factory,
    make_step: Callable[[], StepFn],
    *,
    steps: int,
    warm: WarmFn | None = None,
    warm_steps: int = WARM_STEPS,
    restore_reps: int = RESTORE_REPS,
    sync: Callable[[], None] = lambda: None,
    progress: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, Any]:
    """The pair every commit bench reports, for one table: the baseline loop, then the commit
    loop (each with a fresh state directory under ``root`` and a fresh step from ``make_step``),
    then the restore from the commit loop's state; the state directories removed after.

    Returns:
        ``baseline`` and ``commit`` (:func:`loop_report`, the commit loop against the baseline)
        and ``restore`` (:func:`restore`).
    """
    dirs = {name: root / f"{name}-{label}" for name in ("baseline", "commit")}
    try:
        loops = {}
        for name in ("baseline", "commit"):
            loops[name] = run_loop(
                world,
                dirs[name],
                name,
                factory,
                make_step(),
                steps=steps,
                commit=name == "commit",
                warm=warm,
                warm_steps=warm_steps,
                sync=sync,
            )
            t, x = loops[name].times_ms, loops[name].extra
            progress(
                f"{label}: {name} loop done, mean {statistics.fmean(t):.1f} ms, max {max(t):.1f} ms; peak RSS "
                f"{x['peak_rss_bytes'] / 2**30:.1f} GiB, state filesystem used at most "
                f"{x['state_fs_used_peak_bytes'] / 2**30:.1f} GiB"
            )
        rest = restore(world, dirs["commit"], factory, loops["commit"], sync=sync, reps=restore_reps)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return {
        "baseline": loop_report(loops["baseline"]),
        "commit": loop_report(loops["commit"], loops["baseline"]),
        "restore": rest,
    }


STEP_COLUMNS = [
    ("loop", "loop"),
    ("mean_ms", "mean (ms)"),
    ("median_ms", "median (ms)"),
    ("p99_ms", "p99 (ms)"),
    ("max_ms", "max (ms)"),
    ("first_ms", "first (ms)"),
    ("max_over_median", "max / median"),
    ("mean_over_baseline", "mean / baseline"),
    ("drain_ms", "drain (ms)"),
]
RESTORE_COLUMNS = [
    ("restore_s", "restore (s)"),
    ("restore_phase_s", "of it the restore phase (s)"),
    ("read_chain_s", "read the chain once (s)"),
    ("read_chain_touched_s", "the same into touched memory (s)"),
    ("chain_mib", "chain (MiB)"),
    ("restore_over_read_chain", "restore / chain read"),
    ("read_node_dir_s", "read the node dir once (s)"),
    ("node_dir_mib", "node dir (MiB)"),
    ("restore_over_read_node_dir", "restore / node dir read"),
]


def print_run(results: list[dict], key: tuple[str, str]) -> None:
    """Print the run's two tables: step times per loop, and the restore with its floors; one
    row per result (``key``: the result's field that tells them apart, and its heading)."""
    from _report import table

    print("\nThe run: step times over every step of each loop (the commit loop's first commit is a base)")
    rows = [{key[0]: r[key[0]], "loop": loop, **r[loop]} for r in results for loop in ("baseline", "commit")]
    print(table(rows, [key, *STEP_COLUMNS]))
    print(
        "\nThe restore: Lifecycle.start of fresh objects from the commit loop's last commit, and its floors "
        "(medians of the repetitions, each restore followed by its reads)"
    )
    rows = [
        {
            key[0]: r[key[0]],
            **r["restore"],
            "chain_mib": mib(r["restore"]["chain_bytes"]),
            "node_dir_mib": mib(r["restore"]["node_dir_bytes"]),
        }
        for r in results
    ]
    print(table(rows, [key, *RESTORE_COLUMNS]))


def warm_note(rows_touched: str, warm_steps: int = WARM_STEPS) -> str:
    """What the output says of the warm-up: ``rows_touched`` (how every row was touched), then
    the untimed steps."""
    return (
        f"before each loop's clock starts: {rows_touched}; then {warm_steps} steps without a commit (the "
        f"process's one-off costs); so no timed step pays a first touch of the rows"
    )


def mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def table_bytes(rows: int, dim: int) -> int:
    """Bytes of an fp32 table with its row-wise Adagrad slot (one fp32 per row)."""
    return rows * (dim * 4 + 4)


def check_memory(need: int, what: str, flag: str) -> None:
    """SystemExit when less than ``need`` bytes of memory are available, naming ``what`` and the
    flag that makes it smaller: a run that does not fit would end in the OOM killer."""
    have = available_bytes()
    if have is not None and have < need:
        raise SystemExit(
            f"{what} needs about {need / 2**30:.1f} GiB of memory; {have / 2**30:.1f} GiB is "
            f"available: pass a smaller {flag}, or free memory"
        )


def env_summary() -> dict[str, Any]:
    """What of this process's set-up changes the figures: torch's threads, OMP_NUM_THREADS."""
    return {"torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
