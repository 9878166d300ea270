"""Every ``ELASTIC_EMB_*`` environment variable, declared once: its type, default and meaning.

Modules read settings through :func:`load` (``load(env).state_dir``, or ``load(env, "generation")``
for some variables only), never ``os.environ`` directly. :func:`load` validates the environment
and turns a bad value, or an undeclared ``ELASTIC_EMB_*`` name (a typo such as
``ELASTIC_EMB_STATEDIR``), into one :class:`~elastic_emb.errors.ConfigError` line.
``python -m elastic_emb.config`` prints the table of variables in ``docs/CONFIG.md`` (:func:`markdown_table`).

Design: ``docs/CORE.md`` (section "Settings").
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from elastic_emb.errors import ConfigError

PREFIX = "ELASTIC_EMB_"


def _setting(default, meaning: str, set_by: Literal["user", "agent", "tests"] = "user", **constraints):
    return Field(default, description=meaning, json_schema_extra={"set_by": set_by}, **constraints)


class Settings(BaseModel):
    """The ``ELASTIC_EMB_*`` variables (field ``state_dir`` is ``ELASTIC_EMB_STATE_DIR``).

    Frozen. Each field's description is its meaning; ``json_schema_extra["set_by"]`` says who
    sets it (``user``, ``agent`` for the elastic_emb rendezvous backend, or ``tests``). Build it
    with :func:`load`, which reads the environment: a plain model, since what ``load`` adds (a
    given mapping, a subset of the variables, the check for undeclared names, one-line errors)
    is what an environment source would have to be customised for.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    # -- set by the user ---------------------------------------------------------------------
    state_dir: str = _setting(
        "/dev/shm/elastic_emb", "root of the node-local snapshots (`<dir>/<run_id>/<node id>/`)", min_length=1
    )
    durable_dir: str | None = _setting(
        None, "root of the durable checkpoints (DCP); unset: no durable tier", min_length=1
    )
    node_id: str | None = _setting(
        None, "this node's stable name for its snapshots; unset: the host name", pattern=r"^[^/\x00]+$"
    )
    ep_size: int | None = _setting(
        None, "ranks that own rows (a power of two); unset: the largest power of two <= world size", ge=1
    )
    backend: Literal["nccl", "gloo"] | None = _setting(
        None, "communicator backend; unset: nccl when CUDA is available, else gloo"
    )
    transport: Literal["cma", "p2p", "alltoall"] | None = _setting(
        None, "how restored rows move between ranks; unset: cma on the CPU, alltoall on GPUs"
    )
    log_format: Literal["json", "console"] | None = _setting(
        None, "log rendering; unset: console on a terminal, else JSON lines"
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = _setting(
        None, "lowest level of the events logged; unset: info (`elastic-emb drill` and `demo`: warning)"
    )
    etcd: str | None = _setting(
        None, "path of the etcd binary for drills and tests; unset: `etcd` on PATH", min_length=1
    )
    job_secret: SecretStr | None = _setting(
        None,
        "secret that signs the rendezvous control keys (the same on every "
        "node, e.g. `openssl rand -hex 32`); unset: unsigned",
    )
    job_fingerprint: str | None = _setting(
        None,
        "what makes this node's job the job (the same on every node, e.g. a config hash); an agent whose "
        "value differs from the running job's is refused; unset: the worker command and a digest of its script",
        min_length=1,
        max_length=1024,
    )
    metrics_port: int | None = _setting(
        None,
        "serve Prometheus `/metrics` on this port (agent; worker of local rank r: port + 1 + r); unset: off",
        ge=1,
        le=65535,
    )
    metrics_addr: str = _setting("0.0.0.0", "the address the metrics endpoints bind", min_length=1)
    debug: bool = _setting(
        False,
        "1: the CLI shows Python and C++ stacks on errors, and the rendezvous backend the stack of a refused `--rdzv-conf`",
    )
    nonfinite_gradients: Literal["raise", "skip"] = _setting(
        "raise",
        "NaN/inf gradients in `apply_gradients`: `raise` refuses the call (no row changes), `skip` "
        "updates the other rows and counts the skipped ones in an event",
    )
    native_cache: str | None = _setting(
        None,
        "where the example native context's compiled extension is cached; unset: `~/.cache/elastic_emb/native_context`",
        min_length=1,
    )
    progress_after: float = _setting(
        2.0,
        "seconds long work (restore, reshard, base write, durable save or load, drain) runs before it reports "
        "progress: a `progress` event a second, and a bar on a terminal; 0: from the start",
        ge=0,
        le=86400,
    )
    # -- set by the elastic_emb rendezvous backend in every worker -------------------------------
    generation: int = _setting(
        0,
        "the topology's generation: the rendezvous round; with `resize=in_process`, the "
        "round plus the run's in-process high-water mark (never reused after a fallback)",
        "agent",
        ge=0,
    )
    rdzv_round: int | None = _setting(
        None,
        "the rendezvous round the worker was started in (its watcher's round keys); unset: the generation",
        "agent",
        ge=0,
    )
    rdzv_backend: Literal["c10d", "etcd-v2", "etcd-v3"] | None = _setting(
        None, "the inner rendezvous backend, for the watcher", "agent"
    )
    etcd_options: str | None = _setting(
        None,
        "inner=etcd-v3: the agent's etcd client options (JSON, no secrets: "
        "TLS file paths, user, password file), for the watcher",
        "agent",
    )
    rdzv_endpoint: str | None = _setting(
        None,
        "the rendezvous endpoint HOST:PORT, for the watcher and `elastic-emb drain`",
        "agent",
        pattern=r"^\S+:\d{1,5}$",
    )
    rdzv_node: str | None = _setting(
        None, "this agent's node in the rendezvous (`addr_pid_localid`)", "agent", min_length=1
    )
    membership: str | None = _setting(None, "JSON list of the round's node ids, index = group rank", "agent")
    agent_pid: int | None = _setting(None, "the agent's pid (a worker that outlives it is an orphan)", "agent", ge=1)
    drain: bool = _setting(
        True, "1: the agent drains the workers before a scale-up; 0: it restarts them at once", "agent"
    )
    watch_interval: float = _setting(0.1, "the watcher's polling interval, seconds", "agent", gt=0, le=60)
    store_outage_timeout: float = _setting(
        30.0, "how long an unreachable store counts as an outage, not a loss, seconds", "agent", gt=0, le=3600
    )
    joiner: bool = _setting(
        False,
        "1: this worker's node joined a running world (resize=in_process): it waits to "
        "be included by the running workers instead of starting a world",
        "agent",
    )
    drain_count_file: str | None = _setting(
        None,
        "the file in the agent's private directory where the watchers write the drain's count for their agent "
        "(a copy of the round's world_size that no store writer can delete)",
        "agent",
        min_length=1,
    )
    progress_file: str | None = _setting(
        None,
        "the prefix of the files where each worker shows its agent's hang watchdog that it makes progress "
        "(`<prefix>-<local rank>.json`)",
        "agent",
        min_length=1,
    )
    resize: Literal["restart", "in_process"] = _setting(
        "restart",
        "how the workers follow a membership change: `restart` (the agent restarts them) or `in_process` "
        "(the survivors re-form in the running processes)",
        "agent",
    )
    # -- tests and drills ------------------------------------------------------------------------
    fault: str | None = _setting(
        None,
        "crash at a named fault point, `<name>[@<step>]` (tests and drills only)",
        "tests",
        pattern=r"^[A-Za-z0-9_.-]+(@\d+)?$",
    )
    failed_drills: str = _setting(
        "/tmp/elastic_emb-failed-drills", "where the drill tests keep a failed drill's output", "tests", min_length=1
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.lower() if isinstance(v, str) else v

    @field_validator("membership")
    @classmethod
    def _node_list(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            nodes = json.loads(v)
        except ValueError:
            raise ValueError("is not JSON") from None
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ValueError("is not a JSON list of node ids")
        return v

    def nodes(self) -> list[str] | None:
        """The round's node ids, parsed from ``membership`` (validated on load).

        Returns:
            The node ids, index = group rank; None when ``ELASTIC_EMB_MEMBERSHIP`` is unset.
        """
        return None if self.membership is None else json.loads(self.membership)


def variable(field: str) -> str:
    """The environment variable of a :class:`Settings` field.

    Args:
        field: a field name, such as ``state_dir`` (not checked against :class:`Settings`).

    Returns:
        The variable's name, such as ``ELASTIC_EMB_STATE_DIR``.
    """
    return PREFIX + field.upper()


VARIABLES: dict[str, str] = {variable(f): f for f in Settings.model_fields}


def load(env: Mapping[str, str] | None = None, *fields: str) -> Settings:
    """Validated settings from the environment. Empty values count as unset.

    Args:
        env: the environment to read; ``os.environ`` when None.
        fields: field names to read; the others keep their defaults, and undeclared
            ``ELASTIC_EMB_*`` names are ignored. With none, every variable is read.

    Returns:
        The frozen settings.

    Raises:
        ValueError: if ``fields`` names something that is not a :class:`Settings` field.
        ConfigError: one line naming each variable at fault, its value (never a secret's) and
            its meaning: a bad value of a variable read, or, when no ``fields`` are given, an
            ``ELASTIC_EMB_*`` variable that is not declared.
    """
    env = os.environ if env is None else env
    unknown = [f for f in fields if f not in Settings.model_fields]
    if unknown:
        raise ValueError(f"fields {unknown} are not settings; known: {sorted(Settings.model_fields)}")
    raw: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(PREFIX) or value == "":
            continue
        field = VARIABLES.get(name)
        if field is None:
            if not fields:
                raise ConfigError(
                    f"{name} is not an elastic_emb setting (a typo?); known: {', '.join(sorted(VARIABLES))}"
                )
            continue
        if not fields or field in fields:
            raw[field] = value
    try:
        return Settings.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e, raw) for e in exc.errors())) from None


