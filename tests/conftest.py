"""Suite-wide hooks.

* Ports reserved with :func:`elastic_emb.testing.ports.free_port` during a test are released
  after it.
* structlog's context variables are cleared around every test: a test that starts a
  ``Lifecycle`` in this process binds its run id, generation and rank (``bind_topology``) to
  every later event of the thread, and the next test's events (a drill's ``drill_node_started``)
  carried them.
* Under ``CI=true`` a skipped test fails, unless it is marked ``gpu``: CI installs every system
  package the suite needs (.ci/apt-packages), so a skip there means a test silently did not run.
* Outside CI, the summary at the end names every skip, so a smaller run than CI's is said aloud.
"""

from __future__ import annotations

import os

import pytest
import structlog

from elastic_emb.testing.ports import release_ports

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def _release_reserved_ports():
    yield
    release_ports()


@pytest.fixture(autouse=True)
def _clear_log_context():
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or item.get_closest_marker("gpu") is not None:
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure, not a skip
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true, where every test but the gpu-marked ones must run: {reason}\n"
                       f"remedy: install what .ci/apt-packages lists (.ci/system-deps does, as root), or mark the "
                       f"test gpu if it needs CUDA")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (``pytest.skip(allow_module_level=True)``): same rule."""
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or collector.get_closest_marker("gpu") is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{collector.nodeid} skipped whole under CI=true, where every test but the gpu-marked "
                       f"ones must run: {reason}")


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or CI:
        return
    gpu = [r for r in skipped if "gpu" in getattr(r, "keywords", {})]
    other = [r for r in skipped if "gpu" not in getattr(r, "keywords", {})]
    tr = terminalreporter
    tr.section("tests that did not run here")
    if gpu:
        tr.write_line(f"{len(gpu)} GPU test(s) skipped: they need CUDA devices (see bench/gpu_suite.sh)")
    if other:
        tr.write_line(f"{len(other)} other test(s) skipped, which CI runs (CI=true fails on them):", red=True)
        for r in other:
            reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
            tr.write_line(f"  {r.nodeid}: {reason}")
        tr.write_line("  remedy: .ci/system-deps, run as root, installs the system packages the suite needs (.ci/apt-packages)")
