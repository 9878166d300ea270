"""The wire contract between the agent-side backend and the workers: environment and store key names.

- ``ENV_*``: what the backend puts into the agent's environment (torchrun copies it to the workers);
- ``KEY_*``: elastic_emb's store keys, under :func:`round_prefix`, :func:`inproc_root` or
  :func:`inproc_prefix`; the control keys among them are signed when the job has a secret;
- :func:`count_value`: a count read from the store, as untrusted input.

Imports nothing, so a worker, a preStop hook or a test imports it for free. Rename nothing here
without every reader: processes of other versions read these keys during a rolling change.
Design: ``docs/RDZV.md`` (section "The wire contract").
"""

from __future__ import annotations

BACKEND_NAME = "elastic_emb"

ENV_GENERATION = "ELASTIC_EMB_GENERATION"
ENV_RDZV_BACKEND = "ELASTIC_EMB_RDZV_BACKEND"
ENV_RDZV_ENDPOINT = "ELASTIC_EMB_RDZV_ENDPOINT"
ENV_NODE_ID = "ELASTIC_EMB_RDZV_NODE"
ENV_MEMBERSHIP = "ELASTIC_EMB_MEMBERSHIP"
ENV_AGENT_PID = "ELASTIC_EMB_AGENT_PID"
ENV_DRAIN = "ELASTIC_EMB_DRAIN"
ENV_WATCH_INTERVAL = "ELASTIC_EMB_WATCH_INTERVAL"
ENV_STORE_OUTAGE_TIMEOUT = "ELASTIC_EMB_STORE_OUTAGE_TIMEOUT"
ENV_RESIZE = "ELASTIC_EMB_RESIZE"  # restart | in_process (--rdzv-conf resize=)
ENV_ROUND = "ELASTIC_EMB_RDZV_ROUND"  # the torch round (the generation may be higher: in-process mode)
ENV_JOINER = "ELASTIC_EMB_JOINER"  # 1: the node joined a running world in process (inprocess/resize.py)
# The file in the agent's private directory where its workers' watchers write the drain's count
# (rdzv/drain_acks.py): the agent's copy of the round's world_size, out of a store writer's reach.
ENV_DRAIN_COUNT_FILE = "ELASTIC_EMB_DRAIN_COUNT_FILE"
# The prefix of the files where each local worker shows its agent that it makes progress
# (watch/heartbeat.py; the agent's watchdog: rdzv/hang.py): <prefix>-<local rank>.json.
ENV_PROGRESS_FILE = "ELASTIC_EMB_PROGRESS_FILE"
# torch's own switch; the backend always sets it to 1 (a shared agent store deadlocks a scale-up).
DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Where each inner backend keeps torch's pickled _RendezvousState (base64 in both).
C10D_STATE_KEY = "torch.rendezvous.{run_id}"
ETCD_STATE_KEY = "/torch/elastic/rendezvous/{run_id}"
ETCD_STORE_PREFIX = "/torch/elastic/store"
C10D_NULL_STATE = b"Y2FuaW1hZGFt"  # torch's "no state yet" sentinel in the c10d backend

# Key names under round_prefix() (the drain protocol and death/leave reports). elastic_emb.cli.drain
# (the preStop client) speaks the same protocol.
KEY_DRAIN = "drain"  # agent (or preStop hook) -> workers: stop after an agreed step [control]
KEY_WORLD_SIZE = "world_size"  # watchers -> agent: acknowledgements to expect [control]
KEY_ACKS = "acks"  # counter of acknowledgements: a hint of when to look only (rdzv/drain_acks.py)
KEY_ACK = "ack/"  # + rank: that worker's acknowledgement {round, rank, step}; only these are counted [control]
KEY_STOP_STEP = "stop_step"  # the agreed last step: the first valid value written (compare-and-set) [control]
KEY_DEAD = "dead"  # counter of death reports; + "/" + node id: one report [control]
KEY_LEFT = "left/"  # + node id: the node left on purpose (reason) [control]
KEY_EVICTED = "evicted/"  # + node id: an agent removed that node from the state [control]
KEY_FALLBACK = "inproc_fallback"  # workers -> agents: an in-process re-form failed, restart us [control]


