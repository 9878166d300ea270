"""The repository's helper scripts as `make` runs them: scripts/check-disk.py passes when the
disk has the space asked for and stops with one line naming the free space and the remedy when not."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK_DISK = REPO / "scripts" / "check-disk.py"


def _check_disk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK_DISK), *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_check_disk_passes_when_the_space_is_there():
    done = _check_disk("0", "nothing")
    assert (done.returncode, done.stderr) == (0, "")


def test_check_disk_stops_in_one_line_naming_the_free_space_and_the_remedy():
    # twice the disk's whole size can never be free
    need = 2 * shutil.disk_usage(REPO).total / 2**30
    done = _check_disk(str(need), "torch==2.14.1 in .venv-compat")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "torch==2.14.1 in .venv-compat" in lines[0]
    assert "GiB are free here" in lines[0] and "COMPAT_DISK_GIB=0" in lines[0]


def test_check_disk_refuses_a_size_that_is_not_a_number():
    done = _check_disk("seven", "x")
    assert done.returncode == 2
    assert "'seven' is not a number" in done.stderr