def _describe(error: dict, raw: Mapping[str, str]) -> str:
    field = str(error["loc"][0]) if error.get("loc") else "?"
    info = Settings.model_fields.get(field)
    ctx = error.get("ctx") or {}
    kind = error.get("type", "")
    reason = {
        "int_parsing": "is not an integer",
        "float_parsing": "is not a number",
        "bool_parsing": "is not 1 or 0",
        "greater_than_equal": f"must be >= {ctx.get('ge')}",
        "greater_than": f"must be > {ctx.get('gt')}",
        "less_than_equal": f"must be <= {ctx.get('le')}",
        "string_pattern_mismatch": "has the wrong form",
        "string_too_short": "is empty",
        "literal_error": f"is not one of {ctx.get('expected')}",
    }.get(kind, str(error.get("msg", "")).removeprefix("Value error, "))
    meaning = f" ({variable(field)}: {info.description})" if info is not None else ""
    shown = "<secret>" if field == "job_secret" else repr(raw.get(field))  # never echo a secret into a log
    return f"{variable(field)}={shown} {reason}{meaning}"


def markdown_table() -> str:
    """The table of variables in ``docs/CONFIG.md``.

    Returns:
        A Markdown table, one row per :class:`Settings` field: variable, who sets it, default and
        meaning.
    """
    lines = ["| variable | set by | default | meaning |", "| --- | --- | --- | --- |"]
    for field, info in Settings.model_fields.items():
        default = "unset" if info.default is None else f"`{_shown(info.default)}`"
        set_by = (info.json_schema_extra or {}).get("set_by", "user")  # type: ignore[union-attr]
        lines.append(f"| `{variable(field)}` | {set_by} | {default} | {info.description} |")
    return "\n".join(lines)


def _shown(value) -> str:
    return "1" if value is True else "0" if value is False else str(value)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
