"""Prometheus metrics: an opt-in ``/metrics`` endpoint on each worker and on each agent.

Off unless ``ELASTIC_EMB_METRICS_PORT=P`` is set (and ``prometheus-client`` installed): the agent
serves port ``P``, the worker of local rank ``r`` port ``P + 1 + r``. The lifecycle, the context
and the rendezvous backend call one function per event (:func:`resize`, :func:`commit`,
:func:`replicated`, :func:`lookups`, :func:`rendezvous_round`, :func:`store_outage`); with metrics
off each costs one global read, and a failure to serve never stops training.

Design and the list of metrics: ``docs/CORE.md`` (section "Metrics").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

PORT_ENV = "ELASTIC_EMB_METRICS_PORT"
ADDR_ENV = "ELASTIC_EMB_METRICS_ADDR"

PHASES = ("teardown", "agreement", "construct", "restore", "transfer", "total")
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_lock = threading.Lock()
_state: dict[str, Any] = {"checked": False, "registry": None, "metrics": None, "port": None, "role": None}


def port_for(role: str, env: Mapping[str, str] | None = None) -> int | None:
    """The port this process serves metrics on.

    An invalid ``ELASTIC_EMB_METRICS_PORT`` or ``LOCAL_RANK``, or a port outside 1..65535, is
    logged as ``metrics_disabled`` and gives None.

    Args:
        role: ``agent`` (the base port) or ``worker`` (the base port + 1 + ``LOCAL_RANK``).
        env: the environment to read; ``os.environ`` when None.

    Returns:
        The port, or None when metrics are off or the settings are invalid.
    """
    from elastic_emb.config import load
    from elastic_emb.errors import ConfigError

    env = os.environ if env is None else env
    try:
        base = load(env, "metrics_port").metrics_port
    except ConfigError as exc:
        _warn("metrics_disabled", reason=str(exc))
        return None
    if base is None:
        return None
    try:
        offset = 0 if role == "agent" else 1 + int(env.get("LOCAL_RANK") or 0)
    except ValueError:
        _warn("metrics_disabled", reason=f"LOCAL_RANK={env.get('LOCAL_RANK')!r} is not an integer")
        return None
    if not 0 < base + offset < 65536:
        _warn("metrics_disabled", reason=f"{PORT_ENV}={base} gives port {base + offset}, outside 1..65535")
        return None
    return base + offset


def _warn(event: str, **fields: Any) -> None:
    from elastic_emb.events import get_logger

    get_logger("elastic_emb.metrics").warning(event, **fields)


def _role() -> str:
    """``worker`` in a process torchrun started (it sets LOCAL_RANK), else ``agent``."""
    return "worker" if os.environ.get("LOCAL_RANK") is not None else "agent"


def _registry():
    """The process's metrics (created, and the endpoint started, on the first call), or None."""
    if _state["checked"]:
        return _state["metrics"]
    with _lock:
        if _state["checked"]:
            return _state["metrics"]
        _state["checked"] = True
        role = _role()
        port = port_for(role)
        if port is None:
            return None
        try:
            import prometheus_client as prom
        except ImportError:
            _warn(
                "metrics_disabled",
                reason=f"{PORT_ENV} is set but prometheus-client is not installed: pip install 'elastic-emb[metrics]'",
            )
            return None
        if hasattr(prom, "disable_created_metrics"):
            prom.disable_created_metrics()  # no *_created series: half the text, nothing a dashboard reads
        registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=registry)
        metrics = _make(prom, registry, role)
        from elastic_emb.config import load

        addr = load(None, "metrics_addr").metrics_addr
        try:
            prom.start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            _warn(
                "metrics_disabled",
                reason=f"cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); set {PORT_ENV} to a free port",
                role=role,
            )
            return None
        _state.update(registry=registry, metrics=metrics, port=port, role=role)
        from elastic_emb.events import get_logger

        get_logger("elastic_emb.metrics").info("metrics_serving", addr=addr, port=port, role=role)
        return metrics


