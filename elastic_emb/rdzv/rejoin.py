"""Agent side of the in-process rejoin after a worker crash (``--rdzv-conf resize=in_process``).

torch's agent restarts a crashed worker through ``next_rendezvous``: torch's exit and join
operations put the node into the wait list of the running round, which every other agent reads
as "a peer is restarting" and answers by restarting all its workers (restart mode). In
``resize=in_process`` mode the handler calls :func:`leave_for_rejoin` first:

1. write the node's signed ``left`` mark of the round and leave the rendezvous with torch's exit
   operation, as a SIGTERMed agent does: the survivors' workers see a departure (their next
   collective fails at once, the crashed worker's sockets being closed) and re-form without this
   node inside their processes; their agents see a departure, not a restart, and stay out;
2. wait, bounded by ``timeout``, until the survivors' decision (the ``current`` record of the
   in-process world, ``rdzv/keys.py``) is newer than the one of the crash and leaves this node
   out: only then can the node come back without being taken for the member that died;
3. the handler then joins the running round as one more participant, as a new node's agent does,
   and starts the worker with ``ELASTIC_EMB_JOINER=1``: it registers as ready and the running
   workers include it at a step boundary (``resize.py``).

No survivor restarts. The crashed worker's restart spends this node's restart budget, as with
plain torchrun. Anything else (the node alone in the round, the round moved on, a fallback
requested, no decision within ``timeout``) returns False and the handler takes torch's own join:
restart mode for this change, as before, and the ``rejoin_in_process_failed`` event says why.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elastic_emb.rdzv.decode import RendezvousView
from elastic_emb.rdzv.keys import KEY_CURRENT, KEY_FALLBACK, KEY_LEFT, inproc_root, round_prefix
from elastic_emb.rdzv.signing import Signer, read_signed

REJOIN_TIMEOUT_S = 30.0  # the survivors' detect (10 s) and decide (10 s) bounds, with margin


def _current(store: Any, signer: Signer, run_id: str, floor: int, log: Any) -> tuple[int, list] | None:
    """The in-process world's newest decision ``(generation, nodes)``; None when there is none
    of this round (a generation below ``floor``, the round's first, is a stale record of an
    earlier round)."""
    value = read_signed(store, signer, inproc_root(run_id) + KEY_CURRENT, log)
    try:
        record = json.loads(value) if value is not None else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return None
    generation, nodes = record.get("generation"), record.get("nodes")
    if not isinstance(generation, int) or not isinstance(nodes, list) or generation < floor:
        return None
    return generation, nodes


def leave_for_rejoin(tc: Any, inner: Any, store: Any, signer: Signer, *, run_id: str, round_: int, node: str,
                     was_joiner: bool, log: Any, timeout: float = REJOIN_TIMEOUT_S,
                     generation: int | None = None) -> bool:
    """Leave the running round after this node's worker crashed and wait until the survivors
    re-formed without it (module docstring). True: join the running round as a joiner now.
    ``was_joiner``: the crashed worker was started as a joiner; with no decision of this round
    naming its node it was never included, and nobody re-forms for it. ``generation``: the one
    the round started at (default: the round's number)."""
    floor = round_ if generation is None else generation
    inner.num_nodes_waiting()  # syncs torch's state
    view = RendezvousView.of(tc.current_state(inner))
    if view.round != round_ or node not in view.nodes or len(view.nodes) < 2:
        return False  # alone, or the round moved on: nobody to re-form in process
    before = _current(store, signer, run_id, floor, log)
    start = time.monotonic()
    tc.stop_heartbeats(inner)
    key = round_prefix(run_id, round_) + KEY_LEFT + node
    store.set(key, signer.sign(key, "worker_failed"))
    tc.exit_rendezvous(inner, 5.0)
    log.info("worker_failed_rejoining", round=round_, mode="in_process", timeout_s=timeout)
    if (before is None and was_joiner) or (before is not None and node not in before[1]):
        # its worker had not been included yet, or the survivors already re-formed without it
        # (after a failed collective they do so in a fraction of a second: rollcall.py)
        log.info("rejoin_not_included", round=round_, reason="the newest decision leaves this node out")
        return True
    newest = before[0] if before is not None else -1
    fallback = round_prefix(run_id, round_) + KEY_FALLBACK
    deadline = start + timeout
    why = f"the survivors did not re-form without node {node} within {timeout:g} s"
    while time.monotonic() < deadline:
        now = _current(store, signer, run_id, floor, log)
        if now is not None and now[0] > newest and node not in now[1]:
            log.info("survivors_reformed", round=round_, generation=now[0], nodes=now[1],
                     wait_s=round(time.monotonic() - start, 3))
            return True
        if read_signed(store, signer, fallback, log) is not None:
            why = "a worker asked for a restart (resize_fallback)"
            break
        inner.num_nodes_waiting()
        if RendezvousView.of(tc.current_state(inner)).round != round_:
            why = "the rendezvous round moved on"
            break
        time.sleep(0.05)
    log.warning("rejoin_in_process_failed", round=round_, mode="restart", reason=why)
    return False
