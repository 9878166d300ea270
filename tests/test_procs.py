"""elastic_emb.testing.procs.collect: the ranks' results in rank order, and the first failure named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_emb.testing.procs import collect


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def test_collect_returns_each_ranks_last_line_in_rank_order():
    # rank 0 ends last: the results still come back in rank order
    procs = [
        _start("import time, json; time.sleep(1); print('noise'); print(json.dumps({'rank': 0}))"),
        _start("import json; print(json.dumps({'rank': 1}))"),
    ]
    assert collect(procs, 60, "world 2") == [{"rank": 0}, {"rank": 1}]


def test_collect_names_the_rank_that_failed_not_the_one_left_waiting_for_it():
    # rank 0 would wait past the deadline (as a peer of a dead rank waits in a collective); the
    # report names rank 1, its exit status and its stderr, and rank 0 is killed
    procs = [
        _start("import time; time.sleep(600)"),
        _start("import sys; sys.stderr.write('boom: rank 1 gave up'); sys.exit(3)"),
    ]
    with pytest.raises(RuntimeError, match=r"world 2: rank 1 failed \(rc=3\):\nboom: rank 1 gave up"):
        collect(procs, 300, "world 2")
    assert procs[0].poll() is not None


def test_collect_kills_every_rank_at_the_deadline_and_names_those_still_running():
    procs = [_start("print('{}')"), _start("import time; time.sleep(600)")]
    procs[0].wait(timeout=120)  # ended before the clock starts: only rank 1 can overrun
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not finish within 5s"):
        collect(procs, 5, "world 2")
    assert procs[1].poll() is not None


def test_a_rank_that_prints_nothing_is_a_failure():
    procs = [_start("pass")]
    with pytest.raises(RuntimeError, match=r"rank 0 failed \(rc=0\)"):
        collect(procs, 60, "world 1")
