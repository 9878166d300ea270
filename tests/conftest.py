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
* Tiers: ``make check`` runs ``-m "not slow and not gpu" --fast-tier``; under ``--fast-tier`` a test
  that starts torchrun agents, etcd or a drill fails and says to mark it ``slow``, so the fast tier
  stays what it says.
* The example native context (tests/test_adapters_native.py) is compiled in the background from
  the start of the session, niced, and its tests run last: on a clean machine the compile (18 s
  of one core, the module's whole set-up) then overlaps the other tests, which leave a core idle
  much of the time (they wait on torchrun agents, heartbeats and sleeps). The tests themselves
  still call ``build()``, which waits for that compile (a flock in the build directory) or
  loads what it left in the cache; a failed background compile is redone and reported there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from elastic_emb.testing.ports import release_ports

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE_TESTS = os.path.join(REPO, "tests", "test_adapters_native.py")
_native_build: subprocess.Popen | None = None


def pytest_addoption(parser):
    parser.addoption(
        "--fast-tier",
        action="store_true",
        default=False,
        help="fail a test that starts torchrun agents, etcd or a drill (make check)",
    )


# what the fast tier never starts: a torchrun agent (a drill starts them too), an etcd server
_HEAVY_MODULES = {"torch.distributed.run"}
_HEAVY_PROGRAMS = {"torchrun", "etcd"}


def _heavy(args) -> str | None:
    """The agent or server ``args`` would start, if any."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    for a in argv:
        if a in _HEAVY_MODULES or os.path.basename(a) in _HEAVY_PROGRAMS:
            return a
    return None


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    if not request.config.getoption("--fast-tier"):
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        heavy = _heavy(args)
        if heavy:
            pytest.fail(
                f"{request.node.nodeid} starts {heavy}: the fast tier starts no torchrun agent and no "
                f"etcd; mark the test @pytest.mark.slow",
                pytrace=False,
            )
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield


def pytest_collection_modifyitems(session, config, items):
    """Run the native context's tests last and start their compile now (module docstring)."""
    native = [item for item in items if str(item.path) == NATIVE_TESTS]
    items[:] = [item for item in items if str(item.path) != NATIVE_TESTS] + native
    if not native or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one compile per run: the first xdist worker's
    global _native_build
    code = (
        f"import sys; sys.path.insert(0, {os.path.join(REPO, 'examples', 'native_context')!r}); "
        f"import native_context; native_context.build()"
    )
    # nice 10: the compile takes the CPU the tests leave idle, not the CPU they wait for. Its
    # output is not kept: a failure is redone, and reported, by the tests' own build().
    _native_build = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(10),
    )


def pytest_sessionfinish(session, exitstatus):
    # Let it finish rather than kill it: a compile stopped hard leaves a half-written build
    # directory for the next build() to redo. It ends on its own (or with the session's Ctrl-C).
    if _native_build is not None and _native_build.poll() is None:
        try:
            _native_build.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def wheel_demo(tmp_path_factory):
    """The wheel built, installed into a fresh venv and its ``elastic-emb demo`` run, once per session
    (tests/helpers/wheel_demo.py): test_wheel and test_drill's demo test check the one run."""
    import dataclasses
    import json

    from filelock import FileLock

    from tests.helpers.wheel_demo import WheelDemo, build_and_run_demo

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build_and_run_demo(tmp_path_factory.mktemp("wheel"))
    # Under pytest-xdist the two tests may run in different workers: the first builds and runs the
    # demo under a lock in the run's shared temporary directory, the other reads what it recorded.
    shared = tmp_path_factory.getbasetemp().parent
    record = shared / "wheel_demo.json"
    with FileLock(str(shared / "wheel_demo.lock"), timeout=1200):
        if not record.is_file():
            demo = build_and_run_demo(tmp_path_factory.mktemp("wheel"))
            record.write_text(json.dumps(dataclasses.asdict(demo), default=str))
        fields = json.loads(record.read_text())
    for name in ("wheel", "venv", "elsewhere"):
        fields[name] = Path(fields[name])
    return WheelDemo(**fields)


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
    report.longrepr = (
        f"skipped under CI=true, where every test but the gpu-marked ones must run: {reason}\n"
        f"remedy: install what .ci/apt-packages lists (.ci/system-deps does, as root), or mark the "
        f"test gpu if it needs CUDA"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (``pytest.skip(allow_module_level=True)``): same rule."""
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or collector.get_closest_marker("gpu") is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"{collector.nodeid} skipped whole under CI=true, where every test but the gpu-marked ones must run: {reason}"
    )


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
        tr.write_line(
            "  remedy: .ci/system-deps, run as root, installs the system packages the suite needs (.ci/apt-packages)"
        )
