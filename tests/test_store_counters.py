"""Every counter the job keeps in an untrusted store, forged: pre-set high, negative, not a number,
empty, deleted, held at 0. None of them may cut a reader off the store (TCPStore drops the
connection of a client whose ``add`` meets a value that is not a number), freeze the job, or make
it decide anything: a counter is a hint verified against signed records, or is re-derived from
them. Real TCPStore and HashStore, no processes (the real-process test is in test_store_trust.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist

from elastic_emb.rdzv.keys import KEY_DEAD, MAX_COUNT, round_prefix
from elastic_emb.testing.ports import free_port

SECRET = "0123456789abcdef0123456789abcdef"
# what a store writer puts under a counter's key
FORGED = [b"garbage", b"-5", b"9" * 20, b"", b"12abc", b" 7", str(MAX_COUNT + 1).encode(), b"\xff\x00"]


@pytest.fixture(params=["tcp", "hash"])
def store(request):
    if request.param == "hash":
        yield dist.HashStore()
        return
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5), use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5), use_libuv=True)
    yield client
    del client, server


def _alive(store) -> bool:
    store.set("probe", b"1")
    return store.get("probe") == b"1"


def test_a_forged_counter_value_would_cut_a_tcpstore_client_off_with_add():
    """Why no counter is read with ``add``: the server's parse fails and it drops the connection."""
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5), use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5), use_libuv=True)
    server.set("k", b"garbage")
    with pytest.raises(dist.DistNetworkError):
        client.add("k", 0)
    with pytest.raises(dist.DistNetworkError):
        client.get("probe")  # the connection is gone for good


def test_peek_read_count_and_increment_survive_every_forged_value(store):
    from elastic_emb.rdzv.counters import increment, peek, read_count

    assert peek(store, "c") is None and read_count(store, "c") == 0 and not store.check(["c"])  # no wait, no write
    assert increment(store, "c") == 1 and increment(store, "c", 2) == 3 and read_count(store, "c") == 3
    assert store.add("c", 1) == 4  # interoperable with add: the same decimal value
    for forged in FORGED:
        store.set("c", forged)
        assert peek(store, "c") == forged and read_count(store, "c") is None, forged
        with pytest.raises(ValueError, match=r"store key 'c' holds .*not a count"):
            increment(store, "c")
        assert store.get("c") == forged and _alive(store), forged  # left as it was, connection intact
    store.set("c", str(MAX_COUNT).encode())
    assert read_count(store, "c") == MAX_COUNT
    with pytest.raises(ValueError):
        increment(store, "c")  # would pass the bound
    store.delete_key("c")
    assert read_count(store, "c") == 0 and increment(store, "c") == 1


def test_a_counter_in_the_signed_workers_store_is_signed_and_a_forged_one_refused(store):
    from elastic_emb import UnsafeStateError
    from elastic_emb.rdzv.counters import increment, read_count
    from elastic_emb.rdzv.signing import SignedStore, Signer

    signed = SignedStore(store, Signer(SECRET.encode()))
    assert increment(signed, "instances/rank0") == 1 and increment(signed, "instances/rank0") == 2
    assert store.get("instances/rank0").startswith(b"eesig1:") and read_count(signed, "instances/rank0") == 2
    for forged in (b"7", b"garbage"):
        store.set("instances/rank0", forged)
        with pytest.raises(UnsafeStateError, match="store key 'instances/rank0' holds a value unsigned"):
            increment(signed, "instances/rank0")
        assert _alive(store)


