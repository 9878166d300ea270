"""Agent side of the in-process rejoin after a worker crash (``--rdzv-conf resize=in_process``).

:func:`leave_for_rejoin` makes the node leave the running round (a signed ``left`` mark and
torch's exit operation, so the survivors re-form in process instead of restarting) and waits,
bounded, until the survivors' decision leaves it out; the handler then joins the running round as
a joiner. Anything else answers False and the change takes torch's own join: restart mode.

Design: ``docs/RDZV.md`` (section "In-process rejoin after a worker crash").
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


def leave_for_rejoin(
    tc: Any,
    inner: Any,
    store: Any,
    signer: Signer,
    *,
    run_id: str,
    round_: int,
    node: str,
    was_joiner: bool,
    log: Any,
    timeout: float = REJOIN_TIMEOUT_S,
    generation: int | None = None,
) -> bool:
    """Leave the running round after this node's worker crashed and wait until the survivors
    re-formed without it.

    Logs ``worker_failed_rejoining`` when it leaves, then ``survivors_reformed`` or
    ``rejoin_not_included`` on success, ``rejoin_in_process_failed`` (with the reason) otherwise.

    Args:
        tc: the ``torch_compat`` module.
        inner: torch's handler.
        store: the round-key store.
        signer: the job's control-key signer.
        run_id: the rendezvous run id.
        round_: the running round.
        node: this node's id.
        was_joiner: the crashed worker was started as a joiner; with no decision of this round
            naming its node it was never included, and nobody re-forms for it.
        log: a structlog logger.
        timeout: seconds to wait for the survivors' decision.
        generation: the generation the round started at (default: the round's number); older
            decisions are stale.

    Returns:
        True: join the running round as a joiner now. False: take torch's own join (the node is
        alone, the round moved on, a fallback was requested, or no decision came in time); the
        node has left the round unless it was alone or the round had moved on.
    """
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
        # (after a failed collective they do so quickly: inprocess/rollcall.py)
        log.info("rejoin_not_included", round=round_, reason="the newest decision leaves this node out")
        return True
    newest = before[0] if before is not None else -1
    fallback = round_prefix(run_id, round_) + KEY_FALLBACK
    deadline = start + timeout
    why = f"the survivors did not re-form without node {node} within {timeout:g} s"
    while time.monotonic() < deadline:
        now = _current(store, signer, run_id, floor, log)
        if now is not None and now[0] > newest and node not in now[1]:
            log.info(
                "survivors_reformed",
                round=round_,
                generation=now[0],
                nodes=now[1],
                wait_s=round(time.monotonic() - start, 3),
            )
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
