"""The wire contract between the agent-side backend and the workers: environment variable
names and store key names.

This module is the only thing the worker side (``watch.py``, ``drain.py``) needs to agree with
the agent side (``rdzv/handler.py``) on; it imports nothing (not torch, not the handler), so a
worker, a preStop hook or a test can import it for free. Rename nothing here without every
reader: the keys are read by processes started from other versions during a rolling change.

Environment the backend puts into the agent's ``os.environ`` after each round (torchrun copies
it into every worker it then starts):

====================================  =====================================================
``ELASTIC_EMB_GENERATION``            the topology's generation (read by ``Topology.from_env``)
``ELASTIC_EMB_RDZV_ROUND``            the rendezvous round (the watcher's round keys)
``ELASTIC_EMB_RDZV_BACKEND``          the inner backend (``c10d``, ``etcd-v2``, ...)
``ELASTIC_EMB_RDZV_ENDPOINT``         the rendezvous endpoint (what the watcher reads)
``ELASTIC_EMB_RDZV_NODE``             this agent's node id in the rendezvous
``ELASTIC_EMB_MEMBERSHIP``            JSON list of node ids, index = group rank
``ELASTIC_EMB_AGENT_PID``             the agent's pid (a worker that outlives it is orphaned)
``ELASTIC_EMB_DRAIN``                 ``1`` when the agent drains before a scale-up
``ELASTIC_EMB_WATCH_INTERVAL``        the watcher's polling interval in seconds
``ELASTIC_EMB_STORE_OUTAGE_TIMEOUT``  how long the watcher treats an unreachable store as unknown
====================================  =====================================================

Store keys: torch keeps its pickled ``_RendezvousState`` under :data:`C10D_STATE_KEY` /
:data:`ETCD_STATE_KEY`; elastic_emb's own keys live under :func:`round_prefix` (one prefix per
rendezvous round, so a key of an earlier round can never be mistaken for a current one). The
control keys among them (drain request, death reports, left marks) are signed when the job has
a secret (see ``rdzv/signing.py``).
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
ENV_JOINER = "ELASTIC_EMB_JOINER"  # 1: the node joined a running world in process (resize.py)
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
KEY_STOP_CLAIM = "stop_claim"  # counter: the first rank to see a drain fixes the last step
KEY_STOP_STEP = "stop_step"  # the agreed last step
KEY_DEAD = "dead"  # counter of death reports; + "/" + node id: one report [control]
KEY_LEFT = "left/"  # + node id: the node left on purpose (reason) [control]
KEY_EVICTED = "evicted/"  # + node id: an agent removed that node from the state [control]
KEY_FALLBACK = "inproc_fallback"  # workers -> agents: an in-process re-form failed, restart us [control]


def inproc_prefix(run_id: str, generation: int) -> str:
    """Store key prefix of one in-process re-form (the decision of ``generation``), see ``resize.py``."""
    return f"elastic_emb/{run_id}/inproc/gen{generation}/"


KEY_DECISION = "decision"  # the decider -> every worker: the new generation's nodes [control]
KEY_DECIDER = "decider"  # counter: the first claimer decides
KEY_PLAN = "plan"  # the decider -> every worker: include these joiners after this step [control]


def inproc_root(run_id: str) -> str:
    """Store key prefix of the in-process world of a run: the current generation's record
    (``current``) and the joiners' registry (``joiners`` counter, ``joiner/<i>`` node ids)."""
    return f"elastic_emb/{run_id}/inproc/"


KEY_CURRENT = "current"  # the newest decided generation: {generation, nodes, master_addr, master_port} [control]
KEY_JOINERS = "joiners"  # counter of joiners registered
KEY_JOINER = "joiner/"  # + index: a joiner's node id [control]
# agents -> joiners: the job finished (an agent's workers all succeeded, it entered torch's exit
# barrier); no world will include a joiner any more, so a joiner still starting exits 0 [control]
KEY_COMPLETE = "complete"
# Counter under inproc_root(): at least the highest generation an in-process re-form wrote keys
# for (raised before any such key). A torch round r then starts at generation r + this counter, so
# a generation is never reused for another membership after a fallback (the topology agreement
# and the in-process keys are scoped by generation).
KEY_GENERATIONS = "generations"
# Under round_prefix(): the generation the round started at (what an agent joining the running
# round reads; the others compute it).
KEY_ROUND_GENERATION = "generation"


def write_priority_key(run_id: str) -> str:
    """Store key of the claim of an agent that keeps losing the rendezvous state's
    compare-and-set (``rdzv/write_priority.py``): its node id and count of lost writes [control]."""
    return f"elastic_emb/{run_id}/state_write_priority"


def round_prefix(run_id: str, round_: int) -> str:
    """Store key prefix of elastic_emb's keys for one rendezvous round (drain, deaths, leaves)."""
    return f"elastic_emb/{run_id}/round{round_}/"

# The job's secret: when set, control values under round_prefix() are HMAC-signed (rdzv/signing.py).
ENV_JOB_SECRET = "ELASTIC_EMB_JOB_SECRET"


MAX_COUNT = 1 << 20  # the bound of every count key (acks, world_size, joiners): far above any job


def count_value(key: str, raw: object) -> int:
    """A count read from the store, as untrusted input (anyone who reaches the store can write
    anything under any key; a counter cannot be signed): an integer in [0, :data:`MAX_COUNT`]
    (``add``'s int, or ``get``'s decimal ASCII bytes). Anything else raises ValueError naming the
    key and the value, so a foreign write can neither fake a count nor make a reader loop on it."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, (bytes, bytearray, str)) and 0 < len(raw) <= 8:
        text = raw.decode("ascii", "replace") if isinstance(raw, (bytes, bytearray)) else raw
        value = int(text) if text.isascii() and text.isdigit() else -1
    else:
        value = -1
    if not 0 <= value <= MAX_COUNT:
        raise ValueError(f"store key {key!r} holds {raw!r:.80}, not a count in [0, {MAX_COUNT}]: a foreign write "
                         f"to the rendezvous store (check who can reach the endpoint, or use a new run id)")
    return value
