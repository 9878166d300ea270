"""The package's dependencies as a user installs them.

The wheel's metadata: the core requirements (no ``extra ==`` marker) hold no package of the drills
and reports, the ``[drill]`` extra holds them, the license is PEP 639's. Then a fresh venv that
sees only the core requirements and what they pull in (symlinks to the suite's installed copies,
through a ``.pth`` line, as tests/helpers/wheel_demo.py does with the whole site-packages): pip
installs the wheel there offline (so the core requirements are all there), every public name
imports, the command's help and ``drill --list`` work, and ``elastic-emb demo`` stops with one
line naming the extra.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import elastic_emb
from tests.helpers.wheel_demo import build_wheel

DRILL = {"rich", "matplotlib", "pyyaml", "psutil"}
NOT_CORE = DRILL | {"pillow", "pydantic-settings", "python-etcd", "prometheus-client"}


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        [name] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(name).decode())


def _requirements(meta, extra: str = "") -> set[str]:
    """The names a plain install (``extra=""``) or one with ``extra`` requires."""
    out = set()
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        core = req.marker is None or req.marker.evaluate({"extra": ""})
        if core if not extra else (not core and req.marker.evaluate({"extra": extra})):
            out.add(canonicalize_name(req.name))
    return out


def _closure(names: set[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions ``names`` need, with everything they require (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name}, a core requirement (or one of theirs), is not installed in the suite's venv")
        found[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return found


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ELASTIC_EMB_")}
    kw.setdefault("cwd", "/")  # never the checkout: `python -c` puts the working directory on sys.path
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_core_install_has_no_drill_packages_and_demo_names_the_extra(tmp_path):
    wheel = build_wheel(tmp_path)
    meta = _metadata(wheel)

    # the metadata
    core = _requirements(meta)
    assert core == {"torch", "pydantic", "structlog", "numpy", "click", "xxhash"}, core
    assert not core & NOT_CORE
    assert _requirements(meta, "drill") == DRILL
    assert set(meta.get_all("Provides-Extra")) == {"drill", "etcd-v2", "metrics", "torchrec"}
    torchrec = [Requirement(r) for r in meta.get_all("Requires-Dist") if "torchrec" in r]
    assert all("==" not in str(r.specifier) for r in torchrec), torchrec  # a GPU user can install it
    assert "fbgemm-gpu-cpu" not in {canonicalize_name(r.name) for r in torchrec}
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Version"] == elastic_emb.__version__

    # a venv that sees the core requirements' closure and nothing else
    closure = _closure(core)
    assert not set(closure) & DRILL, f"a core requirement pulls in {set(closure) & DRILL}"
    visible = tmp_path / "core-site"
    visible.mkdir()
    for dist in closure.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (visible / top).exists():
                (visible / top).symlink_to(source)
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", venv]).returncode == 0
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    assert site.is_relative_to(venv) and Path(sysconfig.get_paths()["purelib"]) != site
    (site / "core-deps.pth").write_text(f"{visible}\n")
    # offline, with dependencies: pip finds every core requirement among the symlinks, or fails
    r = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q", wheel])
    assert r.returncode == 0, r.stdout + r.stderr

    probe = "import importlib.util as u; print([m for m in ('rich', 'matplotlib', 'yaml', 'psutil', 'PIL') if u.find_spec(m)])"
    assert _run([py, "-c", probe]).stdout.strip() == "[]"
    every_name = "import elastic_emb as e; [getattr(e, n) for n in e.__all__]; print(e.__file__)"
    r = _run([py, "-c", every_name])
    assert r.returncode == 0 and Path(r.stdout.split()[-1]).is_relative_to(venv), r.stdout + r.stderr
    cli = venv / "bin" / "elastic-emb"
    for args in (["--help"], ["drill", "--list"], ["example-path"]):
        r = _run([cli, *args])
        assert r.returncode == 0, (args, r.stdout + r.stderr)

    r = _run([cli, "demo"], cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("elastic-emb demo: error:") and "drill extra" in lines[0], lines[0]
    assert "pip install 'elastic-emb[drill]'" in lines[0] and "psutil" in lines[0], lines[0]
    assert not (tmp_path / "drill-demo").exists()  # stopped before it started