def _make(prom, registry, role: str) -> dict[str, Any]:
    r = {"registry": registry}
    m: dict[str, Any] = {
        "world_size": prom.Gauge(
            "elastic_emb_world_size", "Ranks (worker) or member nodes (agent) of the current world.", **r
        ),
        "generation": prom.Gauge("elastic_emb_generation", "Rendezvous round of the current world.", **r),
        # the agent's backend and a worker's watcher both survive store outages
        "outages": prom.Counter("elastic_emb_store_outages", "Rendezvous store outages survived.", **r),
        "outage_seconds": prom.Histogram(
            "elastic_emb_store_outage_seconds", "Length of each store outage.", buckets=_PHASE_BUCKETS, **r
        ),
    }
    if role == "agent":
        m.update(
            rounds=prom.Counter(
                "elastic_emb_rendezvous_rounds", "Rendezvous rounds completed by this agent.", ["cause", "mode"], **r
            ),
            rdzv_seconds=prom.Histogram(
                "elastic_emb_rendezvous_seconds", "Seconds in next_rendezvous.", buckets=_PHASE_BUCKETS, **r
            ),
            hung=prom.Counter("elastic_emb_workers_hung", "Workers this agent's hang watchdog killed.", **r),
        )
    else:
        m.update(
            resizes=prom.Counter(
                "elastic_emb_resizes", "Worlds this worker's lifecycle entered.", ["mode", "source"], **r
            ),
            phases=prom.Histogram(
                "elastic_emb_resize_phase_seconds",
                "Duration of each resize phase.",
                ["phase"],
                buckets=_PHASE_BUCKETS,
                **r,
            ),
            steps_lost=prom.Counter("elastic_emb_steps_lost", "Committed steps a new world had to redo.", **r),
            commits=prom.Counter("elastic_emb_commits", "Commits written.", **r),
            commits_failed=prom.Counter(
                "elastic_emb_commits_failed", "Commits the state directory refused, skipped.", ["reason"], **r
            ),
            commit_seconds=prom.Histogram(
                "elastic_emb_commit_seconds", "Commit latency.", buckets=_COMMIT_BUCKETS, **r
            ),
            commit_bytes=prom.Counter("elastic_emb_commit_bytes", "Bytes written by commits, per tier.", ["tier"], **r),
            lookups=prom.Counter("elastic_emb_lookups", "Ids looked up, per table.", ["table"], **r),
            rank=prom.Gauge("elastic_emb_rank", "This worker's global rank.", **r),
            step=prom.Gauge("elastic_emb_step", "Last committed step.", **r),
        )
    return m


# -- worker events -----------------------------------------------------------------------------


def _of(role: str) -> dict[str, Any] | None:
    m = _registry()
    return m if m is not None and _state["role"] == role else None


def resize(event: Any, snapshot: Any = None) -> None:
    """Record that the worker's lifecycle entered a world (a no-op unless a worker serves metrics).

    Steps lost are the newest commit in this node's snapshot directory minus the step the world
    restored; if they cannot be read, a warning is logged and none are counted.

    Args:
        event: the :class:`~elastic_emb.lifecycle.records.ResizeEvent`.
        snapshot: the lifecycle's :class:`~elastic_emb.state.SnapshotTier`, or None (no steps
            lost are counted).
    """
    m = _of("worker")
    if m is None:
        return
    steps_lost = 0
    if snapshot is not None:
        try:
            newest = max((man.step for _, man in snapshot.manifests()), default=-1)
            steps_lost = max(0, newest - event.restored_step)
        except Exception as exc:  # noqa: BLE001 - a metric must not stop training; reported
            _warn("metrics_steps_lost_unknown", error=repr(exc)[:300])
    m["resizes"].labels(mode=event.kind, source="+".join(sorted(event.source_tiers)) or "none").inc()
    for phase in PHASES:
        m["phases"].labels(phase=phase).observe(float(getattr(event, f"{phase}_s")))
    if steps_lost > 0:
        m["steps_lost"].inc(steps_lost)
    m["world_size"].set(event.new_world_size)
    m["generation"].set(event.new_generation)
    m["rank"].set(event.rank)
    m["step"].set(event.restored_step)


