"""Collect the result of bench rank processes: each prints one JSON line last, within one deadline.

Shared by the benches that start one process per rank themselves (bench/commit.py, bench/reshard.py,
bench/lookup.py); a rank that fails or overruns ends the bench with its stderr tail, and every rank is
killed (the others would wait for it in a collective until their own timeout).
"""

from __future__ import annotations

import json
import subprocess
import time


def collect(procs: list[subprocess.Popen], timeout: float, what: str) -> list[dict]:
    """The last stdout line of each rank, parsed as JSON, in rank order; SystemExit naming ``what``."""
    out = []
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{what}: rank {rank} did not finish within {timeout}s") from None
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{what}: rank {rank} failed (rc={p.returncode}):\n{se[-4000:]}")
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out
