"""elastic_emb.rdzv.torch_compat: every entry point against torch's real dynamic rendezvous on a
real c10d TCPStore (loopback), and the import-time check failing, with its one-line error, when
torch's names or their meaning change."""

from __future__ import annotations

import pathlib
import re
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

from elastic_emb.rdzv import torch_compat as tc
from elastic_emb.rdzv.decode import RendezvousView, dump_state, load_state, node_id
from elastic_emb.testing.ports import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_bound_is_the_checked_range():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"torch>=2\.11,<2\.16"', text), "pyproject's torch pin differs from SUPPORTED_TORCH"
    assert tc.SUPPORTED_TORCH == ">=2.11,<2.16"


def test_check_fails_with_one_clear_error_on_a_renamed_field(monkeypatch):
    class OldState:  # torch before the rename: last_keep_alives, not last_heartbeats
        def __init__(self):
            self.round, self.complete, self.closed = 0, False, False
            self.participants, self.wait_list, self.redundancy_list = {}, set(), set()
            self.last_keep_alives = {}

    monkeypatch.setattr(dr, "_RendezvousState", OldState)
    with pytest.raises(tc.TorchCompatError) as info:
        tc._verify()
    msg = str(info.value)
    assert "last_heartbeats" in msg and tc.SUPPORTED_TORCH in msg and "--rdzv-backend=c10d" in msg, msg
    assert "\n" not in msg


def test_check_fails_when_set_state_arity_changes(monkeypatch):
    real_sync = dr._BackendRendezvousStateHolder.sync

    def old_sync(self):  # a torch whose holder expects set_state -> (bytes, token)
        if self._dirty:
            state_bits, self._token = self._backend.set_state(dump_state(self._state), self._token)
            return True
        return real_sync(self)

    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "sync", old_sync)
    with pytest.raises(tc.TorchCompatError, match=r"set_state's \(bytes, token, has_set\)"):
        tc._verify()


def test_check_fails_when_the_poll_pause_moves(monkeypatch):
    monkeypatch.delattr(dr, "_delay")
    with pytest.raises(tc.TorchCompatError, match=r"no _delay"):
        tc._verify()


