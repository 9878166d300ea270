"""Bad input is refused in one line, naming the value and the range, and creates nothing.

The ``--rdzv-conf`` values (elastic_emb's keys and torch's), the run id (the agent, the CLI), the
examples' options and the event file's directory; the slow case runs stock torchrun with each bad
value and reads what a user sees: exit 1, one line, no stack.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_emb import RendezvousConfigError
from elastic_emb.examples.loop import loop_parser
from elastic_emb.examples.recsys import Config
from elastic_emb.rdzv.conf import ListenerConfig, check_run_id
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT
from tests.test_cli import _cli, _one_line

BAD_CONF = [
    ({"drain_timeout": "inf"}, r"drain_timeout='inf': Input should be a finite number"),
    ({"drain_timeout": "1e308"}, r"drain_timeout='1e308': Input should be less than or equal to 86400"),
    ({"sync_interval": "nan"}, r"sync_interval='nan': Input should be a finite number"),
    ({"keep_alive_interval": "-1"}, r"keep_alive_interval='-1': Input should be greater than 0"),
    ({"keep_alive_interval": "1e20"}, r"keep_alive_interval='1e20': Input should be less than or equal to 3600"),
    ({"join_timeout": "nan"}, r"join_timeout='nan': Input should be a finite number"),
    ({"last_call_timeout": "0"}, r"last_call_timeout='0': Input should be greater than 0"),
    ({"keep_alive_max_attempt": "2.5"}, r"keep_alive_max_attempt='2.5': Input should be a valid integer"),
    ({"is_host": "maybe"}, r"is_host='maybe': Input should be a valid boolean"),
    ({"drain": "maybe"}, r"drain='maybe': use 1 or 0"),
    ({"resize": "sideways"}, r"resize='sideways': Input should be 'restart' or 'in_process'"),
    ({"bogus": "1"}, r"bogus=1: unknown key for --rdzv-backend=elastic_emb"),
]


@pytest.mark.parametrize(
    ("conf", "message"), BAD_CONF, ids=[next(iter(c)) + "=" + next(iter(c.values())) for c, _ in BAD_CONF]
)
def test_a_bad_rdzv_conf_value_is_refused_naming_the_key_value_and_range(conf, message, monkeypatch):
    monkeypatch.delenv("ELASTIC_EMB_DEBUG", raising=False)
    with pytest.raises(RendezvousConfigError, match=message) as info:
        ListenerConfig.from_params({"timeout": 900, **conf})
    # a ValueError for callers, a SystemExit (printed as its one line) under torchrun
    assert isinstance(info.value, ValueError) and isinstance(info.value, SystemExit)
    assert info.value.code == str(info.value)  # what Python prints, exit status 1 (None: 0, silently)
    assert "\n" not in str(info.value) and str(info.value).startswith("elastic_emb rendezvous: ")


def test_with_debug_set_a_bad_value_is_a_plain_value_error_whose_stack_torchrun_prints(monkeypatch):
    monkeypatch.setenv("ELASTIC_EMB_DEBUG", "1")
    with pytest.raises(ValueError, match=r"keep_alive_interval='-1'") as info:
        ListenerConfig.from_params({"keep_alive_interval": "-1"})
    assert not isinstance(info.value, SystemExit)


def test_good_values_of_torchs_keys_pass():
    cfg = ListenerConfig.from_params(
        {
            "timeout": 900,
            "join_timeout": "600",
            "last_call_timeout": "1",
            "keep_alive_interval": "5",
            "keep_alive_max_attempt": "3",
            "is_host": "true",
            "drain_timeout": "0",
        }
    )
    assert cfg.drain_timeout == 0.0


def test_an_event_file_in_a_missing_directory_is_refused_and_no_directory_is_made(tmp_path):
    target = tmp_path / "nope" / "deeper" / "events.jsonl"
    with pytest.raises(RendezvousConfigError, match=r"event_file=.*its directory does not exist"):
        ListenerConfig.from_params({"event_file": str(target)})
    assert not (tmp_path / "nope").exists()
    assert ListenerConfig.from_params({"event_file": str(tmp_path / "events.jsonl")}).event_file


@pytest.mark.parametrize("run_id", ["../../etc", "a/b", "x" * 10_000, "\u00b2", ".hidden", "run\n", ""])
def test_a_run_id_that_is_not_a_plain_name_is_refused(run_id):
    with pytest.raises(RendezvousConfigError, match=r"--rdzv-id .* is not a plain name"):
        check_run_id(run_id)


def test_plain_run_ids_pass():
    for run_id in ("job-1", "a.b_c", "x" * 128):
        assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["../../etc", "a/b", "x" * 10_000, "\u00b2"])
def test_the_state_command_refuses_a_bad_run_id_in_one_line(run_id, tmp_path):
    line = _one_line(
        _cli("state", "--run-id", run_id, "--state-dir", str(tmp_path)),
        "Invalid value for --run-id",
        "is not a plain name",
    )
    assert len(line) < 400


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "-5"], "argument --steps: -5 is outside [1, "),
        (["--steps", "x"], "argument --steps: 'x' is not a whole number"),
        (["--batch", "0"], "argument --batch: 0 is outside [1, "),
        (["--step-delay", "nan"], "argument --step-delay: nan is outside [0, 86400] seconds"),
        (["--drain-timeout", "inf"], "argument --drain-timeout: inf is outside [0, 86400] seconds"),
        (["--seed", "-1"], "argument --seed: -1 is outside [0, "),
    ],
)
def test_the_examples_refuse_bad_options_in_one_line(argv, message, capsys, tmp_path):
    parser = loop_parser("recsys", Config())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--out", str(tmp_path), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert parser.parse_args(["--out", str(tmp_path), "--steps", "1", "--seed", "0"]).steps == 1


TORCHRUN_CASES = {
    "keep_alive_interval": (
        "keep_alive_interval=-1",
        "test",
        "keep_alive_interval='-1': Input should be greater than 0",
    ),
    "drain_timeout": ("drain_timeout=inf", "test", "drain_timeout='inf': Input should be a finite number"),
    "resize": ("resize=sideways", "test", "resize='sideways': Input should be 'restart' or 'in_process'"),
    "unknown_key": ("drian=1", "test", "drian=1: unknown key for --rdzv-backend=elastic_emb"),
    "run_id": ("drain=1", "../../etc", "--rdzv-id '../../etc' is not a plain name"),
    "event_file": ("event_file={tmp}/nope/events.jsonl", "test", "its directory does not exist"),
}


def _torchrun_refusal(conf, run_id, endpoint, cwd):
    """Stock torchrun with ``--rdzv-backend=elastic_emb``: the last line of its stderr, once it
    exited 1 with no stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "ELASTIC_EMB_DEBUG"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, env.get("PYTHONPATH")) if p)  # this checkout
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--rdzv-backend=elastic_emb",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            "--local-addr=127.0.0.1",
            "-m",
            "json.tool",  # never started: the agent stops first
            os.devnull,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )
    assert ran.returncode == 1, (ran.returncode, ran.stderr[-3000:])
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    return ran.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TORCHRUN_CASES))
def test_torchrun_stops_on_bad_input_with_one_line_and_no_stack(case, tmp_path):
    conf, run_id, message = TORCHRUN_CASES[case]
    last = _torchrun_refusal(conf.format(tmp=tmp_path), run_id, f"127.0.0.1:{free_port()}", tmp_path)
    assert last.startswith("elastic_emb rendezvous: ") and message in last, last
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("digits", ["\u00b2", "\u0661\u0662", "\uff11\uff12"])  # superscript, Arabic-Indic, fullwidth
def test_numbers_read_from_input_are_ascii_digits_only(digits):
    # str.isdigit() is true for these, and int() then fails (or reads a non-ASCII number): each
    # parser refuses them as it refuses any other malformed value, without a raw exception
    from elastic_emb.cli.console import UserError
    from elastic_emb.cli.main import probe_endpoint
    from elastic_emb.rdzv.etcd_v3 import _token
    from elastic_emb.rdzv.etcd_v3_client import parse_endpoints

    assert _token(digits) is None and _token(digits.encode()) is None
    with pytest.raises(ValueError, match=r"must be HOST:PORT"):
        parse_endpoints(f"127.0.0.1:{digits}")
    with pytest.raises(UserError, match=r"write HOST:PORT"):
        probe_endpoint(f"127.0.0.1:{digits}", "--endpoint", 1.0)
