"""The package as a user gets it: build the wheel, install it into a fresh venv outside the
repository, and run `elastic-emb demo` there, from a directory that is not the checkout. It must
PASS (the example model, the drill and the rendezvous backend all come from the wheel).

The build, the install and the demo are tests/helpers/wheel_demo.py, run once per session (the
``wheel_demo`` fixture of tests/conftest.py): tests/test_drill.py checks the same demo drill's
report and events.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_runs_the_demo(wheel_demo):
    names = zipfile.ZipFile(wheel_demo.wheel).namelist()
    for needed in ("elastic_emb/examples/recsys.py", "elastic_emb/py.typed", "elastic_emb/drill/command.py"):
        assert needed in names, f"{needed} missing from {wheel_demo.wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

    # elastic_emb and its example come from the wheel installed in the venv, not the checkout
    where = wheel_demo.where
    assert all(Path(p).is_relative_to(wheel_demo.venv) for p in where), where
    assert Path(wheel_demo.example_path) == Path(where[1])

    # the demo, run from a directory that is neither the checkout nor the venv, passed
    out, elsewhere = wheel_demo.output, wheel_demo.elsewhere
    assert wheel_demo.returncode == 0, out[-6000:]
    assert "PASS" in out and f"drill output: {elsewhere / 'drill-demo'}" in out, out[-3000:]
    assert (elsewhere / "drill-demo" / "report.json").is_file()
