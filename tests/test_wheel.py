"""The package as a user gets it: build the wheel, install it into a fresh venv outside the
repository, and run `elastic-emb demo` there, from a directory that is not the checkout. It must
PASS (the example model, the drill and the rendezvous backend all come from the wheel).

To stay fast and offline-capable, the fresh venv reuses the suite's installed dependencies (torch
is 700 MB) through a ``.pth`` line naming the suite's site-packages: the venv's own site-packages
come first on ``sys.path`` and only they are scanned for ``.pth`` files, so the suite's editable
install of elastic_emb (a ``.pth`` finder there) is inert and ``import elastic_emb`` can only find
the wheel's copy, which the test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("cwd", "/")  # never the checkout: `python -c` puts the working directory on sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, f"{cmd} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_runs_the_demo(tmp_path):
    # 1. the wheel, built from a copy of what the sdist holds (the checkout stays untouched)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "elastic_emb", src / "elastic_emb", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)], timeout=300)
    [wheel] = dist.glob("elastic_emb-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("elastic_emb/examples/recsys.py", "elastic_emb/py.typed", "elastic_emb/drill/command.py"):
        assert needed in names, f"{needed} missing from {wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

    # 2. a fresh venv outside the repository, the suite's dependencies reachable, the wheel installed
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "suite-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         timeout=300)
    where = _run([str(py), "-c", "import elastic_emb, elastic_emb.examples as e; print(elastic_emb.__file__); "
                                 "print(e.RECSYS)"]).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    cli = venv / "bin" / "elastic-emb"
    assert Path(_run([str(cli), "example-path"]).stdout.strip()) == Path(where[1])

    # 3. the demo, from a directory that is neither the checkout nor the venv
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("ELASTIC_EMB_", "TORCHELASTIC_", "PET_"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    r = subprocess.run([str(cli), "demo", "--progress", "lines"], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "PASS" in out and f"drill output: {elsewhere / 'drill-demo'}" in out, out[-3000:]
    assert (elsewhere / "drill-demo" / "report.json").is_file()
