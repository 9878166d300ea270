"""The package as a user gets it, for tests/test_wheel.py and the demo test of tests/test_drill.py.

:func:`build_and_run_demo` builds the wheel from a copy of what the sdist holds, installs it with
its ``[drill]`` extra into a fresh venv outside the repository, and runs ``elastic-emb demo`` there
from a directory that is neither the checkout nor the venv. The suite runs it once (the session
fixture ``wheel_demo`` in tests/conftest.py): test_wheel checks the install and the demo's
verdict, and test_drill's demo test checks the same demo drill's report and events (it ran its own
launch of the preset before, a second 20 s drill of the same scenario).

To stay fast and offline-capable, the fresh venv reuses the suite's installed dependencies (torch
is 700 MB) through a ``.pth`` line naming the suite's site-packages: the venv's own site-packages
come first on ``sys.path`` and only they are scanned for ``.pth`` files, so the suite's editable
install of elastic_emb (a ``.pth`` finder there) is inert and ``import elastic_emb`` can only find
the wheel's copy, which test_wheel checks. pip resolves the wheel's requirements and its
``[drill]`` extra's against what that line makes visible, offline: a requirement the suite's venv
does not satisfy fails the install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WheelDemo:
    wheel: Path
    venv: Path
    where: list[str]  # elastic_emb.__file__ and elastic_emb.examples.RECSYS, as the venv's python sees them
    example_path: str  # what `elastic-emb example-path` printed
    elsewhere: Path  # the working directory of the demo
    returncode: int
    output: str  # the demo's stdout + stderr

    @property
    def out(self) -> Path:
        return self.elsewhere / "drill-demo"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("cwd", "/")  # never the checkout: `python -c` puts the working directory on sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, f"{cmd} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def build_wheel(tmp: Path) -> Path:
    """The wheel, built with ``pip wheel --no-deps`` from a copy of what the sdist holds (the
    checkout stays untouched), under ``tmp``."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "elastic_emb", src / "elastic_emb", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)], timeout=300)
    [wheel] = dist.glob("elastic_emb-*.whl")
    return wheel


def build_and_run_demo(tmp: Path) -> WheelDemo:
    # 1. the wheel
    wheel = build_wheel(tmp)

    # 2. a fresh venv outside the repository, the suite's dependencies reachable, the wheel installed
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "suite-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q", f"{wheel}[drill]"],
        timeout=300,
    )
    where = _run(
        [str(py), "-c", "import elastic_emb, elastic_emb.examples as e; print(elastic_emb.__file__); print(e.RECSYS)"]
    ).stdout.split()
    cli = venv / "bin" / "elastic-emb"
    example_path = _run([str(cli), "example-path"]).stdout.strip()

    # 3. the demo, from a directory that is neither the checkout nor the venv
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith(("ELASTIC_EMB_", "TORCHELASTIC_", "PET_"))
    }
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    r = subprocess.run(
        [str(cli), "demo", "--progress", "lines"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=500
    )
    return WheelDemo(wheel, venv, where, example_path, elsewhere, r.returncode, r.stdout + r.stderr)
