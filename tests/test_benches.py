"""Every benchmark script in bench/ runs, at a tiny size on the CPU, and leaves the figures it promises.

A benchmark is only run by hand (and the GPU ones on a lent machine), so nothing else notices when
a change of the library breaks one. Each script here runs in a subprocess of its own, as its
docstring says to run it but at its smallest setting (a few ids, a few steps, one run; the drills
and the torchrun benches one short scenario), under a hard timeout, with CUDA hidden: a bench that
needs CUDA runs its ``--device cpu`` mode (the same loops as far as the CPU allows), and one that
can do nothing without it (bench/nccl_setup.py) must say so and exit 0. Checked: exit status 0, and
the JSON report it wrote parses, names the bench, and holds the keys it promises (with the bench's
own verdicts, where it has one, true). A bench with a second code path of its own gets a second
smoke run, named after it (``resize-readme``: bench/resize.py ``--scenario readme``).

The scripts run side by side, a few at a time (most of their time is waiting: process starts,
imports, torchrun agents), so the whole module takes about a minute or two on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_emb.testing.etcd import etcd_binary

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OUT = "{out}"  # replaced by the bench's JSON path


@dataclass(frozen=True)
class Smoke:
    """How one bench runs here and what it must leave."""

    argv: tuple[str, ...]  # after the script's path; OUT marks the JSON path
    keys: tuple[str, ...] = ()  # top-level keys of its JSON report (none: it writes no report here)
    stdout: str | None = None  # text its output must hold
    timeout: float = 150.0
    needs: tuple[str, ...] = field(default=())  # "torchrec", "etcd"
    script: str | None = None  # the bench/<script>.py it runs; None: the smoke run's own name


SMOKES: dict[str, Smoke] = {
    "agree": Smoke(("--ranks", "2", "4", "--runs", "1", "--out", OUT), ("results",)),
    "app_state": Smoke(
        ("--dense-mb", "1", "--steps", "4", "--rows", "4096", "--dim", "8", "--ids", "64", "--json", OUT),
        ("tables+dense", "tables+dense_over_tables", "dense_added_mean_ms"),
    ),
    # the run at two sizes (the doubling comparison), and the tier-level breakdown beside it
    "commit": Smoke(
        (
            "--rows",
            "4096,8192",
            "--dim",
            "8",
            "--ids",
            "64",
            "--steps",
            "4",
            "--phases",
            "run,breakdown",
            "--breakdown-mb",
            "1,2",
            "--breakdown-ids",
            "64",
            "--breakdown-steps",
            "3",
            "--breakdown-full-steps",
            "2",
            "--breakdown-max-chain",
            "2",
            "--breakdown-fold-max-deltas",
            "2",
            "--breakdown-restore-reps",
            "1",
            "--json",
            OUT,
        ),
        ("args", "warm", "sizes", "doubling", "targets", "breakdown"),
    ),
    "commit_gpu": Smoke(
        (
            "--device",
            "cpu",
            "--table-gib",
            "0.001",
            "--dim",
            "16",
            "--ids",
            "64",
            "--steps",
            "4",
            "--dense-ms",
            "0",
            "--phases",
            "run,breakdown",
            "--d2h-mib",
            "1",
            "--json",
            OUT,
        ),
        ("args", "baseline", "commit", "restore", "breakdown"),
    ),
    "commit_torchrec": Smoke(
        ("--table-mb", "1", "--dim", "8", "--ids", "32", "--steps", "4", "--json", OUT),
        ("args", "baseline", "commit", "restore"),
        needs=("torchrec",),
    ),
    "d2h_overlap": Smoke(
        ("--device", "cpu", "--copy-mb", "4", "--reps", "1", "--json", OUT), ("copy_bytes", "host_checksum", "threads")
    ),
    "drill_matrix": Smoke(
        ("--presets", "scale-down", "--modes", "restart", "--timeout", "150", "--out", OUT),
        ("modes", "rows"),
        timeout=240.0,
    ),
    "drill_recovery": Smoke(
        ("--scenarios", "scale-down", "--runs", "1", "--backends", "elastic_emb", "--out", OUT),
        ("summary", "runs"),
        timeout=240.0,
    ),
    "ep8": Smoke(
        ("--mb", "1", "--runs", "1", "--timeout", "120", "--json", OUT),
        ("agree_s", "rebuild_s", "alltoall_gbps_per_rank", "shrink_8_to_4", "grow_4_to_8"),
    ),
    "etcd_calls": Smoke(
        ("--runs", "1", "--calls", "5", "--out", OUT), ("samples", "medians", "ratios_to_urllib"), needs=("etcd",)
    ),
    "hang": Smoke(
        ("--runs", "1", "--modes", "restart", "--hang-timeout", "3", "--no-baseline", "--cap", "90", "--out", OUT),
        ("args", "raw", "summary"),
        timeout=300.0,
    ),
    "lookup": Smoke(
        (
            "--ranks",
            "1",
            "2",
            "--rows",
            "4096",
            "--dim",
            "8",
            "--batch",
            "256",
            "--runs",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--in-flight",
            "--compare-capture",
            "--out",
            OUT,
        ),
        ("device", "config", "results"),
    ),
    "lookup_one_gpu": Smoke(
        (
            "--device",
            "cpu",
            "--rows",
            "4096",
            "--dim",
            "8",
            "--batch",
            "256",
            "--runs",
            "1",
            "--iters",
            "2",
            "--matmul",
            "32",
            "--out",
            OUT,
        ),
        (
            "exact_vs_index_select",
            "copy_bound_s",
            "lookup_back_to_back_s",
            "fraction_of_copy_bound",
            "prefetch",
            "targets",
        ),
    ),
    "nccl_setup": Smoke(
        ("--configs", "default", "--trials", "2", "--mib", "1", "--out", OUT),
        stdout="needs 2 CUDA devices; none measured",
    ),
    "reshard": Smoke(("--sizes-mb", "1", "--runs", "1", "--json", OUT), ("device", "world", "results")),
    "resize": Smoke(
        ("--runs", "1", "--backends", "elastic_emb", "--cap", "60", "--out", OUT),
        ("raw_s", "median_s", "pause_median_s", "import_floor_s"),
        timeout=240.0,
    ),
    # the README's example on two agents in process (join, SIGKILL of a node, rejoin), a 4096-row table
    "resize-readme": Smoke(
        ("--scenario", "readme", "--runs", "1", "--user-rows", "4096", "--cap", "60", "--out", OUT),
        ("raw_s", "summary_s", "reform_phases_median_s"),
        timeout=240.0,
        script="resize",
    ),
    "resize_gpu": Smoke(
        (
            "--device",
            "cpu",
            "--rows",
            "4096",
            "--dim",
            "8",
            "--batch",
            "64",
            "--runs",
            "2",
            "--restart-runs",
            "1",
            "--out",
            OUT,
        ),
        ("runs", "median", "raw_median_s", "restart_median_s"),
    ),
    "shm_landing": Smoke(
        ("--device", "cpu", "--mib", "4", "--threads", "2", "--runs", "1", "--json", OUT),
        ("copy_fresh_ms", "fallocate_ms", "copy_populated_ms", "fallocate_parallel_each_ms"),
    ),
    # --timeout is the context's, which also bounds each rank's first construction, a wait for the
    # other rank's process to get there (its torch import: seconds apart on a loaded machine)
    "teardown": Smoke(
        ("--device", "cpu", "--runs", "1", "--rows", "4096", "--timeout", "30", "--out", OUT), ("teardown", "rebuild")
    ),
}
WORKERS = 3  # benches at a time (they mostly wait; more would fight over two cores)


def bench_scripts() -> list[str]:
    """The bench scripts: every bench/*.py but the private helper modules (``_*.py``)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def script_of(name: str) -> str:
    """The bench script smoke run ``name`` runs (a bench may have more than one smoke run)."""
    return SMOKES[name].script or name


def test_every_bench_script_has_a_smoke_run():
    """A new bench joins the smoke runs below, or this fails (and a removed one leaves them)."""
    assert sorted({script_of(n) for n in SMOKES}) == bench_scripts()


@dataclass
class Ran:
    name: str
    returncode: int | None  # None: killed at its timeout
    output: str  # stdout and stderr, interleaved
    seconds: float
    report: Path


def _missing(smoke: Smoke) -> str | None:
    if "torchrec" in smoke.needs and importlib.util.find_spec("torchrec") is None:
        return "needs the torchrec extra (make .venv/.torchrec)"
    if "etcd" in smoke.needs and etcd_binary() is None:
        return "needs etcd (Debian package etcd-server)"
    return None


def run_bench(name: str, out_dir: Path) -> Ran:
    """Run bench ``name`` at its smoke setting in its own session; past its timeout the whole
    session gets SIGTERM (a drill stops what it started), then SIGKILL."""
    smoke = SMOKES[name]
    report = out_dir / f"{name}.json"
    argv = [sys.executable, str(BENCH / f"{script_of(name)}.py"), *(str(report) if a == OUT else a for a in smoke.argv)]
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "ELASTIC_EMB_LOG_LEVEL": "warning",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=out_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=smoke.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        output, _ = proc.communicate()
        code = None
    return Ran(name, code, output or "", time.monotonic() - t0, report)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected benches, started side by side (the longest first), ``WORKERS`` at a time.
    Under pytest-xdist each test runs its own bench instead (every worker sees every item)."""
    names = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and getattr(item, "callspec", None) is not None
    ]
    names = sorted((n for n in names if _missing(SMOKES[n]) is None), key=lambda n: -SMOKES[n].timeout)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield {}
        return
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="bench-smoke")
    futures = {n: pool.submit(run_bench, n, tmp_path_factory.mktemp(f"bench-{n}")) for n in names}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_bench_runs_and_reports(name, runs, tmp_path):
    smoke = SMOKES[name]
    reason = _missing(smoke)
    script = f"bench/{script_of(name)}.py" + (f" ({name})" if smoke.script else "")
    if reason:
        pytest.skip(f"{script} {reason}")
    ran = runs[name].result() if name in runs else run_bench(name, tmp_path)
    tail = ran.output[-6000:]
    assert ran.returncode is not None, f"{script} did not finish within {smoke.timeout:g} s:\n{tail}"
    assert ran.returncode == 0, f"{script} exited {ran.returncode} after {ran.seconds:.0f} s:\n{tail}"
    if smoke.stdout is not None:
        assert smoke.stdout in ran.output, f"{script} did not say {smoke.stdout!r}:\n{tail}"
    if not smoke.keys:
        return
    assert ran.report.is_file(), f"{script} wrote no report at {ran.report}:\n{tail}"
    doc = json.loads(ran.report.read_text())
    assert doc["bench"] == script_of(name) and {"date", "python", "torch"} <= set(doc["meta"]), doc.get("meta")
    missing = [k for k in smoke.keys if k not in doc]
    assert not missing, f"{script}'s report lacks {missing}; it has {sorted(doc)}"
    check = VERDICTS.get(name)
    if check is not None:
        check(doc)


def _drill_matrix(doc: dict) -> None:
    assert [r["result"] for r in doc["rows"]] == ["PASS"], doc["rows"]


def _drill_recovery(doc: dict) -> None:
    assert doc["runs"] and all(r["ok"] for r in doc["runs"]), doc["runs"]
    assert doc["summary"][0]["recovery_s"] is not None, doc["summary"]


def _lookup(doc: dict) -> None:
    assert [r["world_size"] for r in doc["results"]] == [1, 1, 2, 2], doc["results"]  # eager and captured dedup
    assert all(r["lookup_rows_per_s"] > 0 and r["lookup_in_flight_s"] for r in doc["results"])


def _lookup_one_gpu(doc: dict) -> None:
    assert doc["exact_vs_index_select"] is True
    assert len(doc["prefetch"]) == 2 and doc["device"] == "cpu"


def _commit(doc: dict) -> None:
    """The run's figures are there for both sizes (never their values: timings are not asserted)."""
    assert [s["rows"] for s in doc["sizes"]] == [4096, 8192], doc["sizes"]
    for s in doc["sizes"]:
        assert s["baseline"]["steps"] == s["commit"]["steps"] == 4, s
        assert {"mean_ms", "median_ms", "p99_ms", "max_ms", "mean_over_baseline"} <= set(s["commit"]), s["commit"]
        # the last step: two untimed warm-up steps, then the four timed ones
        assert s["restore"]["restored_step"] == 5 and s["restore"]["read_chain_s"] is not None, s["restore"]
    assert [(d["rows_a"], d["rows_b"]) for d in doc["doubling"]] == [(4096, 8192)], doc["doubling"]
    assert [r["size_mb_per_rank"] for r in doc["breakdown"]["rows"]] == [1, 2], doc["breakdown"]


def _commit_gpu(doc: dict) -> None:
    assert doc["capture_path"] == "host" and doc["device"] == "cpu"
    assert doc["baseline"]["steps"] == doc["commit"]["steps"] == 4, doc
    assert {"mean_ms", "p99_ms", "max_ms", "mean_over_baseline"} <= set(doc["commit"]), doc["commit"]
    assert doc["restore"]["restored_step"] == 5, doc["restore"]  # two warm-up steps, four timed
    assert {"d2h_gbs", "dcp_async_save_complete_s"} <= set(doc["breakdown"]), doc["breakdown"]


def _commit_torchrec(doc: dict) -> None:
    assert doc["baseline"]["steps"] == doc["commit"]["steps"] == 4, doc
    assert {"mean_ms", "p99_ms", "max_ms", "mean_over_baseline"} <= set(doc["commit"]), doc["commit"]
    assert doc["restore"]["restored_step"] == 5, doc["restore"]  # two warm-up steps, four timed


def _resize(doc: dict) -> None:
    assert set(doc["raw_s"]["elastic_emb"]) == {"scale_up", "scale_down_sigterm", "scale_down_sigkill"}


def _resize_readme(doc: dict) -> None:
    # every resize of the run happened (a figure is null when it did not within --cap); no timing is checked
    assert doc["scenario"] == "readme" and doc["runs_done"] == 1, doc.get("notes")
    per_run = {m: v for m, v in doc["raw_s"].items() if m != "any_join_pause"}  # that one pools both joins
    missing = [m for m, v in per_run.items() if len(v) != 1 or v[0] is None]
    assert not missing, f"no figure for {missing}: {doc['notes']}"
    assert set(doc["reform_phases_median_s"]) == {"join", "kill", "rejoin"}


def _resize_gpu(doc: dict) -> None:
    assert len(doc["runs"]) == 2 and all(r["path_s"] > 0 for r in doc["runs"])


def _reshard(doc: dict) -> None:
    [row] = doc["results"]
    assert {"rebuild_s", "live_s", "snap_restore_s", "durable_restore_s", "dcp_s"} <= set(row["median_s"]), row


def _teardown(doc: dict) -> None:
    assert {(r["scenario"], r["mode"]) for r in doc["teardown"]} == {
        (s, m) for s in ("healthy", "broken") for m in ("shutdown", "abort")
    }


VERDICTS = {
    "commit": _commit,
    "drill_matrix": _drill_matrix,
    "drill_recovery": _drill_recovery,
    "lookup": _lookup,
    "lookup_one_gpu": _lookup_one_gpu,
    "commit_gpu": _commit_gpu,
    "commit_torchrec": _commit_torchrec,
    "resize": _resize,
    "resize-readme": _resize_readme,
    "resize_gpu": _resize_gpu,
    "reshard": _reshard,
    "teardown": _teardown,
}
