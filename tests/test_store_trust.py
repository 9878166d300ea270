"""Whoever can write to the rendezvous store must not run code in the agent, and, when the job has
a secret (ELASTIC_EMB_JOB_SECRET), must not steer it: real torchrun agents on loopback, a real
c10d store, forged writes by a separate client (the attacker)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import time
from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist

from elastic_emb.rdzv.keys import C10D_STATE_KEY, KEY_ACKS, KEY_DEAD, KEY_DRAIN, KEY_WORLD_SIZE, round_prefix
from elastic_emb.testing.ports import free_port
from tests.helpers.agents import (
    FAST_CONF,
    Agent,
    events,
    first_commit_at,
    kill_all,
    start_agent,
    wait_for,
    worker_records,
)

WAIT = 60.0
SECRET = "0123456789abcdef0123456789abcdef"
_INPROC_CONF = FAST_CONF + ",resize=in_process"


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    yield str(tmp_path), agents
    kill_all(agents, str(tmp_path))


def _attacker(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), use_libuv=True)


class _Payload:
    """Unpickling this runs a shell command (what a store writer would plant)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _complete_round_without_participants() -> bytes:
    """torch's own state class, pickled as torch never writes it: complete, nobody in it."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    state = dr._RendezvousState()
    state.round, state.complete = 3, True
    return pickle.dumps(state)


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["pickle_payload", "complete_round_without_participants"])
def test_a_forged_rendezvous_state_never_runs_and_the_next_honest_round_replaces_it(cluster, forgery):
    """A code-running pickle, or a well-formed state that would leave every agent waiting for a
    round nobody finishes: the agents replace it with a new round and the job re-forms, rows intact."""
    tmp, agents = cluster
    port = free_port()
    agents.append(start_agent("a", tmp, port, nnodes="1:2", worker="lifecycle"))
    agents.append(start_agent("b", tmp, port, nnodes="1:2", worker="lifecycle"))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=0), WAIT, "world size 2", agents)
    marker = os.path.join(tmp, "pwned")
    if forgery == "pickle_payload":
        payload = pickle.dumps(_Payload(marker))
        assert b"system" in payload  # a real code-running pickle: pickle.loads(payload) would create marker
    else:
        payload = _complete_round_without_participants()
    t_forge = time.time()
    _attacker(port).set(C10D_STATE_KEY.format(run_id="rdzvtest"), base64.b64encode(payload))

    # The job re-forms at world size 2 and commits again; every restored row checked bit for bit.
    def ready() -> list[dict]:
        return [r for r in worker_records(tmp) if r["ev"] == "ready" and r["ws"] == 2 and r["t"] > t_forge]

    wait_for(lambda: len(ready()) >= 2, WAIT, "the job to re-form", agents)
    t_ready = max(r["t"] for r in ready())
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_ready), WAIT, "a commit after the re-form", agents)
    assert all(r["rows_ok"] for r in ready()), ready()
    assert all(a.proc.poll() is None for a in agents), "an agent stopped"
    assert not os.path.exists(marker), "the payload ran in the agent"
    replaced = [e for name in ("a", "b") for e in events(tmp, name) if e["event"] == "foreign_rendezvous_state"]
    assert replaced and {e["key"] for e in replaced} == {"torch.rendezvous.rdzvtest"}, replaced
    reason = "posix.system" if forgery == "pickle_payload" else "a complete round without participants"
    assert all(reason in e["error"] and e["replaced_by_round"] >= 1 for e in replaced), replaced


@pytest.mark.slow
def test_forged_drain_and_dead_reports_are_ignored_with_a_secret_and_a_signed_drain_works(cluster, monkeypatch):
    tmp, agents = cluster
    port = free_port()
    env = {"ELASTIC_EMB_JOB_SECRET": SECRET}
    agents.append(start_agent("a", tmp, port, extra_env=env, drain_timeout=30.0))
    wait_for(lambda: first_commit_at(tmp, world_size=1, after=0), WAIT, "world size 1", agents)
    t_b = time.time()
    agents.append(start_agent("b", tmp, port, extra_env=env, drain_timeout=30.0))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_b), WAIT, "world size 2", agents)
    round_ = [e for e in events(tmp, "a") if e["event"] == "rendezvous_round"][-1]["round"]
    b_node = f"127.0.0.1_{agents[1].pid}_0"
    prefix = round_prefix("rdzvtest", round_)
    store = _attacker(port)
    t_forge = time.time()
    store.set(prefix + KEY_DRAIN, json.dumps({"round": round_, "reason": "forged"}))
    store.set(prefix + f"{KEY_DEAD}/{b_node}", "1")
    store.add(prefix + KEY_DEAD, 1)

    # The world of two keeps stepping: 40 more steps committed at world size 2 (about 2 s of
    # steps, several agent polls and watcher intervals), nobody drained, nobody evicted.
    def steps_after() -> int:
        return len([r for r in worker_records(tmp) if r["ev"] == "commit" and r["ws"] == 2 and r["t"] > t_forge])

    wait_for(lambda: steps_after() >= 80, WAIT, "40 steps per rank after the forgery", agents)
    recs = worker_records(tmp)
    assert not [r for r in recs if r["ev"] in ("drained", "evicted") and r["t"] > t_forge]
    for name in ("a", "b"):
        kinds = [e["event"] for e in events(tmp, name) if e["timestamp"] > _iso(t_forge)]
        assert "dead_node_evicted" not in kinds and "membership_changed" not in kinds, (name, kinds)
    rejected = [e for e in events(tmp, "a") if e["event"] == "control_key_rejected"]
    assert {e["key"] for e in rejected} >= {prefix + f"{KEY_DEAD}/{b_node}"} and rejected[0]["reason"] == "unsigned"
    logs = agents[0].output() + agents[1].output()
    assert "control_key_rejected" in logs and prefix + KEY_DRAIN in logs  # the watchers said so too

    # Foreign counts (an unsigned world_size, negative or not) are refused by name before the
    # preStop client asks anything. (A foreign acks counter no longer refuses a drain: it is only
    # a hint, test_store_counters.py.)
    from elastic_emb.cli.drain import DrainError, DrainTarget, request_drain

    monkeypatch.setenv("ELASTIC_EMB_JOB_SECRET", SECRET)
    store.delete_key(prefix + KEY_DRAIN)
    target = DrainTarget(inner="c10d", endpoint=f"127.0.0.1:{port}", run_id="rdzvtest")
    signed_world = store.get(prefix + KEY_WORLD_SIZE)  # the watchers' count, signed
    assert signed_world.startswith(b"eesig1:") and signed_world.endswith(b":2") and store.add(prefix + KEY_ACKS, 0) == 0
    for key, forged in (
        (KEY_WORLD_SIZE, "-2"),
        (KEY_WORLD_SIZE, "1"),
        (KEY_WORLD_SIZE, "9" * 30),
    ):
        store.set(prefix + key, forged)
        with pytest.raises(
            DrainError, match=rf"store key '{prefix + key}' holds .*{forged[:20]}.*(unsigned|not a count in)"
        ):
            request_drain(target, timeout=5)
        store.set(prefix + key, signed_world)
    assert not store.check([prefix + KEY_DRAIN])  # nothing was asked of the workers

    # Forged acknowledgements in range (the counter at the expected 2, each rank's key written
    # without the secret) do not end the drain: the same request, signed (the preStop client),
    # returns only once both workers acknowledged themselves, after committing the agreed step.
    # A planted stop step (unsigned) and the old protocol's claim counter, pre-set: the workers
    # replace the one and ignore the other, and still agree on one step.
    store.set(prefix + "stop_step", "3")
    store.add(prefix + "stop_claim", 20)
    store.set(prefix + KEY_ACKS, "2")
    for rank in (0, 1):
        store.set(prefix + f"ack/{rank}", json.dumps({"round": round_, "rank": rank, "step": 0}))
    from structlog.testing import capture_logs

    from elastic_emb.events import configure_logging

    configure_logging()  # once, outside the capture (a set-up inside it would replace the capture)
    with capture_logs() as logged:
        outcome = request_drain(target, timeout=30)
    assert outcome.outcome == "acknowledged" and outcome.acks == 2 and outcome.stop_step is not None, outcome
    drained = lambda: [r for r in worker_records(tmp) if r["ev"] == "drained" and r["t"] > t_forge]  # noqa: E731
    wait_for(lambda: len(drained()) == 2, WAIT, "both workers' drained records", agents)
    assert {r["step"] for r in drained()} == {outcome.stop_step} and outcome.stop_step != 3, drained()
    assert prefix + "stop_step" in agents[0].output() + agents[1].output()  # the watchers' control_key_rejected
    assert {e.get("key") for e in logged if e.get("event") == "control_key_rejected"} >= {
        prefix + "ack/0",
        prefix + "ack/1",
    }
    assert any(e.get("event") == "drain_acks_unverified" and e["claimed"] == 2 for e in logged), logged


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def test_signatures_bind_the_key_and_need_the_secret():
    from elastic_emb.rdzv.signing import SecretError, Signer

    s = Signer(SECRET.encode())
    v = s.sign("elastic_emb/r/round3/dead/n1", "42")
    assert s.verify("elastic_emb/r/round3/dead/n1", v) == (b"42", "")
    assert s.verify("elastic_emb/r/round3/dead/n2", v) == (None, "bad_signature")  # moved to another node
    assert s.verify("elastic_emb/r/round4/dead/n1", v) == (None, "bad_signature")  # replayed in another round
    assert s.verify("elastic_emb/r/round3/dead/n1", b"42") == (None, "unsigned")
    assert Signer(b"y" * 32).verify("elastic_emb/r/round3/dead/n1", v) == (None, "bad_signature")
    assert Signer(None).sign("k", "42") == b"42" and Signer(None).verify("k", v) == (b"42", "")
    with pytest.raises(SecretError, match="ELASTIC_EMB_JOB_SECRET is 5 bytes"):
        Signer.from_env({"ELASTIC_EMB_JOB_SECRET": "short"})


def test_counts_read_from_the_store_are_bounded_non_negative_integers():
    from elastic_emb.rdzv.keys import MAX_COUNT, count_value

    for raw, value in ((0, 0), (7, 7), (b"2", 2), ("12", 12), (str(MAX_COUNT).encode(), MAX_COUNT)):
        assert count_value("k", raw) == value
    for raw in (
        -1,
        b"-1",
        MAX_COUNT + 1,
        2**63 - 1,
        -(2**63),
        b"",
        b" 3",
        b"3\n",
        b"0x10",
        b"1e3",
        "\u00b2",
        b"\xb2",
        b"9" * 30,
        True,
        None,
        1.5,
    ):
        with pytest.raises(ValueError, match=r"^store key 'elastic_emb/r/round1/acks' holds .*, not a count in \[0, "):
            count_value("elastic_emb/r/round1/acks", raw)


def test_drain_acks_count_only_each_ranks_own_signed_record_of_the_round():
    """rdzv/drain_acks.py on a real TCPStore: the counter is a hint; a rank counts only when its
    key verifies and names that rank and the round (a replay from another rank or round does not)."""
    from elastic_emb.rdzv.drain_acks import AckCounter, ack_record, read_expected, write_ack, write_expected
    from elastic_emb.rdzv.signing import Signer

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    signer, prefix = Signer(SECRET.encode()), round_prefix("acktest", 7)
    counter = AckCounter(store, signer, prefix, 7)
    assert read_expected(store, signer, prefix) is None
    write_expected(store, signer, prefix, 3)
    assert read_expected(store, signer, prefix) == 3
    store.set(prefix + KEY_ACKS, "3")  # forged in range: nothing verifies yet
    store.set(prefix + "ack/0", ack_record(7, 0, 5))  # unsigned
    store.set(prefix + "ack/1", signer.sign(prefix + "ack/0", ack_record(7, 1, 5)))  # signed for another key
    assert counter.count(3) == 0 and counter.steps == {}
    write_ack(store, signer, prefix, 7, 2, 5)
    write_ack(store, signer, round_prefix("acktest", 6), 6, 0, 5)  # another round's: not this one's
    assert counter.count(3) == 1 and counter.steps == {2: 5}
    write_ack(store, signer, prefix, 7, 0, 5)
    write_ack(store, signer, prefix, 7, 1, 5)
    assert counter.count(3) == 3 and counter.steps == {0: 5, 1: 5, 2: 5}
    # A record written without raising the counter (a store writer holding it at 0) is read at the
    # last look, or once verify_every passed since the previous look; never sooner.
    prefix8 = round_prefix("acktest", 8)
    fresh, periodic = (AckCounter(store, signer, prefix8, 8, verify_every=every) for every in (3600.0, 0.2))
    assert fresh.count(1) == 0 and periodic.count(1) == 0  # the first look: nothing yet
    store.set(prefix8 + "ack/0", signer.sign(prefix8 + "ack/0", ack_record(8, 0, 1)))
    assert fresh.count(1) == 0 and fresh.count(1, final=True) == 1
    time.sleep(0.25)
    assert periodic.count(1) == 1
    # Without a secret the record is all there is: one naming another rank or round is not counted.
    prefix9 = round_prefix("acktest", 9)
    store.set(prefix9 + "ack/0", ack_record(9, 1, 5))
    store.set(prefix9 + "ack/1", ack_record(8, 1, 5))
    store.set(prefix9 + KEY_ACKS, "2")
    assert AckCounter(store, Signer(None), prefix9, 9).count(2) == 0
    store.set(prefix + KEY_WORLD_SIZE, "1")  # unsigned: refused by name
    with pytest.raises(ValueError, match=rf"store key '{prefix}world_size' holds b'1', unsigned"):
        read_expected(store, signer, prefix)


@pytest.fixture
def round_store():
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    yield server
    del server


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_stop_step_is_the_first_valid_value_and_a_planted_one_is_replaced(round_store, secret):
    from structlog.testing import capture_logs

    from elastic_emb.rdzv.drain_acks import agree_stop_step
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(secret.encode() if secret else None)
    prefix = round_prefix("job", 1)
    key = prefix + "stop_step"
    assert agree_stop_step(round_store, signer, prefix, 41) == 41
    assert agree_stop_step(round_store, signer, prefix, 57) == 41  # a later rank takes the first value
    # Planted values: not a step (without a secret too), or unsigned with one. The pre-set claim
    # counter of the old protocol is meaningless now.
    round_store.add(prefix + "stop_claim", 7)
    planted = ["\u00b2", "-3", "9" * 40, "step"] + (["3"] if secret else [])
    for i, value in enumerate(planted):
        round_store.set(key, value)
        with capture_logs() as logged:
            assert agree_stop_step(round_store, signer, prefix, 100 + i, log=structlog.get_logger()) == 100 + i
        assert agree_stop_step(round_store, signer, prefix, 200) == 100 + i
        signer._rejected.clear()
        assert [e["key"] for e in logged if e["event"] == "control_key_rejected"] == [key], logged


def test_ranks_proposing_at_once_agree_on_one_stop_step(round_store):
    import threading

    from elastic_emb.rdzv.drain_acks import agree_stop_step
    from elastic_emb.rdzv.signing import Signer

    signer = Signer(SECRET.encode())
    prefix = round_prefix("job", 2)
    round_store.set(prefix + "stop_step", "5")  # planted before the drain: unsigned
    got: list[int] = []
    clients = [
        dist.TCPStore("127.0.0.1", round_store.port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(8)
    ]
    threads = [
        threading.Thread(target=lambda c=c, k=k: got.append(agree_stop_step(c, signer, prefix, 10 + k)))
        for k, c in enumerate(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 8 and len(set(got)) == 1 and got[0] in range(10, 18), got


@pytest.mark.slow
def test_a_store_writer_deleting_the_drain_count_in_a_loop_does_not_end_the_drain_early(cluster):
    """A loop deleting the round's world_size made every drain end at once ("no watchers") before
    any commit: the agents read the count their own watchers wrote to a file instead."""
    import threading

    tmp, agents = cluster
    port = free_port()
    env = {"ELASTIC_EMB_JOB_SECRET": SECRET}
    # the lifecycle worker: with the secret, everything the workers exchange (agreement, restore
    # inventories, gloo's addresses) goes through the signed store too
    kw = dict(extra_env=env, drain_timeout=60.0, nnodes="1:3", worker="lifecycle")
    agents.append(start_agent("a", tmp, port, **kw))
    agents.append(start_agent("b", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=0), WAIT, "world size 2", agents)
    round_ = [e for e in events(tmp, "a") if e["event"] == "rendezvous_round"][-1]["round"]
    key = round_prefix("rdzvtest", round_) + KEY_WORLD_SIZE
    stop = threading.Event()

    def delete_in_a_loop() -> None:
        store = _attacker(port)
        deadline = time.monotonic() + 120.0
        while not stop.is_set() and time.monotonic() < deadline:
            store.delete_key(key)
            time.sleep(0.002)  # 500 deletions a second: rank 0 restores the key once a second

    deleter = threading.Thread(target=delete_in_a_loop, daemon=True)
    deleter.start()
    try:
        time.sleep(1.0)  # the key is gone now, save for the instants after rank 0 restores it
        t_c = time.time()
        agents.append(start_agent("c", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=3, after=t_c), WAIT, "world size 3", agents)
    finally:
        stop.set()
        deleter.join(timeout=10)
    finished = [
        {k: e[k] for k in ("node", "round", "outcome", "expected", "stop_step")}
        for name in ("a", "b")
        for e in events(tmp, name)
        if e["event"] == "drain_finished" and e["timestamp"] > _iso(t_c)
    ]
    assert finished and {e["outcome"] for e in finished} == {"acknowledged"}, finished
    assert {e["round"] for e in finished} == {round_}, finished
    assert {e["expected"] for e in finished} == {2}, finished
    # Both workers stopped after the same committed step, and the world of three resumed after it.
    drained = [r for r in worker_records(tmp) if r["ev"] == "drained" and r["t"] > t_c]
    stop_steps = {e["stop_step"] for e in finished}
    assert len(drained) == 2 and {r["step"] for r in drained} == stop_steps, (drained, finished)
    ready = [r for r in worker_records(tmp) if r["ev"] == "ready" and r["ws"] == 3]
    assert {r["resume"] for r in ready} == {next(iter(stop_steps)) + 1}, ready
    assert len(ready) == 3 and all(r["rows_ok"] for r in ready), ready


def test_the_workers_store_signs_every_value_and_refuses_a_forged_one(round_store):
    """With a job secret the workers' store (MASTER_ADDR:MASTER_PORT) holds only signed values,
    under a prefix derived from the secret: a store writer can neither forge an agreement verdict
    or an inventory nor move a value, and without the secret it cannot even name the keys (the
    counters included, which no signature covers)."""
    from elastic_emb import UnsafeStateError
    from elastic_emb.rdzv.signing import SignedStore, Signer, signed_store

    assert signed_store(round_store, {}) is round_store  # no secret: the store as it is
    store = signed_store(round_store, {"ELASTIC_EMB_JOB_SECRET": SECRET})
    assert isinstance(store, SignedStore) and signed_store(store, {"ELASTIC_EMB_JOB_SECRET": SECRET}) is store
    prefix = Signer(SECRET.encode()).key_prefix() + "/"  # (a PrefixStore joins with "/")
    assert prefix != Signer(b"another secret of enough bytes").key_prefix()
    store.set("verdict", b"agreed")
    assert store.get("verdict") == b"agreed" and round_store.get(prefix + "verdict").startswith(b"eesig1:")
    assert not round_store.check(["verdict"])  # the plain name holds nothing a writer could spoil
    store.multi_set(["a", "b"], [b"1", b"2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.compare_set("c", "", b"x") == b"x"  # created
    assert store.compare_set("c", b"x", b"y") == b"y"  # swapped
    assert store.compare_set("c", b"x", b"z") == b"y"  # lost: the current value, verified
    assert store.add("n", 2) == 2 and round_store.add(prefix + "n", 0) == 2  # a counter, under the prefix
    round_store.set("n", b"garbage")  # a writer without the secret spoils a name nobody uses
    assert store.add("n", 1) == 3
    # a writer who knew the prefix still cannot forge or move a value
    round_store.set(prefix + "verdict", b'{"message": "forged mismatch"}')
    with pytest.raises(UnsafeStateError, match="store key 'verdict' holds a value unsigned"):
        store.get("verdict")
    round_store.set(prefix + "a", round_store.get(prefix + "b"))  # a signed value moved to another key
    with pytest.raises(UnsafeStateError, match="store key 'a' holds a value bad signature"):
        store.multi_get(["a"])
    round_store.set(prefix + "c", b"planted")
    with pytest.raises(UnsafeStateError, match="'c'"):
        store.compare_set("c", b"y", b"w")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_store_writer_forging_every_counter_during_in_process_resizes_stops_nothing(cluster):
    """With the secret, a hostile writer holds every counter of the rendezvous store at values that
    are not counts (TCPStore drops the connection of a client whose add meets one: the agents read
    dead and acks every poll), pre-sets the retired decider and joiners counters, and plants
    unsigned decisions and a generation mark, while c joins a world of two in process and leaves
    again. The job goes on: no agent stops, and every start and re-form restores rows bit-exact."""
    import threading

    from elastic_emb.rdzv.keys import KEY_GENERATION_MARK, inproc_prefix, inproc_root

    tmp, agents = cluster
    port = free_port()
    kw = dict(extra_env={"ELASTIC_EMB_JOB_SECRET": SECRET}, worker="lifecycle", conf=_INPROC_CONF)
    agents.append(start_agent("a", tmp, port, **kw))
    agents.append(start_agent("b", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=2, after=0), WAIT, "world size 2", agents)
    round_ = [e for e in events(tmp, "a") if e["event"] == "rendezvous_round"][-1]["round"]
    root = inproc_root("rdzvtest")
    attacker = _attacker(port)
    planted = [inproc_prefix("rdzvtest", g) + "decision" for g in range(60)]
    for key in planted:  # once, before any re-form: the decider replaces the one of its generation
        attacker.set(key, json.dumps({"generation": 0, "nodes": ["forged"], "master_addr": "x", "master_port": 1}))
    for g in range(60):
        attacker.set(inproc_prefix("rdzvtest", g) + "decider", "1000")  # the old claim, pre-set
    held = [root + "joiners", root + "generations", root + KEY_GENERATION_MARK] + [
        round_prefix("rdzvtest", r) + k for r in range(round_ + 10) for k in (KEY_DEAD, KEY_ACKS)
    ]
    stop = threading.Event()

    def forge_in_a_loop() -> None:
        store = _attacker(port)
        values = [b"garbage", b"-7", b"9" * 20, b"0", b""]
        deadline, i = time.monotonic() + 240.0, 0
        while not stop.is_set() and time.monotonic() < deadline:
            for key in held:
                store.set(key, values[i % len(values)])
            i += 1
            time.sleep(0.01)

    forger = threading.Thread(target=forge_in_a_loop, daemon=True)
    t_forge = time.time()
    forger.start()
    try:
        time.sleep(1.0)  # several agent polls with the counters forged
        t_c = time.time()
        agents.append(start_agent("c", tmp, port, **kw))
        wait_for(lambda: first_commit_at(tmp, world_size=3, after=t_c), WAIT, "world size 3 (c joined)", agents)
        t_leave = agents[2].signal(signal.SIGTERM)
        wait_for(lambda: first_commit_at(tmp, world_size=2, after=t_leave), WAIT, "world size 2 (c left)", agents)
        t_back = first_commit_at(tmp, world_size=2, after=t_leave)

        def steps_after() -> int:
            return len([r for r in worker_records(tmp) if r["ev"] == "commit" and r["ws"] == 2 and r["t"] > t_back])

        wait_for(lambda: steps_after() >= 20, WAIT, "10 more steps per rank at world size 2", agents)
    finally:
        stop.set()
        forger.join(timeout=10)
    assert all(a.proc.poll() is None for a in agents[:2]), "an agent stopped"
    recs = worker_records(tmp)
    starts = [r for r in recs if r["ev"] in ("ready", "reformed") and r["t"] > t_forge]
    assert {r["ws"] for r in starts} >= {2, 3}, starts  # the world grew and shrank, in process or not
    assert starts and all(r["rows_ok"] for r in starts), starts
    logs = agents[0].output() + agents[1].output()
    assert "control_key_rejected" in logs and "Broken pipe" not in logs, logs[-3000:]
