"""One run id, one job: an agent whose job differs from the running job's is refused before it joins.

- :class:`JobFingerprint`: what makes two agents parts of one job (elastic_emb's version, the
  resize mode, the worker command and a digest of its script, or the user's own
  ``ELASTIC_EMB_JOB_FINGERPRINT``);
- :func:`check_fingerprint`: at an agent's first rendezvous, publish the fingerprint (no live
  job) or compare it with the running job's; a difference is one line naming it.

Design: ``docs/RDZV.md`` (section "One run id, one job").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic_emb.config import load, variable
from elastic_emb.rdzv.keys import fingerprint_key
from elastic_emb.rdzv.signing import Signer, read_signed

MAX_ARGS = 256  # arguments kept in the record (all of them count in ``args_digest``)
MAX_ARG = 512  # characters kept of each
MAX_RECORD = 256 * 1024  # bytes: a larger value read from the store is not a fingerprint
_SCRIPT_BYTES = 64 << 20  # a script larger than this is digested by its first 64 MiB


class JobFingerprint(BaseModel):
    """What every agent of one job has in common, as read from its own process.

    Attributes:
        version: elastic_emb's version.
        resize: the ``--rdzv-conf`` resize mode.
        user: ``ELASTIC_EMB_JOB_FINGERPRINT``, when set; it then replaces the command below.
        script: the worker's script or module, as torchrun was given it.
        script_digest: SHA-256 of the script file (None for a module or a missing file).
        args: the worker's arguments (the first :data:`MAX_ARGS`, each cut to :data:`MAX_ARG`).
        args_digest: SHA-256 of all of them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(max_length=64)
    resize: str = Field(max_length=32)
    user: str | None = Field(default=None, max_length=1024)
    script: str | None = Field(default=None, max_length=4096)
    script_digest: str | None = Field(default=None, max_length=64)
    args: tuple[str, ...] = Field(default=(), max_length=MAX_ARGS)
    args_digest: str | None = Field(default=None, max_length=64)

    @classmethod
    def of_agent(
        cls, resize: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> "JobFingerprint | None":
        """This agent's fingerprint.

        Args:
            resize: the ``--rdzv-conf`` resize mode.
            argv: the agent's command line (default: ``sys.argv``), parsed as torchrun's.
            env: the environment (default: ``os.environ``).

        Returns:
            The fingerprint, or None when neither ``ELASTIC_EMB_JOB_FINGERPRINT`` is set nor the
            command line is torchrun's (an agent started by a program: nothing to compare).
        """
        from elastic_emb import __version__

        user = load(env, "job_fingerprint").job_fingerprint
        if user is not None:
            return cls(version=__version__, resize=resize, user=user)
        worker = _worker_command(sys.argv if argv is None else argv)
        if worker is None:
            return None
        script, is_module, args = worker
        return cls(
            version=__version__,
            resize=resize,
            script=script[:4096],
            script_digest=None if is_module else _file_digest(script),
            args=tuple(a[:MAX_ARG] for a in args[:MAX_ARGS]),
            args_digest=hashlib.sha256(json.dumps(list(args)).encode()).hexdigest(),
        )

    def difference(self, running: "JobFingerprint") -> str | None:
        """The first way this fingerprint differs from the running job's, in words.

        Args:
            running: the running job's fingerprint.

        Returns:
            None when they match; else a clause such as
            ``argument 4: '--user-rows' '2000' here, '--user-rows' '1000' in the running job``.
        """
        if self == running:
            return None
        for name in ("version", "resize", "user", "script", "script_digest"):
            mine, theirs = getattr(self, name), getattr(running, name)
            if mine != theirs:
                what = {"version": "elastic_emb version", "script_digest": "script's content (SHA-256)"}.get(name, name)
                if name == "user":
                    what = variable("job_fingerprint")
                return f"{what}: {_shown(mine)} here, {_shown(theirs)} in the running job"
        for i, (mine, theirs) in enumerate(zip(self.args, running.args)):
            if mine != theirs:
                flag = self.args[i - 1] + " " if i and self.args[i - 1] == running.args[i - 1] else ""
                return (
                    f"worker argument {i + 1}: {_shown(flag + mine)} here, {_shown(flag + theirs)} in the running job"
                )
        if len(self.args) != len(running.args):
            return f"worker arguments: {len(self.args)} here, {len(running.args)} in the running job"
        return "worker arguments beyond the first 256 differ"


def check_fingerprint(
    store: Any,
    signer: Signer,
    run_id: str,
    mine: JobFingerprint,
    live_nodes: Callable[[], list[str]],
    log: Any,
    *,
    expiry_s: float,
) -> str:
    """Publish this agent's fingerprint, or refuse to join a running job with another one.

    Args:
        store: the rendezvous store (the agent's, outage-guarded).
        signer: the job's control-key signer (the record is signed when the job has a secret).
        run_id: the rendezvous run id.
        mine: this agent's fingerprint.
        live_nodes: the nodes of the rendezvous state whose heartbeat is fresh (the running job).
        log: a structlog logger.
        expiry_s: seconds after which a silent node counts as gone (for the remedy).

    Returns:
        ``"published"`` (no live job, or its record was absent or invalid) or ``"matched"``.

    Raises:
        ValueError: a one-line message naming the difference and the remedy, when a live job
            runs under ``run_id`` with another fingerprint.
    """
    key = fingerprint_key(run_id)
    running = _read(store, signer, key, log)
    nodes = live_nodes()
    if running is not None and nodes:
        difference = mine.difference(running)
        if difference is not None:
            raise ValueError(
                f"--rdzv-id {run_id!r} is taken by a running job (nodes {', '.join(sorted(nodes)[:4])}"
                f"{', ...' if len(nodes) > 4 else ''}) whose job differs: {difference}; give this job its own "
                f"--rdzv-id, or stop the running one (a job whose nodes are all gone is forgotten "
                f"{expiry_s:g} s after their last heartbeat)"
            )
        log.info("job_fingerprint_matched", key=key, nodes=len(nodes))
        return "matched"
    store.set(key, signer.sign(key, mine.model_dump_json()))
    log.info("job_fingerprint_published", key=key, live_nodes=len(nodes), replaced=running is not None)
    return "published"


def _read(store: Any, signer: Signer, key: str, log: Any) -> JobFingerprint | None:
    """The record under ``key``; None when absent, unsigned (with a secret) or not a fingerprint."""
    raw = read_signed(store, signer, key, log)
    if raw is None:
        return None
    if len(raw) > MAX_RECORD:
        log.warning("job_fingerprint_rejected", key=key, reason=f"{len(raw)} bytes, more than {MAX_RECORD}")
        return None
    try:
        return JobFingerprint.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("job_fingerprint_rejected", key=key, reason=str(exc).splitlines()[0][:200])
        return None


def _worker_command(argv: Sequence[str]) -> tuple[str, bool, list[str]] | None:
    """``(script or module, is a module, its arguments)`` from torchrun's command line; None when
    ``argv`` is not torchrun's."""
    program = os.path.basename(argv[0]) if argv else ""
    if not (program == "torchrun" or argv[0].replace(os.sep, "/").endswith("torch/distributed/run.py")):
        return None
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(list(argv[1:]))
    except SystemExit:  # not a command line torchrun accepts: nothing to compare
        return None
    return str(args.training_script), bool(args.module), [str(a) for a in args.training_script_args]


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read(_SCRIPT_BYTES)).hexdigest()
    except OSError:
        return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def live(beats: Mapping[str, float], nodes: Sequence[str], expiry_s: float, me: str) -> list[str]:
    """The nodes (other than ``me``) whose heartbeat is younger than ``expiry_s``.

    Args:
        beats: epoch seconds by node id (``torch_compat.heartbeats``).
        nodes: the state's participants and wait list.
        expiry_s: the heartbeat expiry.
        me: this node's id.

    Returns:
        The live nodes.
    """
    now = time.time()
    return [n for n in nodes if n != me and n in beats and now - beats[n] < expiry_s]
