"""Runs a training script unchanged (the README's), with :class:`GateHooks` passed to its ``run_elastic``.

torchrun starts ``readme_runner.py SCRIPT [ARGS...]``: ``elastic_emb.run_elastic`` is replaced by
a call of the real one with ``hooks=GateHooks()``, then SCRIPT runs as ``__main__``. The hooks
write one JSON line per event to ``$READMETEST_OUT/progress/<node>-<pid>.jsonl`` and, while
``$READMETEST_OUT/hold-<node>`` exists, hold the worker between two steps, its commits complete,
until the loop has a reason to go on (``wake()``) or the file goes: a test then decides when the
world may move on, whatever the machine's speed. The node is ``ELASTIC_EMB_NODE_ID``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

import elastic_emb
from elastic_emb import LoopHooks

OUT = os.environ["READMETEST_OUT"]
NODE = os.environ["ELASTIC_EMB_NODE_ID"]
HOLD_S = 120.0  # a hold ends by itself after this long: no worker outlives a test that forgot it


class GateHooks(LoopHooks):
    """Progress lines and the test's hold, through the public seams of ``run_elastic``."""

    def __init__(self) -> None:
        os.makedirs(os.path.join(OUT, "progress"), exist_ok=True)
        self.file = open(os.path.join(OUT, "progress", f"{NODE}-{os.getpid()}.jsonl"), "a", buffering=1)

    def write(self, event: str, lc, **fields) -> None:
        t = lc.topology if lc is not None else None
        line = {
            "event": event,
            "t": time.time(),
            "node": NODE,
            "pid": os.getpid(),
            "world": t.world_size if t else None,
            "generation": t.generation if t else None,
            "rank": t.rank if t else None,
            **fields,
        }
        self.file.write(json.dumps(line) + "\n")

    def on_start(self, lc, *, seconds: float) -> None:
        self.write("start", lc, step=lc.step)

    def after_step(self, lc, step, loss, *, seconds, report) -> None:
        self.write("step", lc, step=step)

    def pace(self, lc, step, wake) -> None:
        hold = os.path.join(OUT, f"hold-{NODE}")
        if not os.path.exists(hold) or wake():
            return
        lc.wait_commit()  # held with every step committed (and replicated): a kill then loses nothing
        self.write("held", lc, step=step, committed=lc.committed_step)
        deadline = time.monotonic() + HOLD_S
        while os.path.exists(hold) and time.monotonic() < deadline:
            if wake():
                break
            time.sleep(0.02)
        self.write("released", lc, step=step)

    def on_resize(self, lc, event, *, failed: bool) -> None:
        self.write("resized", lc, step=lc.step, failed=failed)

    def on_stop(self, lc, reason: str, step: int) -> None:
        self.write("stop", lc, step=step, reason=reason)

    def on_finish(self, lc) -> None:
        self.write("finish", lc, step=lc.step)


def main() -> None:
    real = elastic_emb.run_elastic

    def run_elastic(factory, step, **kwargs):
        return real(factory, step, hooks=GateHooks(), **kwargs)

    elastic_emb.run_elastic = run_elastic  # what the script's `from elastic_emb import run_elastic` finds
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