def commit(report: Any) -> None:
    """Record a written commit (a no-op unless this is a worker serving metrics).

    Args:
        report: the commit's :class:`~elastic_emb.lifecycle.records.CommitReport`.
    """
    m = _of("worker")
    if m is None:
        return
    m["commits"].inc()
    m["commit_seconds"].observe(report.seconds)
    for tier, n in (
        ("snapshot", report.bytes_snapshot),
        ("replica", report.bytes_replicated),
        ("durable", report.bytes_durable),
    ):
        if n:
            m["commit_bytes"].labels(tier=tier).inc(n)
    m["step"].set(report.step)


def commit_failed(reason: str) -> None:
    """Record a commit the state directory refused and training went on without (a no-op unless
    this is a worker serving metrics).

    Args:
        reason: a short label, e.g. ``"no_space"`` or ``"read_only"``.
    """
    m = _of("worker")
    if m is not None:
        m["commits_failed"].labels(reason=reason).inc()


def replicated(nbytes: int) -> None:
    """Record replica bytes of a background commit, counted when they arrive.

    The commit's report is made before the replicas move, so it says 0 for them.

    Args:
        nbytes: bytes received as replicas.
    """
    m = _of("worker")
    if m is not None and nbytes:
        m["commit_bytes"].labels(tier="replica").inc(nbytes)


def lookups(table: str, count: int) -> None:
    """Record looked-up ids (a no-op unless this is a worker serving metrics).

    Args:
        table: the table's name.
        count: how many ids were looked up.
    """
    m = _of("worker")
    if m is not None:
        m["lookups"].labels(table=table).inc(count)


# -- agent events ------------------------------------------------------------------------------


def rendezvous_round(
    *,
    round_: int,
    world_size: int,
    previous_world_size: int | None,
    joins: list,
    departures: list,
    deaths: list,
    seconds: float,
) -> None:
    """Record a completed rendezvous round (a no-op unless this is an agent serving metrics).

    The cause is read from who came and went: ``start`` (no previous round), else ``death``,
    ``leave``, ``join``, or ``restart`` (same members) in that order of precedence.

    Args:
        round_: the round number.
        world_size: member nodes of the round.
        previous_world_size: member nodes of the previous round; None for the first round.
        joins: nodes that joined.
        departures: nodes that left.
        deaths: nodes that died.
        seconds: time spent in the rendezvous.
    """
    m = _of("agent")
    if m is None:
        return
    if previous_world_size is None:
        cause = "start"
    elif deaths:
        cause = "death"
    elif departures:
        cause = "leave"
    elif joins:
        cause = "join"
    else:
        cause = "restart"
    mode = "start" if previous_world_size is None else "reset" if previous_world_size == world_size else "rebuild"
    m["rounds"].labels(cause=cause, mode=mode).inc()
    m["rdzv_seconds"].observe(seconds)
    m["world_size"].set(world_size)
    m["generation"].set(round_)


def store_outage(seconds: float) -> None:
    """Record a survived store outage (agent or worker; a no-op when metrics are off).

    Args:
        seconds: how long the rendezvous store was unreachable.
    """
    m = _registry()
    if m is not None:
        m["outages"].inc()
        m["outage_seconds"].observe(seconds)


def worker_hung() -> None:
    """Record a worker the agent's hang watchdog killed (a no-op when metrics are off)."""
    m = _of("agent")
    if m is not None:
        m["hung"].inc()


def serving() -> tuple[str, int] | None:
    """The endpoint this process serves, if any.

    Returns:
        ``(role, port)``, or None when this process serves no metrics.
    """
    return (_state["role"], _state["port"]) if _state["metrics"] is not None else None


def _reset_for_tests() -> None:
    with _lock:
        _state.update(checked=False, registry=None, metrics=None, port=None, role=None)
