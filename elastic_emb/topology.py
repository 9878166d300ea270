"""The topology record one rank believes, and the protocol by which all ranks agree on it.

:class:`Topology` is read from torchrun's environment (:meth:`Topology.from_env`); :func:`agree`
proves over a store that every rank of a generation holds the same one, with one decider and one
verdict. Main names: :class:`Topology`, :func:`agree`, :func:`evaluate` (the decision, pure),
:func:`scope` (a generation's store prefix).

Design: ``docs/CORE.md`` (section "Topology and agreement").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Mapping
from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic_emb import config
from elastic_emb.errors import AgreementTimeout, ConfigError, TopologyDisagreement, TopologyError

# Which environment variable each field comes from, so every error can name it.
ENV_OF_FIELD: dict[str, str] = {
    "run_id": "TORCHELASTIC_RUN_ID",
    "generation": "ELASTIC_EMB_GENERATION",
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
    "ep_size": "ELASTIC_EMB_EP_SIZE",
    "backend": "ELASTIC_EMB_BACKEND",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}

# Fields every rank of a generation must hold identically; the fingerprint covers exactly these.
SHARED_FIELDS: tuple[str, ...] = (
    "run_id",
    "generation",
    "world_size",
    "num_nodes",
    "ep_size",
    "backend",
    "master_addr",
    "master_port",
)


def largest_power_of_two_at_most(n: int) -> int:
    """The largest power of two that is at most ``n``.

    Args:
        n: a positive integer.

    Returns:
        The largest ``2**k <= n``.

    Raises:
        ValueError: if ``n`` is smaller than 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is a power of two.

    Args:
        n: any integer.

    Returns:
        True for 1, 2, 4, ...; False for anything else, zero and negative numbers included.
    """
    return n >= 1 and (n & (n - 1)) == 0


# A run id becomes a directory name of the state tiers and a store key prefix: a plain name only
# (no separators, no dot names, bounded length); elastic_emb.state.paths applies it to node ids too.
SAFE_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$"


class Topology(BaseModel):
    """What one rank believes about the job it is in. Immutable, strictly typed, validated.

    Build it with :meth:`from_env` or :meth:`build`, which turn validation errors into
    :class:`~elastic_emb.errors.TopologyError` naming the field, its value and its variable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run_id: str = Field(min_length=1, pattern=SAFE_NAME)
    generation: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    local_rank: int = Field(ge=0)
    local_world_size: int = Field(ge=1)
    node_rank: int = Field(ge=0)
    num_nodes: int = Field(ge=1)
    ep_size: int = Field(ge=1)
    backend: Literal["nccl", "gloo"]
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _consistent(self) -> "Topology":
        def bad(field: str, msg: str) -> ValueError:
            value = getattr(self, field)
            return ValueError(f"{field}={value!r} (from {ENV_OF_FIELD[field]}): {msg}")

        if self.rank >= self.world_size:
            raise bad("rank", f"must be < world_size={self.world_size}")
        if self.local_rank >= self.local_world_size:
            raise bad("local_rank", f"must be < local_world_size={self.local_world_size}")
        if self.local_world_size > self.world_size:
            raise bad("local_world_size", f"must be <= world_size={self.world_size}")
        if self.num_nodes > self.world_size:
            raise bad("num_nodes", f"must be <= world_size={self.world_size} (every node runs a worker)")
        if self.node_rank >= self.num_nodes:
            raise bad("node_rank", f"must be < num_nodes={self.num_nodes}")
        if not is_power_of_two(self.ep_size):
            raise bad("ep_size", "must be a power of two (1, 2, 4, ...)")
        if self.ep_size > self.world_size:
            raise bad("ep_size", f"must be <= world_size={self.world_size}")
        return self

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Topology":
        """Read the topology from torchrun's worker environment.

        ``GROUP_RANK``/``GROUP_WORLD_SIZE`` may be left out only on one node (``LOCAL_WORLD_SIZE``
        equal to ``WORLD_SIZE``). The generation, EP size and backend come from the
        ``ELASTIC_EMB_*`` settings, with the fallbacks in ``docs/CORE.md``.

        Args:
            env: the environment to read; ``os.environ`` when None.

        Returns:
            The validated topology.

        Raises:
            TopologyError: if a variable is missing, not an integer, out of range, or makes the
                record inconsistent; the message names the variable and its value.
        """
        env = os.environ if env is None else env

        def integer(var: str, default: int | None = None, minimum: int = 0) -> int:
            raw = env.get(var)
            if raw is None:
                if default is not None:
                    return default
                raise TopologyError(
                    f"{var} is not set: elastic_emb reads the worker topology from torchrun's "
                    f"environment; launch with torchrun (or set {var})"
                )
            try:
                value = int(raw.strip())
            except ValueError:
                raise TopologyError(f"{var}={raw!r} is not an integer") from None
            if value < minimum:
                raise TopologyError(f"{var}={raw!r} must be >= {minimum}")
            return value

        world_size = integer("WORLD_SIZE", minimum=1)
        local_world_size = integer("LOCAL_WORLD_SIZE", minimum=1)
        has_group = "GROUP_RANK" in env or "GROUP_WORLD_SIZE" in env
        if not has_group and local_world_size != world_size:
            raise TopologyError(
                f"GROUP_RANK and GROUP_WORLD_SIZE are not set while LOCAL_WORLD_SIZE="
                f"{local_world_size} != WORLD_SIZE={world_size}: set both (torchrun does)"
            )
        try:
            settings = config.load(env, "generation", "ep_size", "backend")
        except ConfigError as exc:
            raise TopologyError(str(exc)) from None
        ep_size = settings.ep_size if settings.ep_size is not None else largest_power_of_two_at_most(world_size)
        backend = settings.backend or ("nccl" if _cuda_available() else "gloo")
        master_addr = env.get("MASTER_ADDR")
        if master_addr is None:
            raise TopologyError("MASTER_ADDR is not set: launch with torchrun (or set MASTER_ADDR)")
        values = dict(
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            generation=settings.generation,
            rank=integer("RANK"),
            world_size=world_size,
            local_rank=integer("LOCAL_RANK"),
            local_world_size=local_world_size,
            node_rank=integer("GROUP_RANK", default=0 if not has_group else None),
            num_nodes=integer("GROUP_WORLD_SIZE", default=1 if not has_group else None, minimum=1),
            ep_size=ep_size,
            backend=backend,
            master_addr=master_addr,
            master_port=integer("MASTER_PORT", minimum=1),
        )
        return cls.build(**values)

    @classmethod
    def build(cls, **values: object) -> "Topology":
        """Construct and validate a topology from field values.

        Args:
            values: every field of :class:`Topology`, by name.

        Returns:
            The validated topology.

        Raises:
            TopologyError: if a value is invalid, a field is unknown or missing, or the fields
                are inconsistent; the message names the field, its value and its variable.
        """
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ValidationError as exc:
            raise TopologyError(_describe_validation_error(exc, values)) from None

    # -- views ----------------------------------------------------------------------------

    def shared(self) -> dict[str, object]:
        """The fields every rank of the generation must hold identically.

        Returns:
            Field name to value, for each name of ``SHARED_FIELDS``.
        """
        return {f: getattr(self, f) for f in SHARED_FIELDS}

    def fingerprint(self) -> str:
        """A stable hash of :meth:`shared`.

        Returns:
            16 hex digits of a SHA-256 over the shared fields: equal on every rank of an agreed
            generation, and independent of process, Python hash seed and field order.
        """
        canonical = json.dumps(self.shared(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def owns_rows(self) -> bool:
        """Ranks at or beyond ep_size own no rows but still look up and train."""
        return self.rank < self.ep_size

    def with_changes(self, **changes: object) -> "Topology":
        """A validated copy with some fields replaced.

        Args:
            changes: the fields to replace, by name.

        Returns:
            The new topology (this one is unchanged).

        Raises:
            TopologyError: if the result is invalid (see :meth:`build`).
        """
        return Topology.build(**{**self.model_dump(), **changes})

    def to_json(self) -> str:
        """This record as JSON.

        Returns:
            A JSON object with every field; :meth:`from_json` reads it back.
        """
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Topology":
        """Read a record written by :meth:`to_json`.

        Args:
            raw: the JSON text.

        Returns:
            The validated topology.

        Raises:
            TopologyError: if ``raw`` is not a valid topology record.
        """
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise TopologyError(f"invalid topology record {raw[:200]!r}: {exc}") from None


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        return False


def _describe_validation_error(exc: ValidationError, values: Mapping[str, object]) -> str:
    parts = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        field = str(loc[0]) if loc else ""
        msg = err.get("msg", "")
        if field and field not in ENV_OF_FIELD:
            parts.append(f"{field}={values.get(field)!r} is not a topology field (known: {', '.join(ENV_OF_FIELD)})")
        elif field:
            parts.append(f"{field}={values.get(field)!r} (from {ENV_OF_FIELD[field]}): {msg}")
        else:  # model-level validator: its message already names field, value and variable
            parts.append(msg.removeprefix("Value error, "))
    return "invalid topology: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------------------------


def scope(run_id: str, generation: int) -> str:
    """The store key prefix private to one generation of one run.

    Args:
        run_id: the run's id.
        generation: the generation.

    Returns:
        ``elastic_emb/<run_id>/gen<generation>`` (no trailing slash).
    """
    return f"elastic_emb/{run_id}/gen{generation}"


def evaluate(records: list[dict], expected: dict) -> dict:
    """Decide a generation from the records that arrived (pure; the decider runs it).

    Shared fields are compared with the decider's record as records arrive; ranks and the node
    layout are checked once ``world_size`` records are in.

    Args:
        records: the topology records (dicts) in arrival order, the decider's own first.
        expected: the decider's own record.

    Returns:
        A verdict dict: ``{"ok": None}`` while undecided; ``{"ok": True, "fingerprint": ...,
        "world_size": ...}``; or ``{"ok": False, "kind": "disagreement", "message": ...,
        "details": ...}``, where ``details`` maps a rank (or ``slot<N>``) to
        ``[field, value, expected]`` triples.
    """
    world_size = expected["world_size"]
    details: dict[str, list] = {}
    for i, rec in enumerate(records):
        diffs = [[f, rec.get(f), expected[f]] for f in SHARED_FIELDS if rec.get(f) != expected[f]]
        if diffs:
            details.setdefault(_who(rec, i), []).extend(diffs)
    if details:
        return _fail("disagreement", expected, "shared fields differ", details)
    if len(records) > world_size:
        extra = {_who(r, i): [["arrival", i, f"< {world_size}"]] for i, r in enumerate(records) if i >= world_size}
        return _fail("disagreement", expected, f"{len(records)} processes joined a world of {world_size}", extra)
    if len(records) < world_size:
        return {"ok": None}  # not decided yet
    ranks = Counter(r["rank"] for r in records)
    dup = sorted(r for r, c in ranks.items() if c > 1)
    missing = sorted(set(range(world_size)) - set(ranks))
    if dup or missing:
        for r in dup:
            details[f"rank{r}"] = [["rank", r, f"claimed by {ranks[r]} processes"]]
        for r in missing:
            details[f"rank{r}"] = [["rank", None, f"rank {r} claimed by no process"]]
        return _fail("disagreement", expected, f"duplicated ranks {dup}, unclaimed ranks {missing}", details)
    # Node layout: distinct nodes 0..num_nodes-1; in each node local ranks 0..lws-1 once each.
    nodes: dict[int, list[dict]] = {}
    for r in records:
        nodes.setdefault(r["node_rank"], []).append(r)
    if sorted(nodes) != list(range(expected["num_nodes"])):
        return _fail(
            "disagreement",
            expected,
            f"node ranks {sorted(nodes)} are not 0..{expected['num_nodes'] - 1}",
            {"nodes": [["node_rank", sorted(nodes), list(range(expected["num_nodes"]))]]},
        )
    for node, recs in nodes.items():
        lws = {r["local_world_size"] for r in recs}
        locals_ = sorted(r["local_rank"] for r in recs)
        if len(lws) != 1 or locals_ != list(range(len(recs))) or lws != {len(recs)}:
            return _fail(
                "disagreement",
                expected,
                f"node {node}: local ranks {locals_} with local_world_size {sorted(lws)} are inconsistent",
                {
                    f"node{node}": [
                        ["local_rank", locals_, list(range(len(recs)))],
                        ["local_world_size", sorted(lws), len(recs)],
                    ]
                },
            )
    return {"ok": True, "fingerprint": _fingerprint_of(expected), "world_size": world_size}


def _who(rec: dict, slot: int) -> str:
    return f"rank{rec['rank']}" if isinstance(rec.get("rank"), int) else f"slot{slot}"


def _fingerprint_of(record: dict) -> str:
    canonical = json.dumps({f: record[f] for f in SHARED_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _fail(kind: str, expected: dict, what: str, details: dict) -> dict:
    lines = "; ".join(
        f"{who}: " + ", ".join(f"{f}={v!r} (expected {e!r})" for f, v, e in diffs)
        for who, diffs in sorted(details.items())
    )
    message = (
        f"topology disagreement in run {expected['run_id']!r} generation {expected['generation']}: "
        f"{what}. {lines}. Every rank must be launched by the same rendezvous round with the same "
        f"WORLD_SIZE/ELASTIC_EMB_EP_SIZE/ELASTIC_EMB_GENERATION; restart the job's workers so they rejoin."
    )
    return {"ok": False, "kind": kind, "message": message, "details": details}


def agree(topology: Topology, store, timeout: float = 60.0) -> Topology:
    """Prove that every rank of ``topology.generation`` holds the same topology.

    Collective over ``store``: every rank of the generation calls it, and all return or raise the
    same thing. Protocol: ``docs/CORE.md`` (section "Topology and agreement").

    Args:
        topology: this rank's topology.
        store: the world's ``torch.distributed.Store``.
        timeout: seconds to wait for every rank and for the verdict.

    Returns:
        ``topology``, once all ``world_size`` ranks agree.

    Raises:
        ValueError: if ``timeout`` is not positive.
        TopologyDisagreement: on every rank, if the records differ, ranks or the node layout are
            inconsistent, too many processes arrived (this one after the generation closed), or
            a rank belongs to a stale generation.
        AgreementTimeout: if some ranks never arrive within ``timeout`` (``missing_ranks`` names
            them), the deciding rank writes no verdict, or the closing barrier is not confirmed.
        TopologyError: if the run's generation mark cannot be raised.
    """
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    start = time.monotonic()
    deadline = start + timeout
    base = scope(topology.run_id, topology.generation) + "/agree"
    record = json.loads(topology.to_json())
    _raise_generation_mark(topology, store)

    slot = store.add(f"{base}/arrivals", 1) - 1
    store.set(f"{base}/slot/{slot}", topology.to_json())
    from elastic_emb.state import points  # here: the state package imports this module

    points.reached("topology_agreeing", topology.generation)  # tests: a rank lost inside the agreement
    if slot == 0:
        verdict = _decide(topology, record, store, base, start + timeout * 0.9)
        store.set(f"{base}/verdict", json.dumps(verdict))
    else:
        verdict = _await_verdict(store, base, deadline, topology)
    _leave_together(store, base, verdict, slot, deadline, topology)
    if verdict["ok"] and slot >= topology.world_size:
        raise TopologyDisagreement(
            f"rank {topology.rank} arrived (as process {slot + 1}) after generation "
            f"{topology.generation} of run {topology.run_id!r} closed with {topology.world_size} "
            f"ranks: this process is not part of the job; exit and let the agent restart it",
            {f"rank{topology.rank}": [["arrival", slot, f"< {topology.world_size}"]]},
        )
    if verdict["ok"]:
        if verdict["fingerprint"] != topology.fingerprint():  # cannot differ once accepted; belt and braces
            raise TopologyDisagreement(
                f"agreed fingerprint {verdict['fingerprint']} != this rank's {topology.fingerprint()}"
            )
        return topology
    if verdict["kind"] == "timeout":
        raise AgreementTimeout(verdict["message"], verdict.get("missing_ranks"))
    raise TopologyDisagreement(verdict["message"], verdict.get("details"))


def _raise_generation_mark(topology: Topology, store) -> None:
    """Raise the run's high-water generation mark, or fail if this rank is stale."""
    key = f"elastic_emb/{topology.run_id}/generation"
    mine = str(topology.generation)
    for _ in range(64):  # bounded: each failed compare_set means another rank moved the mark
        current = store.compare_set(key, "", mine) if not store.check([key]) else store.get(key)
        current = current.decode() if isinstance(current, bytes) else str(current)
        if int(current) == topology.generation:
            return
        if int(current) > topology.generation:
            msg = _abort_newer_generation(topology, store, int(current))
            raise TopologyDisagreement(
                msg, {f"rank{topology.rank}": [["generation", topology.generation, int(current)]]}
            )
        swapped = store.compare_set(key, current, mine)
        swapped = swapped.decode() if isinstance(swapped, bytes) else str(swapped)
        if swapped == mine:
            return
    raise TopologyError(f"could not raise the generation mark to {mine} after 64 attempts")


def _abort_newer_generation(topology: Topology, store, newer: int) -> str:
    """Tell generation ``newer`` that this (stale) rank exists, and return the verdict's message.

    The newer generation's decider polls its ``abort`` key, so its ranks fail with the same
    message at once instead of waiting out their timeout for a rank that sits in an old
    generation. Both orders of arrival end here: a stale rank that finds the mark already
    raised, and a stale rank that raised the mark first and then saw it overtaken while
    it decided its own (old) generation.
    """
    msg = (
        f"rank {topology.rank} is from stale generation {topology.generation} of run "
        f"{topology.run_id!r}; the job is at generation {newer}. This process must exit "
        f"and be restarted by its agent (ELASTIC_EMB_GENERATION={topology.generation})"
    )
    key = scope(topology.run_id, newer) + "/agree/abort"
    store.compare_set(key, "", json.dumps({"message": msg, "rank": topology.rank, "generation": topology.generation}))
    return msg


def _decide(topology: Topology, record: dict, store, base: str, deadline: float) -> dict:
    records: list[dict] = [record]
    mark_key = f"elastic_emb/{topology.run_id}/generation"
    pause = 0.0005
    while True:
        arrived = int(store.add(f"{base}/arrivals", 0))
        if arrived > len(records):
            keys = [f"{base}/slot/{i}" for i in range(len(records), arrived)]
            # A slot is taken before it is written; wait (bounded) for the write.
            store.wait(keys, _remaining(deadline, floor=0.05))
            for raw in store.multi_get(keys):
                try:
                    records.append(json.loads(raw))
                except ValueError:
                    records.append({"rank": None, "unparseable": raw[:100].decode(errors="replace")})
        verdict = evaluate(records, record)
        verdict["arrived"] = len(records)
        if verdict["ok"] is not None:
            if verdict["ok"]:
                # Close the window: a process that took a slot meanwhile makes the world too big.
                late = int(store.add(f"{base}/arrivals", 0))
                if late > topology.world_size:
                    continue
            return verdict
        if store.check([f"{base}/abort"]):
            abort = json.loads(store.get(f"{base}/abort"))
            return _fail(
                "disagreement",
                record,
                f"a stale rank aborted this generation: {abort['message']}",
                {f"rank{abort['rank']}": [["generation", abort["generation"], topology.generation]]},
            )
        mark = int(store.get(mark_key))
        if mark > topology.generation:
            # This generation is stale (it raised the mark first, then a newer one overtook it):
            # fail here and abort the newer one, which would otherwise wait for our ranks.
            stale = _abort_newer_generation(topology, store, mark)
            return _fail(
                "disagreement",
                record,
                f"the job moved on to generation {mark} while generation {topology.generation} was agreeing: {stale}",
                {"generation": [["generation", topology.generation, mark]]},
            )
        if time.monotonic() >= deadline:
            seen = {r.get("rank") for r in records}
            arrived = len(records)
            missing = sorted(set(range(topology.world_size)) - seen)
            return {
                "ok": False,
                "kind": "timeout",
                "arrived": arrived,
                "missing_ranks": missing,
                "message": (
                    f"topology agreement of run {topology.run_id!r} generation {topology.generation} "
                    f"timed out: {len(records)} of {topology.world_size} ranks arrived; missing ranks "
                    f"{missing}. Check that those workers started (their logs), or raise the timeout"
                ),
            }
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


# How long the rank that may host the store (rank 0) stays after a failed agreement, so that ranks
# still starting up can connect and read the verdict instead of losing the store.
LATE_READER_GRACE_S = 2.0


def _leave_together(store, base: str, verdict: dict, slot: int, deadline: float, topology: Topology) -> None:
    """Wait (bounded) until every process the verdict covers has read it.

    Under torchrun, rank 0 hosts the store: if it returned and exited at once, the others could
    lose the store before reading the verdict. So agree() ends with a barrier; its last arrival
    sets one key that everybody waits for (O(1) store operations per rank). After a failed
    agreement rank 0 also waits up to LATE_READER_GRACE_S for processes that arrive after the
    verdict (slow starters), so they too raise the verdict's error rather than a connection error.
    """
    expected = int(verdict.get("arrived", 1))
    if slot >= expected:
        store.add(f"{base}/late_read", 1)  # a late process: nobody waits for it, but rank 0 counts it
        return
    if store.add(f"{base}/read", 1) == expected:
        store.set(f"{base}/all_read", "1")
    try:
        store.wait([f"{base}/all_read"], _remaining(deadline, floor=1.0))
    except Exception:
        if verdict.get("ok"):
            raise AgreementTimeout(
                f"topology agreed, but not every rank confirmed reading it before the timeout "
                f"({base}); a rank died right after agreeing: let the agent restart the workers"
            ) from None
    if topology.rank == 0 and verdict.get("ok") is False and verdict.get("kind") != "timeout":
        end = min(deadline, time.monotonic() + LATE_READER_GRACE_S)
        while time.monotonic() < end:  # bounded by the grace and the agreement's deadline
            if int(store.add(f"{base}/read", 0)) + int(store.add(f"{base}/late_read", 0)) >= topology.world_size:
                break
            time.sleep(0.01)


def _await_verdict(store, base: str, deadline: float, topology: Topology) -> dict:
    key = f"{base}/verdict"
    try:
        store.wait([key], _remaining(deadline, floor=0.01))
    except Exception:  # the store raises a plain RuntimeError/DistStoreError on timeout
        arrived = int(store.add(f"{base}/arrivals", 0))
        raise AgreementTimeout(
            f"topology agreement of run {topology.run_id!r} generation {topology.generation}: no "
            f"verdict within the timeout ({arrived} of {topology.world_size} processes arrived). "
            f"The deciding rank (first to arrive) died or is stuck; check its log, or raise the timeout",
        ) from None
    return json.loads(store.get(key))


def _remaining(deadline: float, floor: float) -> timedelta:
    return timedelta(seconds=max(floor, deadline - time.monotonic()))