@pytest.fixture
def inner(monkeypatch):
    """torch's DynamicRendezvousHandler on a real c10d store, one node, after its first round."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(dr, "_delay", dr._delay)  # shorten_rendezvous_polls patches it: undo after
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="compat",
        min_nodes=1,
        max_nodes=2,
        is_host="1",
        last_call_timeout="1",
        keep_alive_interval="1",
        keep_alive_max_attempt="10",  # expiry 10 s: the stale heartbeat written below stays far from it
    )
    backend, store = create_backend(params)
    handler = tc.create_inner_handler(store, backend, params)
    tc.shorten_rendezvous_polls(0.05)
    assert dr._delay is not tc._PATCHED_DELAY["original"]
    start = time.monotonic()
    handler.next_rendezvous()
    # the 1 s poll pause is shortened: one node, last call 1 s, completes well below 1 + 1 s polls
    assert time.monotonic() - start < 30
    handler.test_params = params
    yield handler
    tc.stop_heartbeats(handler)


def test_every_entry_point_on_a_real_rendezvous(inner):
    tc.check_handler(inner)
    me = tc.this_node(inner)
    assert tc.settings(inner).run_id == "compat"
    view = RendezvousView.of(tc.current_state(inner))
    assert view.complete and view.nodes == (node_id(me),)

    store = tc.agent_store(inner)
    store.set("compat/probe", b"1")
    assert store.get("compat/probe") == b"1"
    assert tc.heartbeat_lock(inner).acquire(timeout=5)
    tc.heartbeat_lock(inner).release()

    # wrap_state_backend: every state read goes through the wrapper from now on
    seen = []

    class Counting:
        def __init__(self, b):
            self.b = b

        name = property(lambda self: self.b.name)

        def get_state(self):
            seen.append("get")
            return self.b.get_state()

        def set_state(self, state, token=None):
            seen.append("set")
            return self.b.set_state(state, token)

    tc.wrap_state_backend(inner, Counting)
    tc.set_cache_duration(inner, 0)

    # FreshHeartbeat through run_op: an old heartbeat is rewritten, through the wrapped backend
    holder, executor = tc.second_writer(inner)
    holder.sync()
    old = datetime.now(timezone.utc) - timedelta(seconds=1.5)  # stale, not expired (10 s)
    holder.state.last_heartbeats[me] = old
    holder.mark_dirty()
    assert holder.sync() is True
    tc.run_op(inner, tc.FreshHeartbeat(0.5), 5.0)
    assert "set" in seen
    assert tc.current_state(inner).last_heartbeats[me] > old

    # credit_heartbeats: a heartbeat alive when an outage began moves forward by its length
    bits = dump_state(tc.current_state(inner))
    beat = tc.current_state(inner).last_heartbeats[me]
    credited = load_state(tc.credit_heartbeats(bits, beat + timedelta(seconds=1), 7.0, timedelta(seconds=3)))
    assert credited.last_heartbeats[me] == beat + timedelta(seconds=7)
    assert tc.credit_heartbeats(bits, beat - timedelta(seconds=10), 7.0, timedelta(seconds=3)) == bits  # expired

    # remove_nodes: a node that a second writer put in the wait list is removed
    ghost = dr._NodeDesc("ghost", 4242, 0)
    holder.sync()
    holder.state.wait_list.add(ghost)
    holder.state.last_heartbeats[ghost] = datetime.now(timezone.utc)
    holder.mark_dirty()
    assert holder.sync() is True
    assert tc.remove_nodes(inner, {node_id(ghost)}) == [node_id(ghost)]
    holder.sync()
    assert ghost not in holder.state.wait_list and ghost not in holder.state.last_heartbeats
    assert tc.remove_nodes(inner, {"nobody_1_0"}) == []

    # EarlyCompletion: marks a round after the running one complete when exactly the expected
    # nodes joined (torch's own context and action), and says FINISH otherwise
    log = _Log()
    early = tc.EarlyCompletion(inner, frozenset({node_id(me)}), after_round=view.round, interval=0.05, log=log)
    try:
        pending = dr._RendezvousState()
        pending.round, pending.participants[me] = view.round + 1, 0
        ctx = dr._RendezvousContext(me, pending, tc.settings(inner))
        assert early(ctx, time.monotonic() + 1) == tc.Action.MARK_RENDEZVOUS_COMPLETE
        pending.participants[ghost] = 1
        assert early(ctx, time.monotonic() + 1) == tc.Action.FINISH
        pending.complete = True
        assert early(ctx, time.monotonic() + 1) == tc.Action.FINISH
    finally:
        early.stop()
    assert not log.lines

    # exit_rendezvous: torch's exit operation removes this node
    tc.stop_heartbeats(inner)
    tc.exit_rendezvous(inner, 5.0)
    holder.sync()
    assert me not in holder.state.participants


def test_join_complete_round_adds_a_second_node_to_the_running_round(inner):
    """The in-process join: a second node (its own handler on the same store) becomes a participant
    of the complete round without a new round; a third finds no room (max_nodes=2)."""
    params = inner.test_params
    view = RendezvousView.of(tc.current_state(inner))
    second_params = RendezvousParameters(
        backend="c10d",
        endpoint=params.endpoint,
        run_id="compat",
        min_nodes=1,
        max_nodes=2,
        is_host="0",
        local_addr="127.0.0.2",
    )
    backend, store = create_backend(second_params)
    second = tc.create_inner_handler(store, backend, second_params)
    assert tc.join_complete_round(second) == (1, 2)
    tc.start_heartbeats(second)
    try:
        after = RendezvousView.of(tc.current_state(second))
        assert after.round == view.round and after.complete
        assert after.nodes == view.nodes + (node_id(tc.this_node(second)),)
        round_store = tc.round_store(second)
        round_store.set("probe", b"x")  # the round's prefix store, as torch hands it to the agent
        assert tc.agent_store(second).get(f"torch.rendezvous.compat.{view.round}/probe") == b"x"
        backend3, store3 = create_backend(
            RendezvousParameters(
                backend="c10d",
                endpoint=params.endpoint,
                run_id="compat",
                min_nodes=1,
                max_nodes=2,
                is_host="0",
                local_addr="127.0.0.3",
            )
        )
        third = tc.create_inner_handler(store3, backend3, second_params)
        assert tc.join_complete_round(third) is None
    finally:
        tc.stop_heartbeats(second)


class _Log:
    def __init__(self):
        self.lines = []
        self._lock = threading.Lock()

    def warning(self, event, **kw):
        with self._lock:
            self.lines.append((event, kw))
