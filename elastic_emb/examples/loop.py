"""The elastic training loop the examples share: start, step, commit, and stop stepping to drain.

- :func:`run_elastic`: the loop a user writes; the two workloads (:mod:`~elastic_emb.examples.recsys`,
  :mod:`~elastic_emb.examples.dlrm`) differ only in the context factory and the step;
- :func:`loop_parser`: its command-line options;
- :class:`Progress`, :func:`write_final`, :func:`shard_checksums`: the progress lines and the final
  rows that the drills' report and replay read.

Design: ``docs/DRILLS.md`` (section "The examples' loop").
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
commit, so that on a GPU the commit's host work overlaps the step's (``docs/TRAINING.md``)."""


class Progress:
    """Per-process JSON lines (``<out>/events/<node>-<pid>.jsonl``): what the drill's report reads.

    The node is ``ELASTIC_EMB_NODE_ID`` (a drill names its simulated nodes), else ``node``.

    Args:
        out: the run's output directory.
    """

    def __init__(self, out: Path) -> None:
        # The drill names its simulated nodes; otherwise the node id the rendezvous backend gives.
        node = load_settings(None, "node_id").node_id or "node"
        (out / "events").mkdir(parents=True, exist_ok=True)
        self.file = open(out / "events" / f"{node}-{os.getpid()}.jsonl", "a", buffering=1)
        self.node = node

    def write(self, event: str, **fields) -> None:
        """Append one line: the event, the time, the node and the pid, and ``fields``.

        Args:
            event: the event's name (``start``, ``step``, ``resized``, ``final``, ...).
            fields: more keys of the line (values that JSON cannot hold are written as strings).
        """
        self.file.write(
            json.dumps({"event": event, "t": time.time(), "node": self.node, "pid": os.getpid(), **fields}, default=str)
            + "\n"
        )


def record(obj) -> dict:
    """A lifecycle report as JSON-able data.

    Args:
        obj: a pydantic record, a dataclass, a dict, None, or anything else.

    Returns:
        Its fields; ``{}`` for None; ``{"value": str(obj)}`` for anything else.
    """
    if obj is None:
        return {}
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return dict(obj) if isinstance(obj, dict) else {"value": str(obj)}


def write_final(lc, cfg, out: Path) -> Path:
    """Write this rank's rows of every table, with the committed step they reflect, atomically.

    Args:
        lc: the lifecycle (its context's shards and topology, its step).
        cfg: the workload's config dataclass, written alongside.
        out: the run's output directory; the file goes under ``final/``.

    Returns:
        The file written (``final/gen<G>-w<W>-r<R>-<pid>.pt``).
    """
    topo = lc.context.topology
    shards = {
        name: {
            "start": s.rows.start,
            "stop": s.rows.stop,
            "num_rows": lc.context.tables[name].num_rows,
            "weight": s.weight.detach().cpu().clone(),
        }
        for name, s in lc.context.export_shard().items()
    }
    (out / "final").mkdir(parents=True, exist_ok=True)
    path = out / "final" / f"gen{topo.generation}-w{topo.world_size}-r{topo.rank}-{os.getpid()}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": lc.step,
            "generation": topo.generation,
            "world_size": topo.world_size,
            "rank": topo.rank,
            "config": asdict(cfg),
            "time": time.time(),
            "shards": shards,
        },
        tmp,
    )
    os.replace(tmp, path)
    return path


def shard_checksums(ctx) -> dict:
    """CRC32 of this rank's rows of each table.

    Written with every step's progress line (``--checksums``), so a run that diverges from the
    reference replay is traced to the first step, table and row range where it did.

    Args:
        ctx: the context.

    Returns:
        ``{table: [start, stop, crc32]}`` (crc32 0 for a rank without rows).
    """
    out = {}
    for name, s in ctx.export_shard().items():
        w = s.weight.detach().cpu().contiguous()
        out[name] = [s.rows.start, s.rows.stop, zlib.crc32(w.view(torch.uint8).numpy()) if w.numel() else 0]
    return out


