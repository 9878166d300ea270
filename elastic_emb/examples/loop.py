"""The drills' side of the examples' training loop: hooks and options around ``run_elastic``.

- :class:`DrillHooks`: the :class:`~elastic_emb.LoopHooks` the drills need: progress lines,
  pacing, per-step checksums and the final rows, which the drills' report and replay read;
- :func:`loop_parser`: the examples' command-line options;
- :class:`Progress`, :func:`write_final`, :func:`shard_checksums`: what the hooks write.

The loop itself is the public :func:`~elastic_emb.run_elastic`. Design: ``docs/DRILLS.md``
(section "The examples' loop").
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

from elastic_emb import LoopHooks, load_settings


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


def write_final(lc, cfg, out: Path, extra: dict | None = None) -> Path:
    """Write this rank's rows of every table, with the committed step they reflect, atomically.

    Args:
        lc: the lifecycle (its context's shards and topology, its step).
        cfg: the workload's config dataclass, written alongside.
        out: the run's output directory; the file goes under ``final/``.
        extra: more keys of the file (the recsys example: its replicated state and its dataset).

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
            **(extra or {}),
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
    p.add_argument(
        "--steps",
        type=_int_in(1, 2**40),
        default=100,
        help="Train steps 0..steps-1 (global count, across restarts).",
    )
    p.add_argument("--out", type=Path, required=True, help="Directory for progress lines and the final tables.")
    p.add_argument("--step-delay", type=_seconds, default=0.0, help="Seconds to sleep per step (paces drills).")
    p.add_argument(
        "--slow-file",
        type=Path,
        default=None,
        help="While this file exists, sleep --slow-delay per step instead (drills slow training down "
        "while a resize is in flight, so a short run cannot end before it lands).",
    )
    p.add_argument("--slow-delay", type=_seconds, default=0.25)
    p.add_argument(
        "--checksums", action="store_true", help="Add per-table CRC32s of this rank's rows to each step line."
    )
    p.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=120.0,
        help="Seconds to wait for the agent's restart when draining.",
    )
    for field, default in asdict(cfg).items():
        lo, hi = _CONFIG_RANGES.get(field, (1, 2**31 - 1))  # sizes and counts: at least one
        p.add_argument("--" + field.replace("_", "-"), type=_int_in(lo, hi), default=default)
    return p


# The workload options that are not sizes: their ranges (every other option is a size, >= 1).
_CONFIG_RANGES = {"seed": (0, 2**63 - 1), "lr_log2": (-40, 0), "dense_lr_log2": (-40, 0)}


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[lo, hi]``, else a one-line usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: finite seconds in ``[0, 86400]``, else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value <= 86400.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 86400] seconds")
    return value


