"""elastic_emb.progress: the reporter of long work, driven by a fake clock (so no outcome depends on
the machine's speed), its bar on a real pseudo-terminal only, its thread safety with real threads,
and one real restore (a one-rank world in this process) whose final event counts every byte."""

from __future__ import annotations

import io
import os
import select
import threading

import pytest
import structlog
import torch

from elastic_emb.progress import BAR_WIDTH, Progress
from elastic_emb.state import SnapshotTier, restore
from tests.test_state import TinyContext, world1  # noqa: F401 - the restore harness and its fixture


class Clock:
    """A fake monotonic clock: it moves only when the test sets ``t``."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _progress_events(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "progress"]


def _run(clock: Clock, p: Progress, until: float, step: float = 0.25, advance: int = 0) -> None:
    """Tick ``p`` every ``step`` seconds of fake time up to ``until`` seconds after the start."""
    start = clock.t
    k = 0
    while k * step <= until:
        clock.t = start + k * step
        p.advance(advance)
        p.tick()
        k += 1


def test_work_that_ends_before_the_threshold_reports_nothing():
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        p = Progress("restore", 1 << 20, after=2.0, clock=clock, auto=False, bar=False)
        _run(clock, p, until=1.75, advance=1024)
        clock.t += 0.2  # 1.95 s in: still below the threshold
        p.close()
    assert _progress_events(logs) == []


def test_one_event_per_second_after_the_threshold_then_a_final_one():
    clock = Clock()
    start = clock.t
    with structlog.testing.capture_logs() as logs:
        with Progress("reshard", 4096, after=2.0, every=1.0, clock=clock, auto=False, bar=False, step=7) as p:
            _run(clock, p, until=10.0, advance=8)
    events = _progress_events(logs)
    # ticks every 0.25 s from 0 to 10 s: events at 2, 3, ..., 10 s, then the final one at close
    assert [e["elapsed_s"] for e in events] == [float(s) for s in range(2, 11)] + [10.0]
    assert [e["final"] for e in events] == [False] * 9 + [True]
    assert all(e["task"] == "reshard" and e["step"] == 7 and e["total_bytes"] == 4096 for e in events)
    assert events[-1]["done_bytes"] == 8 * 41 and clock.t == start + 10.0  # 41 ticks of 8 bytes


def test_rate_and_eta_are_the_average_so_far_exactly():
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        p = Progress("durable_load", 1024, after=0.0, clock=clock, auto=False, bar=False)
        clock.t += 2.0
        p.advance(256)  # 256 bytes in 2 s: 128 B/s, 768 bytes left: 6 s
        p.tick()
        clock.t += 2.0
        p.advance(256)  # 512 in 4 s: 128 B/s, 4 s left
        p.tick()
        clock.t += 4.0
        p.advance(512)  # all of it, 8 s in: 128 B/s
        p.close()
    events = _progress_events(logs)
    assert [(e["done_bytes"], e["rate"], e["eta_s"]) for e in events] == [
        (256, 128.0, 6.0),
        (512, 128.0, 4.0),
        (1024, 128.0, 0.0),
    ]
    assert [e["final"] for e in events] == [False, False, True]


def test_nothing_done_or_no_total_gives_no_eta_and_other_units_name_their_fields():
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        p = Progress("drain", 4, unit="acks", after=0.0, clock=clock, auto=False, bar=False)
        p.tick()  # no time has passed: no rate yet
        clock.t += 1.0
        p.tick()  # a second, nothing done: rate 0, no ETA
        p.advance(3)
        p.advance(-1)  # an absolute count moved back (the drain advances by the difference)
        clock.t += 1.0
        p.close()
        q = Progress("durable_save", None, after=0.0, clock=clock, auto=False, bar=False)
        clock.t += 1.0
        q.advance(10)
        q.close()
    a, b, c, d = _progress_events(logs)
    assert (a["done_acks"], a["total_acks"], a["rate"], a["eta_s"]) == (0, 4, None, None)
    assert (b["rate"], b["eta_s"]) == (0.0, None)
    assert (c["done_acks"], c["rate"], c["eta_s"], c["final"]) == (2, 1.0, 2.0, True)
    assert (d["task"], d["done_bytes"], d["total_bytes"], d["rate"], d["eta_s"]) == (
        "durable_save",
        10,
        None,
        10.0,
        None,
    )


def test_a_failed_work_says_so_in_its_final_event_and_the_exception_goes_on():
    clock = Clock()
    with structlog.testing.capture_logs() as logs, pytest.raises(RuntimeError, match="disk full"):
        with Progress("base_write", 100, after=0.0, clock=clock, auto=False, bar=False):
            clock.t += 3.0
            raise RuntimeError("disk full")
    [final] = _progress_events(logs)
    assert final["final"] is True and final["failed"] is True and final["elapsed_s"] == 3.0


def test_advances_from_many_threads_are_all_counted():
    clock = Clock()
    threads, per_thread, n = 8, 5000, 3
    go = threading.Barrier(threads + 1)
    with structlog.testing.capture_logs() as logs:
        p = Progress("restore", threads * per_thread * n, after=0.0, clock=clock, auto=False, bar=False)

        def work() -> None:
            go.wait(timeout=30)
            for _ in range(per_thread):
                p.advance(n)

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        go.wait(timeout=30)
        for _ in range(50):  # reports race the advances: each sees some count, never more than the total
            p.tick()
            clock.t += 1.0
        for t in pool:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in pool)
        p.close()
    events = _progress_events(logs)
    assert all(0 <= e["done_bytes"] <= threads * per_thread * n for e in events)
    assert events[-1]["final"] and events[-1]["done_bytes"] == threads * per_thread * n == p.done
    assert events[-1]["eta_s"] == 0.0


def test_reporting_never_raises_into_the_caller():
    class Broken(io.StringIO):
        def isatty(self) -> bool:
            return True

        def write(self, s):  # noqa: ARG002 - the bar's stream fails on every write
            raise OSError(5, "Input/output error")

    clock = Clock()
    p = Progress("restore", 10, after=0.0, clock=clock, auto=False, stream=Broken(), bar=True)
    p.advance("not a number")  # ignored
    p.advance(4)
    clock.t += 1.0
    p.tick()
    p.close()
    p.close()  # twice: nothing more
    assert p.done == 4


def test_the_threshold_comes_from_the_setting(monkeypatch):
    clock = Clock()
    monkeypatch.setenv("ELASTIC_EMB_PROGRESS_AFTER", "5")
    with structlog.testing.capture_logs() as logs:
        p = Progress("restore", 10, clock=clock, auto=False, bar=False)
        clock.t += 4.5
        p.tick()
        assert _progress_events(logs) == []
        clock.t += 0.5
        p.tick()
        p.close()
    assert [e["elapsed_s"] for e in _progress_events(logs)] == [5.0, 5.0]
    monkeypatch.setenv("ELASTIC_EMB_PROGRESS_AFTER", "soon")
    with structlog.testing.capture_logs() as logs:
        Progress("restore", 10, clock=clock, auto=False, bar=False).close()
    assert not _progress_events(logs)  # the default threshold, 2 s: nothing at once


def _read_pty(fd: int, want: str, timeout: float = 10.0) -> str:
    """What the terminal shows, read until ``want`` appears (bounded by ``timeout``)."""
    got = ""
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while want not in got and not deadline.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                got += os.read(fd, 65536).decode(errors="replace")
    finally:
        timer.cancel()
    return got


def test_the_bar_is_drawn_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    clock = Clock()
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    try:
        with structlog.testing.capture_logs():
            p = Progress("restore", 1024, after=0.0, clock=clock, auto=False, stream=tty)
            # a second reporter open at the same time (nested work) leaves the one bar to the first
            inner = Progress("durable_load", 10, after=0.0, clock=clock, auto=False, stream=tty)
            clock.t += 2.0
            p.advance(512)
            inner.advance(5)
            inner.tick()
            p.tick()
            half = "[" + "#" * (BAR_WIDTH // 2) + "-" * (BAR_WIDTH - BAR_WIDTH // 2) + "]"
            shown = _read_pty(master, "ETA")
            assert "restore " + half in shown and " 50.0%" in shown and "512B/1.0KiB" in shown, shown
            assert "256B/s ETA 2s" in shown, shown
            assert "durable_load" not in shown, shown
            inner.close()
            p.advance(512)
            clock.t += 2.0
            p.close()
            shown = _read_pty(master, "in 4.0s")
            assert "[" + "#" * BAR_WIDTH + "] 100.0%" in shown and "in 4.0s" in shown, shown
    finally:
        tty.close()
        os.close(master)
    # not a terminal: a pipe, or a terminal on a worker of local rank above 0, gets no bar
    r, w = os.pipe()
    with os.fdopen(w, "w") as pipe, structlog.testing.capture_logs():
        p = Progress("restore", 10, after=0.0, clock=clock, auto=False, stream=pipe)
        p.advance(5)
        clock.t += 1.0
        p.tick()
        p.close()
    with os.fdopen(r) as out:
        assert out.read() == ""
    monkeypatch.setenv("LOCAL_RANK", "1")
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty, structlog.testing.capture_logs():
        p = Progress("restore", 10, after=0.0, clock=clock, auto=False, stream=tty)
        p.advance(5)
        clock.t += 1.0
        p.tick()
        p.close()
        assert select.select([master], [], [], 0.2)[0] == []  # nothing was written to the terminal
    os.close(master)


def test_the_bar_fits_the_terminal_width(monkeypatch):
    import fcntl
    import struct
    import termios

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    clock = Clock()
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))  # 24 rows, 40 columns
    try:
        with os.fdopen(slave, "w") as tty, structlog.testing.capture_logs():
            p = Progress("restore", 1024, after=0.0, clock=clock, auto=False, stream=tty)
            clock.t += 2.0
            p.advance(512)
            p.tick()
            shown = _read_pty(master, "\x1b[K")
            p.close()
    finally:
        os.close(master)
    line = shown.split("\r")[-1].split("\x1b[K")[0]
    assert line.startswith("restore [") and len(line) == 39, shown  # one column left for the cursor


def test_the_shared_thread_reports_on_its_own():
    """With the real clock and the shared thread: a threshold of 0 s gives events while the work
    runs; only their presence is asserted (how many depends on the machine's speed)."""
    with structlog.testing.capture_logs() as logs:
        with Progress("drain", 3, unit="acks", after=0.0, bar=False) as p:
            p.advance(1)
            waited = threading.Event()
            for _ in range(100):  # at most 10 s for the thread's first event
                if _progress_events(logs):
                    break
                waited.wait(0.1)
    events = _progress_events(logs)
    assert events and not any(e["final"] for e in events[:-1]) and events[-1]["final"]
    assert events[-1]["done_acks"] == 1 and events[-1]["total_acks"] == 3


# -- one real restore ------------------------------------------------------------------------------


def test_a_real_restore_and_reshard_report_every_byte_they_fill(tmp_path, world1, monkeypatch):
    monkeypatch.setenv("ELASTIC_EMB_PROGRESS_AFTER", "0")
    topo, comm = world1()
    tier = SnapshotTier(tmp_path, "unit", "nodeA", replication=0, keep=3)
    ctx = TinyContext(topo)
    ctx.w.fill_(7.0)
    ctx.acc.fill_(7.5)
    tier.commit(0, ctx.export_shard(), comm, {"t": 40})
    shard_bytes = 40 * 3 * 4 + 40 * 4  # weight (40 x 3 float32) and one slot (40 float32)

    topo2, comm2 = world1()
    ctx2 = TinyContext(topo2)
    with structlog.testing.capture_logs() as logs:
        report = restore(ctx2, comm2, snapshot=tier, durable=None)
    assert report.step == 0 and torch.equal(ctx2.w, torch.full((40, 3), 7.0))
    [final] = [e for e in _progress_events(logs) if e["final"]]
    assert final["task"] == "restore" and final["done_bytes"] == final["total_bytes"] == shard_bytes
    assert report.bytes_local == shard_bytes

    # the live reshard: the rows of the previous context, moved in this process
    topo3, comm3 = world1()
    ctx3 = TinyContext(topo3)
    with structlog.testing.capture_logs() as logs:
        report = restore(
            ctx3,
            comm3,
            snapshot=None,
            durable=None,
            live=list(ctx2.export_shard().values()),
            live_commit=(0, topo2.generation, topo2.fingerprint()),
        )
    assert report.source_tiers == ["live"] and torch.equal(ctx3.acc, torch.full((40,), 7.5))
    [final] = [e for e in _progress_events(logs) if e["final"]]
    assert final["task"] == "reshard" and final["done_bytes"] == final["total_bytes"] == shard_bytes