def test_drain_acks_hint_forged_never_raises_and_the_records_are_read_within_verify_every(store):
    from structlog.testing import capture_logs

    from elastic_emb.rdzv.drain_acks import AckCounter, ack_record, write_ack
    from elastic_emb.rdzv.signing import Signer

    signer, prefix = Signer(SECRET.encode()), round_prefix("acks", 3)
    for forged in FORGED:
        store.set(prefix + "acks", forged)
        write_ack(store, signer, prefix, 3, 0, 9)  # the record is written; the hint is left as it is
        assert store.get(prefix + "acks") == forged and _alive(store)
    counter = AckCounter(store, signer, prefix, 3, log=structlog.get_logger(), verify_every=0.2)
    with capture_logs() as logged:
        assert counter.hint() is None and counter.count(2) == 1  # the first look reads the records
        key = prefix + "ack/1"
        store.set(key, signer.sign(key, ack_record(3, 1, 9)))
        assert counter.count(2) == 1  # the hint did not change: not looked again yet
        time.sleep(0.25)
        assert counter.count(2) == 2 and counter.steps == {0: 9, 1: 9}
    assert [e["event"] for e in logged].count("drain_acks_hint_foreign") == 1, logged
    # Held at 0 by a loop, or deleted: the same bound. Forged high: the records are read at once,
    # and only verified ones count.
    for hint in (b"0", None, str(MAX_COUNT).encode()):
        p = round_prefix("acks", 4)
        store.delete_key(p + "acks") if hint is None else store.set(p + "acks", hint)
        c = AckCounter(store, signer, p, 4, verify_every=0.2)
        assert c.count(1) == 0
        store.set(p + "ack/0", signer.sign(p + "ack/0", ack_record(4, 0, 1)))
        if hint == str(MAX_COUNT).encode():
            assert c.count(1) == 1
        else:
            time.sleep(0.25)
            assert c.count(1) == 1
        store.delete_key(p + "ack/0")


def test_liveness_reads_signed_dead_reports_whatever_the_dead_counter_holds(store):
    from elastic_emb.rdzv.liveness import Liveness
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(SECRET.encode())
    prefix = round_prefix("live", 5)
    members = ("a", "b", "c")
    for forged in [*FORGED, b"0", None, str(MAX_COUNT).encode()]:
        store.delete_key(prefix + KEY_DEAD) if forged is None else store.set(prefix + KEY_DEAD, forged)
        for n in members:
            store.delete_key(prefix + f"{KEY_DEAD}/{n}")
        live = Liveness("live", "a", signer, 30.0, structlog.get_logger(), verify_every=0.2)
        assert live.take_reported_dead(5, members, store) == []
        store.set(prefix + f"{KEY_DEAD}/c", "1")  # unsigned: never counts
        key = prefix + f"{KEY_DEAD}/b"
        store.set(key, signer.sign(key, "4242"))  # a real report, the counter not raised (held)
        deadline = time.monotonic() + 5.0
        found: list[str] = []
        while not found and time.monotonic() < deadline:
            found = live.take_reported_dead(5, members, store)
            time.sleep(0.02)
        assert found == ["b"] and live.dead == {"b"}, forged
        assert _alive(store)


def test_the_generation_mark_is_signed_raised_by_compare_and_set_and_a_forged_one_replaced(store):
    """The in-process generations' high-water mark (was a counter a writer could lower or poison):
    only a signed value counts, a raise never lowers it, and a foreign value is replaced."""
    from elastic_emb.inprocess.joiners import raise_generations
    from elastic_emb.rdzv.keys import KEY_GENERATION_MARK, inproc_root
    from elastic_emb.rdzv.signed_cas import read_mark
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(SECRET.encode())
    key = inproc_root("gen") + KEY_GENERATION_MARK
    assert read_mark(store, signer, key) == 0
    raise_generations(store, "gen", 7, signer)
    raise_generations(store, "gen", 5, signer)  # lower: left at 7
    assert read_mark(store, signer, key) == 7
    for forged in [*FORGED, b"999999", signer.sign(key + "x", "999999")]:  # unsigned, or moved from another key
        store.set(key, forged)
        assert read_mark(store, signer, key) == 0 and _alive(store)  # never raises the generation
        raise_generations(store, "gen", 9, signer)
        assert read_mark(store, signer, key) == 9, forged  # replaced
    store.delete_key(key)
    raise_generations(store, "gen", 3, signer)
    assert read_mark(store, signer, key) == 3


