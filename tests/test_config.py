"""elastic_emb.config: every ELASTIC_EMB_* variable the code, the tests or the deploy files name is
declared, bad values fail in one line naming the variable, and the table in docs/CONFIG.md is the
generated one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_emb import config
from elastic_emb.errors import ConfigError, TopologyError
from elastic_emb.topology import Topology

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"ELASTIC_EMB_[A-Z][A-Z_]*[A-Z]")


def test_every_variable_named_in_the_repository_is_declared():
    named = set()
    for folder in ("elastic_emb", "tests", "bench", "deploy", "examples"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".yaml", ".yml", ".sh", ".md", ".txt", ""):
                named |= set(NAME.findall(path.read_text(errors="replace")))
    named -= {"ELASTIC_EMB_STATEDIR", "ELASTIC_EMB_RDZV"}  # the typo config.py's docstring cites; a prefix
    assert sorted(named - set(config.VARIABLES)) == []


def test_docs_table_is_generated_from_the_settings():
    page = (REPO / "docs" / "CONFIG.md").read_text()
    block = page.split("<!-- config-table:begin -->\n", 1)[1].split("\n<!-- config-table:end -->", 1)[0]
    assert block == config.markdown_table(), (
        "docs/CONFIG.md is stale: paste `python -m elastic_emb.config` between the markers"
    )


def test_values_are_typed_and_defaults_apply():
    s = config.load(
        {
            "ELASTIC_EMB_GENERATION": "3",
            "ELASTIC_EMB_DRAIN": "0",
            "ELASTIC_EMB_LOG_LEVEL": "WARNING",
            "ELASTIC_EMB_MEMBERSHIP": '["a", "b"]',
            "ELASTIC_EMB_DURABLE_DIR": "",
            "PATH": "/bin",
        }
    )
    assert (s.generation, s.drain, s.log_level, s.nodes()) == (3, False, "warning", ["a", "b"])
    assert (s.state_dir, s.durable_dir, s.watch_interval) == ("/dev/shm/elastic_emb", None, 0.1)  # "" is unset


@pytest.mark.parametrize(
    "var,value,fragment",
    [
        ("ELASTIC_EMB_WATCH_INTERVAL", "fast", "ELASTIC_EMB_WATCH_INTERVAL='fast' is not a number"),
        ("ELASTIC_EMB_STORE_OUTAGE_TIMEOUT", "-1", "ELASTIC_EMB_STORE_OUTAGE_TIMEOUT='-1' must be > 0"),
        ("ELASTIC_EMB_TRANSPORT", "rdma", "ELASTIC_EMB_TRANSPORT='rdma' is not one of 'cma', 'p2p' or 'alltoall'"),
        ("ELASTIC_EMB_DRAIN", "yes please", "ELASTIC_EMB_DRAIN='yes please' is not 1 or 0"),
        ("ELASTIC_EMB_MEMBERSHIP", '{"a": 1}', "ELASTIC_EMB_MEMBERSHIP='{\"a\": 1}' is not a JSON list of node ids"),
        ("ELASTIC_EMB_NODE_ID", "../x", "ELASTIC_EMB_NODE_ID='../x' has the wrong form"),
        ("ELASTIC_EMB_AGENT_PID", "0", "ELASTIC_EMB_AGENT_PID='0' must be >= 1"),
        ("ELASTIC_EMB_STATEDIR", "/tmp", "ELASTIC_EMB_STATEDIR is not an elastic_emb setting"),
    ],
)
def test_bad_values_fail_in_one_line_naming_the_variable(var, value, fragment):
    with pytest.raises(ConfigError) as info:
        config.load({var: value})
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


def test_a_reader_of_some_variables_ignores_bad_others():
    env = {"ELASTIC_EMB_LOG_LEVEL": "loud", "ELASTIC_EMB_GENERATION": "2"}
    assert config.load(env, "generation").generation == 2
    with pytest.raises(ConfigError, match="ELASTIC_EMB_LOG_LEVEL='loud' is not one of"):
        config.load(env)


def test_topology_reports_its_variables_as_topology_errors():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "ELASTIC_EMB_GENERATION": "-2",
        "ELASTIC_EMB_BACKEND": "gloo",
    }
    with pytest.raises(TopologyError, match="ELASTIC_EMB_GENERATION='-2' must be >= 0"):
        Topology.from_env(env)
    assert Topology.from_env({**env, "ELASTIC_EMB_GENERATION": "4"}).generation == 4
