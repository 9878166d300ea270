"""Rank processes on loopback for tests and benchmarks: start them, wait for them, read their output.

:func:`torchrun_env` is the environment torchrun would give one rank. :func:`run_ranks` runs one
Python source per rank and returns a :class:`Result` per rank (a rank past the deadline is
killed). :func:`collect` waits for rank processes a caller started and parses each one's last
stdout line as JSON; when one fails or overruns, every rank is killed (the others would wait for
it in a collective until their own timeout). Nothing is mocked: the ranks meet on a real
TCPStore and real process groups.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The directory the elastic_emb package was imported from (a checkout's root): first on every
# rank's PYTHONPATH, so a rank imports the same elastic_emb (and, in a checkout, ``tests``).
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Variables of the caller's own launch that must not leak into a rank's environment.
_LAUNCH_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC_", "ELASTIC_EMB_")


@dataclass
class Result:
    """What one rank process left: its exit status, its output and when it ended.

    Args:
        rank: the rank (the process's place in the list it was started from).
        returncode: the exit status (negative: killed by that signal).
        stdout: everything it printed.
        stderr: everything it wrote to stderr (with a note when it was killed at the deadline).
        elapsed: seconds from the start of the ranks to this one's end.
    """

    rank: int
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def value(self):
        """The JSON of the last stdout line that parses as JSON (AssertionError if none does)."""
        for line in reversed(self.stdout.strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
        raise AssertionError(f"rank {self.rank} printed no JSON (rc={self.returncode}); stderr:\n{self.stderr[-3000:]}")


def torchrun_env(
    rank: int,
    world_size: int,
    port: int,
    *,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    run_id: str = "test",
    generation: int = 0,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun would give ``rank``, on loopback, without the caller's own
    torchrun or elastic_emb variables.

    Args:
        rank: the global rank.
        world_size: the number of ranks.
        port: the TCPStore's port (``MASTER_PORT``).
        local_world_size: ranks per node; default all of them on one node (1: each rank its own node).
        node_rank: this rank's node; default ``rank // local_world_size``.
        num_nodes: the number of nodes; default ``world_size // local_world_size``.
        run_id: ``TORCHELASTIC_RUN_ID``.
        generation: ``ELASTIC_EMB_GENERATION``.
        extra: variables set last, over everything above.

    Returns:
        The whole environment: the caller's, less its launch variables, plus the rank's
        (gloo backend, one OMP thread, JSON logs, :data:`SOURCE_ROOT` first on ``PYTHONPATH``).
    """
    lws = local_world_size or world_size
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % lws),
        LOCAL_WORLD_SIZE=str(lws),
        GROUP_RANK=str(rank // lws if node_rank is None else node_rank),
        GROUP_WORLD_SIZE=str(num_nodes or max(1, world_size // lws)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        ELASTIC_EMB_GENERATION=str(generation),
        ELASTIC_EMB_BACKEND="gloo",
        TORCHELASTIC_USE_AGENT_STORE="False",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (SOURCE_ROOT, os.environ.get("PYTHONPATH", "")) if p),
        ELASTIC_EMB_LOG_FORMAT="json",
    )
    env.update(extra or {})
    return env


def start(argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start one process with its stdout and stderr piped as text (what :func:`collect` reads).

    Args:
        argv: the command; a first element of ``"python"`` runs this interpreter.
        env: its whole environment (e.g. :func:`torchrun_env`); default the caller's.

    Returns:
        The started process.
    """
    argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(argv)]
    return subprocess.Popen(
        argv, env=None if env is None else dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_ranks(code: str, envs: Sequence[Mapping[str, str]], timeout: float = 60.0) -> list[Result]:
    """Run ``code`` (Python source) in one process per environment and wait for all of them.

    Args:
        code: the source each rank runs (``python -c``); its last JSON line is :attr:`Result.value`.
        envs: one environment per rank, in rank order.
        timeout: seconds for all ranks together; a rank still running then is killed.

    Returns:
        One :class:`Result` per rank, in rank order.
    """
    t0 = time.monotonic()
    procs = [start(["python", "-c", code], env) for env in envs]
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(0.1, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n[procs] rank {rank} killed after the {timeout}s timeout"
        results.append(Result(rank, p.returncode, out, err, time.monotonic() - t0))
    return results


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """Kill every process of ``procs`` still running and reap it.

    Args:
        procs: processes started by the caller (e.g. with :func:`start`).
    """
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Kill every process still running and reap it; its reader thread (:func:`collect`) drains
    its pipes, so nothing here reads them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def collect(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> list[dict]:
    """Each rank's result, the last line it printed, parsed as JSON, within one deadline.

    Every rank's output is read at once (one thread each), so the rank that fails first is the one
    reported: a rank that dies leaves the others waiting in a collective until their own timeout,
    and reporting them instead would name a waiter, not the cause.

    Args:
        procs: the rank processes, in rank order, their stdout and stderr piped as text.
        timeout: seconds for all of them together.
        what: names the run in the error (e.g. ``"world 2"``).

    Returns:
        The parsed last stdout line of every rank, in rank order.

    Raises:
        RuntimeError: a rank exited non-zero, printed nothing, or did not finish in time; every
            rank is killed first, and the message carries the first failed rank's stderr tail.
    """
    ended: queue.Queue[tuple[int, str, str]] = queue.Queue()

    def read(rank: int, p: subprocess.Popen) -> None:
        try:
            so, se = p.communicate()
        except (ValueError, OSError) as exc:  # its pipes closed under it: report it as failed
            so, se = "", f"its output could not be read: {exc}"
        ended.put((rank, so or "", se or ""))

    for rank, p in enumerate(procs):
        threading.Thread(target=read, args=(rank, p), name=f"collect-{rank}", daemon=True).start()
    out: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            rank, so, se = ended.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            waiting = [r for r in range(len(procs)) if r not in out]
            _stop(procs)
            raise RuntimeError(f"{what}: ranks {waiting} did not finish within {timeout}s") from None
        lines = so.strip().splitlines()
        if procs[rank].returncode != 0 or not lines:
            _stop(procs)
            raise RuntimeError(f"{what}: rank {rank} failed (rc={procs[rank].returncode}):\n{se[-4000:]}")
        out[rank] = json.loads(lines[-1])
    return [out[r] for r in range(len(procs))]
