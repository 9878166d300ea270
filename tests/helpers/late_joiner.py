"""The packaged training example (the drills' script) with a start that can be held back.

``LATE_JOINER_GATE=<dir>`` in a worker's environment: the worker waits (bounded, 120 s) until that
directory holds a ``*.pt`` file (the running world's final tables) before it runs the example, as
a joiner's worker that is still importing and building while the running world finishes. Without
the variable it runs the example at once. ``LATE_JOINER_FAIL=1``: the worker fails at once (exit
1), as a job that fails. The rest of ``argv`` goes to the example.
"""

from __future__ import annotations

import glob
import os
import runpy
import sys
import time

if os.environ.get("LATE_JOINER_FAIL") == "1":
    sys.exit(1)
gate = os.environ.get("LATE_JOINER_GATE")
if gate:
    deadline = time.monotonic() + 120.0
    while not glob.glob(os.path.join(gate, "*.pt")) and time.monotonic() < deadline:
        time.sleep(0.05)

from elastic_emb.examples import RECSYS  # noqa: E402 - after the gate, as a slow start would

sys.argv = [str(RECSYS), *sys.argv[1:]]
runpy.run_path(str(RECSYS), run_name="__main__")