class DrillHooks(LoopHooks):
    """The drills' hooks: one progress line per event, pacing, checksums, and the final rows.

    The step function may add keys to the step's progress line through :attr:`fields` (the
    recsys example adds ``lookup_crc``, ``samples_crc`` and ``dense_crc``, the TorchRec example
    ``dense_crc``); they are written with the line and then cleared.

    Args:
        args: an ``argparse.Namespace`` of :func:`loop_parser`'s options (``out``,
            ``step_delay``, ``slow_file``, ``slow_delay``, ``checksums``).
        cfg: the workload's config dataclass, written into the final rows.
        on_first_start: called with the context when no commit exists yet (a fresh job), before
            the ``start`` line.
        final_extra: called with the lifecycle at the end; its keys go into the final file
            (:func:`write_final`).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        cfg,
        *,
        on_first_start: Callable[[object], None] | None = None,
        final_extra: Callable[[object], dict] | None = None,
    ):
        self.args = args
        self.cfg = cfg
        self.progress = Progress(args.out)
        self.on_first_start = on_first_start
        self.final_extra = final_extra
        self.fields: dict = {}
        self.last_step_t = time.time()

    def on_start(self, lc, *, seconds: float) -> None:
        """Write the initial values on a fresh job, then the ``start`` line.

        Args:
            lc: the started lifecycle.
            seconds: seconds the start took.
        """
        if lc.step == -1 and self.on_first_start is not None:
            self.on_first_start(lc.context)
        t = lc.topology
        self.progress.write(
            "start",
            rank=t.rank,
            world=t.world_size,
            generation=t.generation,
            restored_step=lc.step,
            start_seconds=seconds,
            restore=record(lc.events[-1] if lc.events else None),
        )

    def after_step(self, lc, step: int, loss: float | None, *, seconds: float, report) -> None:
        """Write the ``step`` line: loss, commit report, newest complete commit, checksums.

        Args:
            lc: the lifecycle.
            step: the step.
            loss: the step's loss.
            seconds: seconds the step and its commit took.
            report: the commit's report, or None.
        """
        self.last_step_t = time.time()
        t = lc.topology
        fields, self.fields = self.fields, {}
        self.progress.write(
            "step",
            step=step,
            rank=t.rank,
            world=t.world_size,
            generation=t.generation,
            loss=None if loss is None else round(loss, 6),
            seconds=seconds,
            commit=record(report),
            committed=lc.committed_step,  # complete; the step's own commit may be in flight
            crc=shard_checksums(lc.context) if self.args.checksums else None,
            **fields,
        )

    def pace(self, lc, step: int, wake: Callable[[], bool]) -> None:
        """Sleep ``--step-delay`` (``--slow-delay`` while ``--slow-file`` exists), in slices.

        A drill slows training down while a resize is in flight, so that a short run cannot end
        first; the sleep ends once ``wake()`` says a re-form or a drain is due, so the pause a
        drill reports is the re-form's, not the pacing's. It comes after the step's line, so a
        SIGTERM during it loses no record.

        Args:
            lc: the lifecycle.
            step: the step just committed.
            wake: the loop's reason to go on.
        """
        a = self.args
        delay = a.slow_delay if a.slow_file and a.slow_file.exists() else a.step_delay
        deadline = time.monotonic() + delay
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))
            if wake():
                return

    def on_step_failed(self, lc, step: int, error: BaseException) -> None:
        """Write a ``peer_lost`` line.

        Args:
            lc: the lifecycle.
            step: the step that failed.
            error: its error.
        """
        self.fields = {}
        self.progress.write(
            "peer_lost", step=step, rank=lc.topology.rank, error=f"{type(error).__name__}: {error}"[:300]
        )

    def on_resize(self, lc, event, *, failed: bool) -> None:
        """Write a ``resized`` line: the new world, the restored step, the re-form's report.

        Args:
            lc: the lifecycle in its new generation.
            event: the re-form's report.
            failed: the re-form followed a failed step.
        """
        t = lc.topology
        self.progress.write(
            "resized",
            mode="in_process",
            rank=t.rank,
            world=t.world_size,
            generation=t.generation,
            restored_step=lc.step,
            failed=failed,
            seconds=event.total_s,
            last_step_t=self.last_step_t,
            restore=record(event),
        )

    def on_stop(self, lc, reason: str, step: int) -> None:
        """Write why the worker stops early: ``draining``, ``resize_fallback`` or
        ``job_complete_before_join`` (a membership change already wrote ``peer_lost``).

        Args:
            lc: the lifecycle, or None for a joiner that never started.
            reason: the loop's reason (``LoopHooks.on_stop``).
            step: the newest step taken.
        """
        rank = lc.topology.rank if lc is not None else None
        if reason == "drain":
            self.progress.write("draining", step=step, rank=rank)
        elif reason == "fallback":
            self.progress.write("resize_fallback", step=step, rank=rank)
        elif reason == "job_complete":
            self.progress.write("job_complete_before_join", reason="the job finished before this node could join it")

    def on_finish(self, lc) -> None:
        """Write this rank's final rows (:func:`write_final`) and the ``final`` line.

        Args:
            lc: the lifecycle, in the world that ran the last step.
        """
        t = lc.topology
        extra = self.final_extra(lc) if self.final_extra is not None else None
        path = write_final(lc, self.cfg, self.args.out, extra)
        self.progress.write(
            "final", step=lc.step, rank=t.rank, world=t.world_size, generation=t.generation, path=str(path)
        )