def inproc_prefix(run_id: str, generation: int) -> str:
    """Store key prefix of one in-process re-form (``elastic_emb/inprocess/resize.py``).

    Args:
        run_id: the rendezvous run id.
        generation: the generation the re-form decides.

    Returns:
        The prefix, ending in ``/``.
    """
    return f"elastic_emb/{run_id}/inproc/gen{generation}/"


KEY_DECISION = "decision"  # the decider -> every worker: the new generation's nodes; the first valid one wins [control]
KEY_PLAN = "plan"  # the decider -> every worker: include these joiners after this step [control]


def inproc_root(run_id: str) -> str:
    """Store key prefix of the in-process world of a run: the current generation's record
    (``current``), the joiners' registrations (``joiner/<node id>``), the
    job-complete mark and the generations' high-water mark.

    Args:
        run_id: the rendezvous run id.

    Returns:
        The prefix, ending in ``/``.
    """
    return f"elastic_emb/{run_id}/inproc/"


KEY_CURRENT = "current"  # the newest decided generation: {generation, nodes, master_addr, master_port} [control]
KEY_JOINER = "joiner/"  # + node id: that joiner's registration, its node id [control]
# agents -> joiners: the job finished (an agent's workers all succeeded, it entered torch's exit
# barrier); no world will include a joiner any more, so a joiner still starting exits 0 [control]
KEY_COMPLETE = "complete"
# Under inproc_root(): at least the highest generation an in-process re-form wrote keys for, a
# signed decimal raised by compare-and-set before any such key (rdzv/signed_cas.py). A torch round r
# then starts at generation r + this mark, so a generation is never reused for another membership
# after a fallback (the topology agreement and the in-process keys are scoped by generation).
# (It replaced the "generations" counter, which a store writer could lower.) [control]
KEY_GENERATION_MARK = "generation_mark"
# Under round_prefix(): the generation the round started at (what an agent joining the running
# round reads; the others compute it).
KEY_ROUND_GENERATION = "generation"


def write_priority_key(run_id: str) -> str:
    """Store key of the claim of an agent that keeps losing the rendezvous state's
    compare-and-set (``rdzv/write_priority.py``): its node id and count of lost writes [control].

    Args:
        run_id: the rendezvous run id.

    Returns:
        The key.
    """
    return f"elastic_emb/{run_id}/state_write_priority"


def fingerprint_key(run_id: str) -> str:
    """Store key of the running job's fingerprint (``rdzv/fingerprint.py``) [control].

    Args:
        run_id: the rendezvous run id.

    Returns:
        The key.
    """
    return f"elastic_emb/{run_id}/job_fingerprint"


def round_prefix(run_id: str, round_: int) -> str:
    """Store key prefix of elastic_emb's keys for one rendezvous round (drain, deaths, leaves).

    Args:
        run_id: the rendezvous run id.
        round_: the rendezvous round.

    Returns:
        The prefix, ending in ``/``.
    """
    return f"elastic_emb/{run_id}/round{round_}/"


# The job's secret: when set, control values under round_prefix() are HMAC-signed (rdzv/signing.py).
ENV_JOB_SECRET = "ELASTIC_EMB_JOB_SECRET"


MAX_COUNT = 1 << 20  # the bound of every count key (acks, world_size, joiners): far above any job


def count_value(key: str, raw: object) -> int:
    """A count read from the store, as untrusted input (anyone who reaches the store can write
    anything under any key; a counter cannot be signed).

    Args:
        key: the key it was read from (for the message).
        raw: ``add``'s int, or ``get``'s decimal ASCII bytes (or str).

    Returns:
        The count, an integer in ``[0, MAX_COUNT]``.

    Raises:
        ValueError: for anything else, naming the key and the value, so a foreign write can
            neither fake a count nor make a reader loop on it.
    """
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, (bytes, bytearray, str)) and 0 < len(raw) <= 8:
        text = raw.decode("ascii", "replace") if isinstance(raw, (bytes, bytearray)) else raw
        value = int(text) if text.isascii() and text.isdigit() else -1
    else:
        value = -1
    if not 0 <= value <= MAX_COUNT:
        raise ValueError(
            f"store key {key!r} holds {raw!r:.80}, not a count in [0, {MAX_COUNT}]: a foreign write "
            f"to the rendezvous store (check who can reach the endpoint, or use a new run id)"
        )
    return value
