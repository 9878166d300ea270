"""The elastic training loop the examples share: start, step, commit, and stop stepping to drain.

Both workloads (:mod:`elastic_emb.examples.recsys` over an ``EmbContext``,
:mod:`elastic_emb.examples.dlrm` over a TorchRec model) run the same loop, :func:`run_elastic`;
they differ only in the context factory and the step. It is the loop a user writes:

1. ``Lifecycle.start`` agrees on the topology, builds the context and restores the newest commit
   (resharded when the world size changed); the watcher, when the job runs under
   ``--rdzv-backend=elastic_emb``, reports membership changes while the loop steps.
2. Each step runs and is committed (``Lifecycle.commit``). A step that fails because a peer went
   away commits nothing: when the watcher confirms a membership change, the worker waits for the
   agent's restart into the new world (free of ``--max-restarts``) instead of failing.
3. When the lifecycle says the job is draining for a restart (a node waits to join), the worker
   stops stepping and waits, bounded, for the agent's SIGTERM: everything up to the last step is
   committed.
4. With ``--rdzv-conf resize=in_process`` (:mod:`elastic_emb.inprocess.resize`) the worker re-forms in its
   own process instead: at each step boundary ``resize.pending()`` says a member left or a
   joiner is ready, and a step that failed because a peer died re-forms at once; a worker of a
   joining node waits to be included (``InProcessResize.join``). After a re-form the world's
   rank and size are ``lc.topology``: torchrun's ``RANK``/``WORLD_SIZE`` still name the first
   generation (this loop reads nothing else).

Every event goes to a per-process JSON-lines file (:class:`Progress`) that the drills' report and
replay read; at the end each rank writes its rows (:func:`write_final`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from elastic_emb import load_settings

StepFn = Callable[[object, int, dict], "float | torch.Tensor"]
"""``step(context, step, fields) -> loss``: one training step; ``fields`` takes extra keys for
the step's progress line. The loss may be a one-element tensor: it is read after the step's
commit, so that on a GPU the commit's host work overlaps the step's (README, commits)."""


class Progress:
    """Per-process JSON lines (``<out>/events/<node>-<pid>.jsonl``): what the drill's report reads."""

    def __init__(self, out: Path) -> None:
        # The drill names its simulated nodes; otherwise the node id the rendezvous backend gives.
        node = load_settings(None, "node_id").node_id or "node"
        (out / "events").mkdir(parents=True, exist_ok=True)
        self.file = open(out / "events" / f"{node}-{os.getpid()}.jsonl", "a", buffering=1)
        self.node = node

    def write(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "t": time.time(), "node": self.node, "pid": os.getpid(), **fields}, default=str) + "\n")


def record(obj) -> dict:
    """A lifecycle report (pydantic record, dataclass or dict) as JSON-able data."""
    if obj is None:
        return {}
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return dict(obj) if isinstance(obj, dict) else {"value": str(obj)}


def write_final(lc, cfg, out: Path) -> Path:
    """This rank's rows of every table, with the committed step they reflect (``cfg``: the
    workload's config dataclass, written alongside)."""
    topo = lc.context.topology
    shards = {
        name: {"start": s.rows.start, "stop": s.rows.stop, "num_rows": lc.context.tables[name].num_rows,
               "weight": s.weight.detach().cpu().clone()}
        for name, s in lc.context.export_shard().items()
    }
    (out / "final").mkdir(parents=True, exist_ok=True)
    path = out / "final" / f"gen{topo.generation}-w{topo.world_size}-r{topo.rank}-{os.getpid()}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": lc.step, "generation": topo.generation, "world_size": topo.world_size, "rank": topo.rank,
                "config": asdict(cfg), "time": time.time(), "shards": shards}, tmp)
    os.replace(tmp, path)
    return path


def shard_checksums(ctx) -> dict:
    """CRC32 of this rank's rows of each table: ``{table: [start, stop, crc32]}``.

    Written with every step's progress line (``--checksums``), so a run that diverges from the
    reference replay is traced to the first step, table and row range where it did."""
    out = {}
    for name, s in ctx.export_shard().items():
        w = s.weight.detach().cpu().contiguous()
        out[name] = [s.rows.start, s.rows.stop, zlib.crc32(w.view(torch.uint8).numpy()) if w.numel() else 0]
    return out