def loop_parser(description: str, cfg) -> argparse.ArgumentParser:
    """The loop's command-line options, plus one integer option per field of the workload's config.

    Args:
        description: the parser's description.
        cfg: an instance of the workload's config dataclass; its values are the options' defaults.

    Returns:
        The parser.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="Train steps 0..steps-1 (global count, across restarts).")
    p.add_argument("--out", type=Path, required=True, help="Directory for progress lines and the final tables.")
    p.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (paces drills).")
    p.add_argument(
        "--slow-file",
        type=Path,
        default=None,
        help="While this file exists, sleep --slow-delay per step instead (drills slow training down "
        "while a resize is in flight, so a short run cannot end before it lands).",
    )
    p.add_argument("--slow-delay", type=float, default=0.25)
    p.add_argument(
        "--checksums", action="store_true", help="Add per-table CRC32s of this rank's rows to each step line."
    )
    p.add_argument(
        "--drain-timeout", type=float, default=120.0, help="Seconds to wait for the agent's restart when draining."
    )
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


def run_elastic(
    factory, step_fn: StepFn, args: argparse.Namespace, cfg, *, on_first_start: Callable[[object], None] | None = None
) -> int:
    """Train steps ``lc.next_step .. args.steps - 1`` elastically, committing each step.

    Starts (or, on a joining node in process, joins), steps and commits, re-forms in process or
    waits for the agent's restart when the world changes, and writes the final rows at the end.
    The steps are in ``docs/DRILLS.md`` (section "The examples' loop").

    Args:
        factory: builds the context for an agreed topology (``Lifecycle.start``'s factory).
        step_fn: one step (:data:`StepFn`).
        args: an ``argparse.Namespace`` of :func:`loop_parser`'s options: ``steps``, ``out``,
            ``step_delay``, ``slow_file``, ``slow_delay``, ``checksums``, ``drain_timeout``.
        cfg: the workload's config dataclass (written into the final rows).
        on_first_start: called with the context when no commit exists yet (a fresh job).

    Returns:
        The process exit code: 0 when done, drained or restarted for a new world, or when the job
        completed before a joiner was included; 3 when the agent did not restart the worker within
        ``args.drain_timeout``.

    Raises:
        Exception: a step's failure that no membership change explains, re-raised (restart mode),
            or the re-form's ``ElasticEmbError`` when no departure explains it (in process).
    """
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
        store = (
            interruptible_store(worker_store(Topology.from_env(), timeout=lc_config.agree_timeout), watcher)
            if in_process
            else None
        )
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
        progress.write(
            "resized",
            mode="in_process",
            rank=t.rank,
            world=t.world_size,
            generation=t.generation,
            restored_step=lc.step,
            failed=failed,
            seconds=event.total_s,
            last_step_t=t_last,
            restore=record(event),
        )
        return t

    last_step_t = [time.time()]
    try:
        topo = lc.topology
        bind_topology(topo)
        if lc.step == -1 and on_first_start is not None:
            on_first_start(lc.context)
        progress.write(
            "start",
            rank=topo.rank,
            world=topo.world_size,
            generation=topo.generation,
            restored_step=lc.step,
            start_seconds=time.time() - started,
            restore=record(lc.events[-1] if lc.events else None),
        )
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
            progress.write(
                "step",
                step=step,
                rank=topo.rank,
                world=topo.world_size,
                generation=topo.generation,
                loss=round(float(loss), 6),
                seconds=time.time() - t0,
                commit=record(report),
                committed=lc.committed_step,  # complete; the step's own commit may be in flight
                crc=shard_checksums(lc.context) if args.checksums else None,
                **fields,
            )
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
        progress.write(
            "final", step=lc.step, rank=topo.rank, world=topo.world_size, generation=topo.generation, path=str(path)
        )
        log.info("training_done", step=lc.step, final=str(path))
        return 0
    finally:
        lc.close()
        if watcher is not None:
            watcher.stop()
