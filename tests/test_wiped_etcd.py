"""A store that lost the rendezvous state (etcd wiped) does not send the job's rounds back to 0.

:class:`~elastic_emb.rdzv.guarded.GuardedBackend` driven by an in-memory backend that loses its state.
"""

from __future__ import annotations

from datetime import timedelta

from elastic_emb.rdzv import torch_compat
from elastic_emb.rdzv.decode import RendezvousView, load_state
from elastic_emb.rdzv.guarded import GuardedBackend
from elastic_emb.rdzv.outage import OutageGuard

# -- GuardedBackend with a backend that loses its state ------------------------------------------


class _Memory:
    """torch's ``RendezvousBackend`` semantics in memory (tokens count the writes); ``wipe()``."""

    name = "memory"

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.token = 0

    def get_state(self):
        return None if self.value is None else (self.value, self.token)

    def set_state(self, state: bytes, token=None):
        if (self.value is None and token is None) or (self.value is not None and token == self.token):
            self.value, self.token = state, self.token + 1
            return state, self.token, True
        return None if self.value is None else (self.value, self.token, False)

    def wipe(self) -> None:
        self.value = None


class _Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.records.append((event, kw))

    error = info = warning


def _round_of(bits: bytes) -> int:
    return RendezvousView.of(load_state(bits)).round


def test_a_state_the_store_lost_comes_back_as_the_round_after_the_newest_seen():
    inner, log = _Memory(), _Log()
    backend = GuardedBackend(inner, OutageGuard("test", 5.0, log), timedelta(seconds=10), key="k", log=log)
    assert backend.get_state() is None  # a new job: no state, none seen
    _, token, has_set = backend.set_state(torch_compat.fresh_state(4), None)
    assert has_set and _round_of(backend.get_state()[0]) == 4
    inner.wipe()
    for _ in range(3):  # polled until someone writes: the same stand-in, one warning
        bits, token = backend.get_state()
        assert _round_of(bits) == 5 and token is None
    assert [e for e, _ in log.records] == ["rendezvous_state_lost"] and backend.lost == 1
    assert log.records[0][1]["last_round"] == 4 and log.records[0][1]["replaced_by_round"] == 5
    assert backend.set_state(bits, None)[2]  # the next write creates it (a create, not a compare)
    # a node that never saw the history created round 0 since: read as the round after the newest seen,
    # with the stored value's token, so the next honest write replaces it
    inner.wipe()
    newcomer = GuardedBackend(inner, OutageGuard("test", 5.0, log), timedelta(seconds=10), key="k", log=log)
    assert newcomer.get_state() is None
    newcomer.set_state(torch_compat.fresh_state(0), None)
    bits, token = backend.get_state()
    assert _round_of(bits) == 6 and token == inner.token and backend.lost == 2
    assert "round 0" in log.records[-1][1]["found"]
    assert backend.set_state(bits, token)[2] and _round_of(newcomer.get_state()[0]) == 6
    # a stale write to a store that lost the state answers the stand-in too, not torch's round 0
    inner.wipe()
    bits, token, has_set = backend.set_state(bits, token)
    assert not has_set and token is None and _round_of(bits) == 7
