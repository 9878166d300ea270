"""The command line's failures: each one a user can cause ends in ONE line on stderr that names the
input and a remedy, with the documented exit code, and no Python or C++ stack unless --debug.

Each case runs the real ``elastic-emb`` entry point in a subprocess (the stack, torch's C++ frames
and the exit code are what a user sees), against real sockets on loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic_emb.cli.console import EXIT_USAGE
from elastic_emb.testing.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTIC_EMB_", "TORCHELASTIC_"))}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", "from elastic_emb.cli.main import entry_point; entry_point()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=base,
    )


def _one_line(r: subprocess.CompletedProcess, *needles: str, code: int = EXIT_USAGE) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_bad_yaml_scenario_names_file_line_and_remedy(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nfaults:\n  - kind: join\n    at_step: [1\n")
    line = _one_line(_cli("drill", "--scenario", str(bad)), str(bad), "not valid YAML", "line ", "fix the file")
    assert line.startswith("elastic-emb drill: error:")


def test_invalid_scenario_fields_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  - {kind: explode, at_step: 1}\nbogus: 2\n")
    _one_line(_cli("drill", "--scenario", str(bad)), "is invalid", "faults.0.kind", "bogus")


@pytest.mark.parametrize("inner", ["c10d", "etcd-v2"])
def test_rdzv_state_with_nothing_listening(inner):
    port = free_port()
    _one_line(
        _cli("rdzv-state", "--endpoint", f"127.0.0.1:{port}", "--run-id", "x", "--inner", inner),
        f"nothing listens at 127.0.0.1:{port}",
        "--endpoint",
    )


@pytest.mark.slow
def test_rdzv_state_against_something_that_is_not_a_store():
    """Something accepts the connection but never answers like a store: bounded, one line."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def accept_and_drop():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=accept_and_drop, daemon=True)
    t.start()
    try:
        r = _cli("rdzv-state", "--endpoint", f"127.0.0.1:{port}", "--run-id", "x", "--connect-timeout", "2")
    finally:
        stop.set()
        t.join(5)
        srv.close()
    _one_line(r, f"127.0.0.1:{port}")


def test_bad_endpoint_syntax_and_unknown_host():
    _one_line(_cli("rdzv-state", "--endpoint", "no-port-here", "--run-id", "x"), "write HOST:PORT")
    _one_line(_cli("rdzv-state", "--endpoint", "host.invalid:29400", "--run-id", "x"), "cannot resolve host")


def test_drain_with_an_unreachable_store_prints_one_json_line():
    port = free_port()
    r = _cli("drain", "--endpoint", f"127.0.0.1:{port}", "--connect-timeout", "0.5")
    line = _one_line(r, f"127.0.0.1:{port}", "drain_failed")
    import json

    assert json.loads(line)["level"] == "error"


def test_state_dir_that_does_not_exist():
    _one_line(_cli("state", "--state-dir", "/nonexistent"), "/nonexistent", "does not exist", "--state-dir")


def test_state_run_that_does_not_exist(tmp_path):
    (tmp_path / "other-run").mkdir()
    _one_line(_cli("state", "--state-dir", str(tmp_path), "--run-id", "mine"), "no run 'mine'", "other-run")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["drill", "--bogus"], ["No such option '--bogus'", "--help"]),
        (["drill", "--network", "sideways", "--scenario", "demo"], ["'sideways' is not one of"]),
        (["no-such-command"], ["No such command"]),
        (["drill", "--scenario", "nope"], ["neither a preset", "scale-up"]),
        (
            ["drill", "--scenario", "demo", "--script", "/nonexistent/train.py"],
            ["--script /nonexistent/train.py", "no such file"],
        ),
        (["drill", "--scenario", "demo", "--out", "/proc/1/elastic-emb-out"], ["--out /proc/1/elastic-emb-out"]),
    ],
)
def test_bad_options_and_paths(args, needles):
    _one_line(_cli(*args), *needles)


def test_user_errors_stay_one_line_with_debug():
    r = _cli("--debug", "state", "--state-dir", "/nonexistent")
    assert (
        r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1
    )  # --debug shows stacks of bugs, not of user errors
    r = _cli("rdzv-state", "--endpoint", "127.0.0.1:1", "--run-id", "x", env={"ELASTIC_EMB_DEBUG": "1"})
    assert r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1


def test_internal_errors_are_one_line_unless_debug(tmp_path):
    """A bug (here: an unexpected exception inside a command) is one line naming --debug; with
    --debug the stack is shown."""
    code = (
        "import click, sys\n"
        "from elastic_emb.cli.console import run_command\n"
        "@click.command()\n"
        "def boom():\n"
        "    raise KeyError('surprise')\n"
        "run_command(boom, sys.argv[1:], prog_name='t')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_EMB_DEBUG"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 70 and len(r.stderr.strip().splitlines()) == 1 and "--debug" in r.stderr
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**env, "ELASTIC_EMB_DEBUG": "1"}
    )
    assert "Traceback" in r.stderr and "KeyError" in r.stderr


def test_example_path_is_the_packaged_script():
    r = _cli("example-path")
    path = Path(r.stdout.strip())
    assert (
        r.returncode == 0
        and path.is_file()
        and path.parent.name == "examples"
        and path.parent.parent.name == "elastic_emb"
    )


def test_rdzv_conf_refuses_unknown_keys_listing_the_valid_ones():
    from elastic_emb.rdzv.conf import ListenerConfig

    with pytest.raises(ValueError) as err:
        ListenerConfig.from_params({"inner": "c10d", "join_timeout": "30", "timeout": 900, "bogus_key": "1"})
    msg = str(err.value)
    assert "bogus_key=1" in msg and "unknown key" in msg and "\n" not in msg
    for valid in ("drain_timeout", "store_outage_timeout", "inner", "join_timeout", "keep_alive_interval", "is_host"):
        assert valid in msg
    # Every key the project's own templates and drills pass is accepted.
    ListenerConfig.from_params(
        {
            "inner": "c10d",
            "join_timeout": "900",
            "last_call_timeout": "10",
            "close_timeout": "5",
            "keep_alive_interval": "2",
            "keep_alive_max_attempt": "5",
            "drain_timeout": "60",
            "read_timeout": "60",
            "is_host": "true",
            "timeout": 900,
        }
    )


@pytest.mark.slow
def test_torchrun_with_a_typo_in_rdzv_conf_names_it(tmp_path):
    """The real launcher: the agent refuses to start, and its error names the key."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--rdzv-backend=elastic_emb",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-conf=is_host=1,bogus_key=1",
            "-m",
            "elastic_emb.examples.recsys",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode != 0
    assert "--rdzv-conf bogus_key=1: unknown key" in r.stderr and "drain_timeout" in r.stderr, r.stderr[-3000:]