def test_the_decision_is_the_first_valid_signed_claim_and_a_planted_one_is_replaced(store):
    """The decider claimed with a counter (the first add == 1 decides): a pre-set counter made
    nobody decide. Now the decision key itself is claimed by compare-and-set of a signed value."""
    import threading

    from elastic_emb.rdzv.signed_cas import claim_signed
    from elastic_emb.rdzv.signing import Signer, read_signed

    signer = Signer(SECRET.encode())
    key = "elastic_emb/r/inproc/gen4/decision"
    for planted in [None, *FORGED, signer.sign("elsewhere", '{"nodes": ["x"]}')]:
        store.delete_key(key) if planted is None else store.set(key, planted)
        assert claim_signed(store, signer, key, '{"nodes": ["a"]}', timeout=5.0)
        assert read_signed(store, signer, key) == b'{"nodes": ["a"]}', planted
        assert not claim_signed(store, signer, key, '{"nodes": ["b"]}')  # a second decider loses
        assert read_signed(store, signer, key) == b'{"nodes": ["a"]}'
    # Deciders at once (survivors that disagree on who decides): exactly one wins.
    store.delete_key(key)
    won: list[str] = []
    threads = [
        threading.Thread(target=lambda n=n: claim_signed(store, signer, key, n) and won.append(n)) for n in "abcd"
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1 and read_signed(store, signer, key) == won[0].encode(), won


def test_joiners_are_re_derived_from_signed_registrations_of_present_nodes(store):
    """No joiners counter: a present non-member counts once its signed registration verifies."""
    from types import SimpleNamespace

    from elastic_emb.inprocess.joiners import JoinPlan
    from elastic_emb.rdzv.keys import KEY_JOINER, inproc_root
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(SECRET.encode())
    plan = JoinPlan(SimpleNamespace(store=store, run_id="join"), signer)
    root = inproc_root("join")
    store.set(root + "joiners", b"garbage")  # the retired counter, poisoned: nobody reads it
    assert plan.ready(("a", "b"), ["a", "b", "c"]) == []  # c present, not registered yet
    store.set(root + KEY_JOINER + "c", b"c")  # unsigned
    store.set(root + KEY_JOINER + "d", signer.sign(root + KEY_JOINER + "c", "d"))  # moved
    assert plan.ready(("a", "b"), ["a", "b", "c", "d"]) == []
    for n in ("d", "c"):
        store.set(root + KEY_JOINER + n, signer.sign(root + KEY_JOINER + n, n))
    store.set(root + KEY_JOINER + "e", signer.sign(root + KEY_JOINER + "e", "e"))  # registered, not present
    assert plan.ready(("a", "b"), ["a", "b", "c", "d"]) == ["c", "d"]  # the state's order
    assert plan.ready(("a", "b"), ["a", "b", "d"]) == ["d"] and _alive(store)


def test_an_included_joiners_registration_is_spent(store):
    """A joiner included and then lost (its agent still a participant until its heartbeat expires)
    does not count as registered again when the world re-forms without it: the registration is
    deleted at its inclusion. A new worker of that node registers anew."""
    from types import SimpleNamespace

    from elastic_emb.inprocess.joiners import JoinPlan
    from elastic_emb.rdzv.keys import KEY_JOINER, inproc_root
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(SECRET.encode())
    plan = JoinPlan(SimpleNamespace(store=store, run_id="spent"), signer)
    key = inproc_root("spent") + KEY_JOINER + "b"
    store.set(key, signer.sign(key, "b"))
    assert plan.ready(("a",), ["a", "b"]) == ["b"]
    plan.included(("a", "b"))
    assert not store.check([key])
    assert plan.ready(("a",), ["a", "b"]) == []  # b lost, its agent not yet expired: not a joiner
    store.set(key, signer.sign(key, "b"))  # b's next worker registers
    assert plan.ready(("a",), ["a", "b"]) == ["b"]