def loop_parser(description: str, cfg) -> argparse.ArgumentParser:
    """The loop's command-line options, plus one integer option per field of the workload's
    config dataclass ``cfg`` (its defaults)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="Train steps 0..steps-1 (global count, across restarts).")
    p.add_argument("--out", type=Path, required=True, help="Directory for progress lines and the final tables.")
    p.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (paces drills).")
    p.add_argument("--slow-file", type=Path, default=None,
                   help="While this file exists, sleep --slow-delay per step instead (drills slow training down "
                        "while a resize is in flight, so a short run cannot end before it lands).")
    p.add_argument("--slow-delay", type=float, default=0.25)
    p.add_argument("--checksums", action="store_true", help="Add per-table CRC32s of this rank's rows to each step line.")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="Seconds to wait for the agent's restart when draining.")
    for field, default in asdict(cfg).items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=default)
    return p


def _wait_for_sigterm(timeout: float) -> bool:
    """Block until SIGTERM (True) or ``timeout`` seconds (False): a joiner that was not included
    waits for the agents' restart-mode round."""
    import signal
    import threading

    got = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: got.set())
    return got.wait(timeout)


def _pace(delay: float, resize) -> None:
    """Drill pacing: sleep ``delay`` after a step, in slices, and stop early once this world has a
    reason to re-form (a departure this worker saw, or a join plan: ``InProcessResize``). A drill
    slows training down while a resize is in flight, so that a short run cannot end first; the
    re-form itself must not wait for the rest of a slowed step, or the pause a drill reports would
    be the pacing, not the re-form."""
    deadline = time.monotonic() + delay
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))
        if resize is not None and (resize.departure_seen() or resize.join_due()):
            return


def run_elastic(factory, step_fn: StepFn, args: argparse.Namespace, cfg, *,
                on_first_start: Callable[[object], None] | None = None) -> int:
    """Train steps ``lc.next_step .. args.steps - 1`` elastically (see the module docstring).

    Args:
        factory: builds the context for an agreed topology (``Lifecycle.start``'s factory).
        step_fn: one step (:data:`StepFn`).
        args: the options of :func:`loop_parser`.
        cfg: the workload's config dataclass (written into the final rows).
        on_first_start: called with the context when no commit exists yet (a fresh job).

    Returns the process exit code: 0 when done, or drained / restarted for a new world; 3 when
    the agent did not restart the worker within ``args.drain_timeout``."""
    from elastic_emb import (
        InProcessResize,
        JobComplete,
        Lifecycle,
        LifecycleConfig,
        ResizeFallback,
        Topology,
        Watcher,
        bind_topology,
        get_logger,
        interruptible_store,
        worker_store,
    )

    log = get_logger()
    progress = Progress(args.out)
    watcher = Watcher.from_env()
    if watcher is not None:
        watcher.start()
    started = time.time()
    lc_config = LifecycleConfig()
    in_process = watcher is not None and load_settings(None, "resize").resize == "in_process"
    if in_process and load_settings(None, "joiner").joiner:
        try:  # this node joined a running world: wait (bounded) to be included, then start with it
            lc, resize = InProcessResize.join(factory, lc_config, watcher, timeout=args.drain_timeout)
        except JobComplete as exc:  # the world finished first: nothing to join, nothing lost
            progress.write("job_complete_before_join", reason=str(exc)[:300])
            watcher.stop()
            return 0
        except ResizeFallback:
            return 0 if _wait_for_sigterm(args.drain_timeout) else 3  # the agents restart everyone
    else:
        store = interruptible_store(worker_store(Topology.from_env(), timeout=lc_config.agree_timeout), watcher) \
            if in_process else None
        lc = Lifecycle.start(factory, lc_config, watcher=watcher, store=store)
        resize = InProcessResize(lc, watcher) if in_process else None

    def reform(step: int, failed: bool):
        """Re-form in this process; None when it fell back to the agents' restart."""
        t_last = last_step_t[0]
        try:
            event = resize.run(failed=failed)
        except ResizeFallback:
            progress.write("resize_fallback", step=step, rank=lc.topology.rank)
            return None
        t = lc.topology
        bind_topology(t)
        progress.write("resized", mode="in_process", rank=t.rank, world=t.world_size, generation=t.generation,
                       restored_step=lc.step, failed=failed, seconds=event.total_s, last_step_t=t_last,
                       restore=record(event))
        return t

    last_step_t = [time.time()]
    try:
        topo = lc.topology
        bind_topology(topo)
        if lc.step == -1 and on_first_start is not None:
            on_first_start(lc.context)
        progress.write("start", rank=topo.rank, world=topo.world_size, generation=topo.generation,
                       restored_step=lc.step, start_seconds=time.time() - started,
                       restore=record(lc.events[-1] if lc.events else None))
        while lc.next_step < args.steps:
            step = lc.next_step
            if resize is not None and resize.pending():
                topo = reform(step, failed=False)
                if topo is None:
                    return 0 if lc.wait_for_restart(args.drain_timeout) else 3
                continue
            t0 = time.time()
            fields: dict = {}
            try:
                loss = step_fn(lc.context, step, fields)
                if resize is not None:  # in process, a commit whose peer died re-forms too
                    report = lc.commit(step)
            except Exception as exc:
                if resize is not None:  # a peer died mid-step: re-form now (raises if nobody left)
                    progress.write("peer_lost", step=step, rank=topo.rank, error=f"{type(exc).__name__}: {exc}"[:300])
                    topo = reform(step, failed=True)
                    if topo is None:
                        return 0 if lc.wait_for_restart(args.drain_timeout) else 3
                    continue
                # A peer died mid-step. If a membership change explains it, the agent is about to
                # restart us into a new world (free of --max-restarts): wait for its SIGTERM rather
                # than exit with a failure. Nothing of this step was committed; it will be redone.
                if watcher is not None and watcher.membership_change_pending(timeout=2.0):
                    progress.write("peer_lost", step=step, rank=topo.rank, error=f"{type(exc).__name__}: {exc}"[:300])
                    log.warning("step_failed_membership_changed", step=step, error=type(exc).__name__)
                    return 0 if lc.wait_for_restart(args.drain_timeout) else 3
                raise
            if resize is None:
                report = lc.commit(step)
            last_step_t[0] = time.time()
            progress.write("step", step=step, rank=topo.rank, world=topo.world_size, generation=topo.generation,
                           loss=round(float(loss), 6), seconds=time.time() - t0, commit=record(report),
                           committed=lc.committed_step,  # complete; the step's own commit may be in flight
                           crc=shard_checksums(lc.context) if args.checksums else None, **fields)
            # Pacing for drills, after the progress line: a SIGTERM during the sleep loses no record.
            delay = args.slow_delay if args.slow_file and args.slow_file.exists() else args.step_delay
            if delay and not lc.draining:
                _pace(delay, resize)
            if lc.draining:
                # The agent is about to restart us for a new world: everything up to `step` is
                # committed; stop stepping and wait (bounded) for its SIGTERM.
                progress.write("draining", step=step, rank=topo.rank)
                if lc.wait_for_restart(args.drain_timeout):
                    log.info("drained_for_restart", step=step)
                    return 0
                log.error("drain_not_restarted", step=step, timeout=args.drain_timeout)
                return 3
        if resize is not None and (resize.departure_seen() or resize.join_due()):
            # A joiner became ready just before the last step: include it now, so that the world
            # that writes the final tables is the one the joiner's agent is part of.
            topo = reform(lc.step + 1, failed=False)
            if topo is None:
                return 0 if lc.wait_for_restart(args.drain_timeout) else 3
        path = write_final(lc, cfg, args.out)
        progress.write("final", step=lc.step, rank=topo.rank, world=topo.world_size, generation=topo.generation,
                       path=str(path))
        log.info("training_done", step=lc.step, final=str(path))
        return 0
    finally:
        lc.close()
        if watcher is not None:
            watcher.stop()
