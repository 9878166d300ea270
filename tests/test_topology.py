"""Topology record: environment parsing, validators, fingerprint, and the agreement protocol
run by real processes over a real TCPStore on loopback."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from elastic_emb.errors import AgreementTimeout, TopologyDisagreement, TopologyError
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import run_ranks, torchrun_env
from elastic_emb.topology import SHARED_FIELDS, Topology, agree, evaluate, largest_power_of_two_at_most

BASE_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job7",
    "ELASTIC_EMB_GENERATION": "3",
    "ELASTIC_EMB_BACKEND": "gloo",
}


def test_from_env_reads_torchrun_variables():
    t = Topology.from_env(BASE_ENV)
    assert (t.run_id, t.generation, t.rank, t.world_size) == ("job7", 3, 1, 4)
    assert (t.local_rank, t.local_world_size, t.node_rank, t.num_nodes) == (1, 2, 0, 2)
    assert t.ep_size == 4 and t.backend == "gloo" and t.master_port == 29500
    assert t.owns_rows


def test_defaults_are_documented_fallbacks():
    env = {k: v for k, v in BASE_ENV.items() if k not in ("ELASTIC_EMB_GENERATION", "TORCHELASTIC_RUN_ID")}
    env["WORLD_SIZE"] = "3"
    env["GROUP_WORLD_SIZE"] = "2"
    t = Topology.from_env(env)
    assert t.generation == 0 and t.run_id == "none" and t.ep_size == 2
    assert not Topology.from_env({**env, "RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"}).owns_rows


@pytest.mark.parametrize(
    "var,value,fragment",
    [
        ("RANK", None, "RANK is not set"),
        ("WORLD_SIZE", None, "WORLD_SIZE is not set"),
        ("MASTER_ADDR", None, "MASTER_ADDR is not set"),
        ("MASTER_PORT", None, "MASTER_PORT is not set"),
        ("RANK", "one", "RANK='one' is not an integer"),
        ("LOCAL_RANK", "-1", "LOCAL_RANK='-1' must be >= 0"),
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' must be >= 1"),
        ("RANK", "4", "from RANK"),
        ("LOCAL_RANK", "2", "from LOCAL_RANK"),
        ("ELASTIC_EMB_EP_SIZE", "3", "from ELASTIC_EMB_EP_SIZE"),
        ("ELASTIC_EMB_EP_SIZE", "8", "from ELASTIC_EMB_EP_SIZE"),
        ("MASTER_PORT", "70000", "from MASTER_PORT"),
        ("MASTER_PORT", "http", "MASTER_PORT='http' is not an integer"),
        ("GROUP_RANK", "2", "from GROUP_RANK"),
        ("GROUP_WORLD_SIZE", "5", "from GROUP_WORLD_SIZE"),
        ("TORCHELASTIC_RUN_ID", "", "from TORCHELASTIC_RUN_ID"),
        ("ELASTIC_EMB_BACKEND", "mpi", "ELASTIC_EMB_BACKEND='mpi' is not one of 'nccl' or 'gloo'"),
        ("ELASTIC_EMB_GENERATION", "x", "ELASTIC_EMB_GENERATION='x' is not an integer"),
    ],
)
def test_every_bad_value_names_its_variable(var, value, fragment):
    env = dict(BASE_ENV)
    if value is None:
        env.pop(var)
    else:
        env[var] = value
    with pytest.raises(TopologyError) as exc:
        Topology.from_env(env)
    assert fragment in str(exc.value)
    assert not isinstance(exc.value, KeyError)


def test_record_is_frozen_strict_and_closed():
    t = Topology.from_env(BASE_ENV)
    with pytest.raises(ValidationError, match="frozen"):
        t.rank = 2  # type: ignore[misc]
    with pytest.raises(TopologyError, match="colour=.blue. is not a topology field"):
        Topology.build(**t.model_dump(), colour="blue")
    with pytest.raises(TopologyError, match="rank"):
        Topology.build(**{**t.model_dump(), "rank": "1"})  # strict: no str->int coercion
    assert Topology.from_json(t.to_json()) == t


topologies = st.integers(1, 64).flatmap(
    lambda ws: st.builds(
        lambda rank, gen, port, rid: Topology.build(
            run_id=rid,
            generation=gen,
            rank=rank,
            world_size=ws,
            local_rank=0,
            local_world_size=1,
            node_rank=rank,
            num_nodes=ws,
            ep_size=largest_power_of_two_at_most(ws),
            backend="gloo",
            master_addr="127.0.0.1",
            master_port=port,
        ),
        st.integers(0, ws - 1),
        st.integers(0, 10_000),
        st.integers(1, 65535),
        st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=12),
    )
)


@settings(max_examples=200, deadline=None)
@given(topologies)
def test_fingerprint_covers_shared_fields_only(t):
    other_rank = (t.rank + 1) % t.world_size
    same_job = t.with_changes(rank=other_rank, node_rank=other_rank)
    assert same_job.fingerprint() == t.fingerprint()
    assert t.fingerprint() == Topology.from_json(t.to_json()).fingerprint()
    assert t.with_changes(generation=t.generation + 1).fingerprint() != t.fingerprint()
    assert len(t.fingerprint()) == 16


@settings(max_examples=300, deadline=None)
@given(
    ws=st.integers(1, 4096),
    rank=st.integers(-2, 5000),
    ep=st.integers(0, 5000),
    port=st.integers(-5, 70000),
)
def test_validators_accept_exactly_the_valid_records(ws, rank, ep, port):
    valid = 0 <= rank < ws and ep >= 1 and (ep & (ep - 1)) == 0 and ep <= ws and 1 <= port <= 65535
    kwargs = dict(
        run_id="r",
        generation=0,
        rank=rank,
        world_size=ws,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=ep,
        backend="gloo",
        master_addr="h",
        master_port=port,
    )
    if valid:
        assert Topology.build(**kwargs).rank == rank
    else:
        with pytest.raises(TopologyError):
            Topology.build(**kwargs)


def _record(rank, ws, **over):
    base = dict(
        run_id="r",
        generation=1,
        rank=rank,
        world_size=ws,
        local_rank=rank,
        local_world_size=ws,
        node_rank=0,
        num_nodes=1,
        ep_size=largest_power_of_two_at_most(ws),
        backend="gloo",
        master_addr="h",
        master_port=1,
    )
    base.update(over)
    return base


def test_evaluate_is_undecided_until_all_arrive_and_fails_fast_on_a_difference():
    mine = _record(0, 3)
    assert evaluate([mine], mine)["ok"] is None
    bad = evaluate([mine, _record(1, 3, ep_size=1)], mine)
    assert bad["ok"] is False and "rank1" in bad["details"] and "ep_size=1" in bad["message"]
    assert evaluate([mine, _record(1, 3), _record(2, 3)], mine)["ok"] is True
    inconsistent_nodes = evaluate([mine, _record(1, 3, node_rank=1, num_nodes=1), _record(2, 3)], mine)
    assert inconsistent_nodes["ok"] is False


# ------------------------------- real processes, real TCPStore ------------------------------

# Every process first waits at a start line on the store until all of them are there: one that
# finished importing torch seconds after the others (a loaded machine) would otherwise use up the
# agreement's timeout, or find rank 0 (the store's host) gone after its verdict.
AGREE = """
import json, sys, time
from datetime import timedelta
from elastic_emb.topology import Topology, agree
from elastic_emb.store import worker_store
t = Topology.from_env()
store = worker_store(t, timeout=30)
if store.add("test/started", 1) == {procs}:
    store.set("test/all_started", "1")
store.wait(["test/all_started"], timedelta(seconds=60))
start = time.monotonic()
try:
    agreed = agree(t, store, timeout=float(sys.argv[-1]) if len(sys.argv) > 1 else {timeout})
    out = {{"ok": True, "fingerprint": agreed.fingerprint(), "rank": agreed.rank}}
except Exception as exc:
    out = {{"ok": False, "error": type(exc).__name__, "message": str(exc),
           "missing": getattr(exc, "missing_ranks", None)}}
out["elapsed"] = time.monotonic() - start
print(json.dumps(out), flush=True)
time.sleep({linger})
"""


def _agree(envs, timeout=30.0, linger=0.0):
    results = run_ranks(AGREE.format(timeout=timeout, linger=linger, procs=len(envs)), envs, timeout=timeout + 90)
    return [r.value for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_agreement_succeeds(world_size):
    port = free_port()
    out = _agree([torchrun_env(r, world_size, port) for r in range(world_size)])
    assert all(o["ok"] for o in out), out
    assert len({o["fingerprint"] for o in out}) == 1
    assert sorted(o["rank"] for o in out) == list(range(world_size))


@pytest.mark.slow
def test_different_world_size_is_rejected_on_every_rank():
    port = free_port()
    envs = [torchrun_env(r, 3, port) for r in range(3)]
    envs[2] = torchrun_env(2, 4, port, local_world_size=3, num_nodes=1)
    out = _agree(envs)
    assert all(not o["ok"] and o["error"] == "TopologyDisagreement" for o in out), out
    assert all("world_size" in o["message"] for o in out)
    assert len({o["message"] for o in out}) == 1, "every rank must raise the same verdict"


def test_duplicated_rank_is_rejected_on_every_rank():
    port = free_port()
    envs = [torchrun_env(0, 2, port), torchrun_env(0, 2, port)]
    envs[1]["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the second 'rank 0' must not host the store again
    envs[1]["LOCAL_RANK"] = "1"
    out = _agree(envs)
    assert all(not o["ok"] and o["error"] == "TopologyDisagreement" for o in out), out
    assert all("duplicated ranks [0]" in o["message"] and "unclaimed ranks [1]" in o["message"] for o in out)


@pytest.mark.slow
def test_rank_of_another_generation_is_rejected_on_every_rank():
    port = free_port()
    envs = [torchrun_env(r, 3, port, generation=5) for r in range(3)]
    envs[1] = torchrun_env(1, 3, port, generation=4)
    # linger: rank 0 hosts the store and fails fast; agree() keeps it LATE_READER_GRACE_S for slow
    # starters, and the processes stay a little longer still so a heavily loaded machine cannot
    # turn a late start into a connection error (under torchrun the agent ends them anyway).
    out = _agree(envs, timeout=20.0, linger=3.0)
    assert all(not o["ok"] and o["error"] == "TopologyDisagreement" for o in out), out
    # refused at once (< 1 s idle), not at the 20 s timeout: half of it is the margin for load
    assert all(o["elapsed"] < 10.0 for o in out), out
    assert any("stale generation 4" in o["message"] for o in out)


@pytest.mark.slow
def test_missing_rank_times_out_naming_it_within_the_timeout():
    port = free_port()
    envs = [torchrun_env(r, 3, port) for r in (0, 1)]
    out = _agree(envs, timeout=3.0)
    for o in out:
        assert not o["ok"] and o["error"] == "AgreementTimeout", o
        assert o["missing"] == [2] and "missing ranks [2]" in o["message"]
        # Gave up at its 3 s timeout, not at the store's 30 s default: half of that is the bound,
        # the margin for a process waiting for one of 2 loaded cores after its deadline passed.
        assert o["elapsed"] < 15.0, o


def test_generations_use_disjoint_keys_on_one_store():
    """Two successive generations agree on the same long-lived store without interference."""
    port = free_port()
    code = """
import json
from elastic_emb.topology import Topology, agree
from elastic_emb.store import worker_store
t = Topology.from_env()
store = worker_store(t, timeout=30)
fps = [agree(t.with_changes(generation=g), store, timeout=10).fingerprint() for g in (7, 8, 9)]
print(json.dumps(fps), flush=True)
"""
    out = [r.value for r in run_ranks(code, [torchrun_env(r, 2, port) for r in range(2)], timeout=60)]
    assert out[0] == out[1] and len(set(out[0])) == 3


def test_agreement_errors_are_the_public_types():
    assert issubclass(TopologyDisagreement, RuntimeError)
    assert issubclass(AgreementTimeout, TimeoutError)
    assert set(SHARED_FIELDS) >= {"run_id", "generation", "world_size", "ep_size"}
    assert json.loads(Topology.from_env(BASE_ENV).to_json())["rank"] == 1


def test_stale_rank_that_raised_the_mark_first_aborts_the_newer_generation():
    """The order CI once hit: the stale rank raises the generation mark before the newer ranks do.

    Threads on one real TCPStore make the order certain: the generation-4 rank starts alone and
    decides its own (old) generation; only once it holds the mark do the generation-5 ranks start.
    Every rank must raise TopologyDisagreement naming the stale generation, none may time out.
    """
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    outcomes: dict[int, BaseException | None] = {}

    def run(rank: int, generation: int) -> None:
        topo = Topology.model_validate(_record(rank, 3, generation=generation, run_id="stale"))
        # One client per rank, as separate processes have: a client blocks while it waits.
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        try:
            agree(topo, client, timeout=20.0)
            outcomes[rank] = None
        except BaseException as exc:  # recorded and asserted below
            outcomes[rank] = exc

    stale = threading.Thread(target=run, args=(1, 4))
    stale.start()
    deadline = time.monotonic() + 20
    while not store.check(["elastic_emb/stale/generation"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get("elastic_emb/stale/generation") == b"4"
    newer = [threading.Thread(target=run, args=(r, 5)) for r in (0, 2)]
    for t in newer:
        t.start()
    for t in [stale, *newer]:
        t.join(timeout=60)
        assert not t.is_alive()
    assert sorted(outcomes) == [0, 1, 2]
    assert all(isinstance(e, TopologyDisagreement) for e in outcomes.values()), outcomes
    assert all("stale generation 4" in str(e) for e in outcomes.values()), outcomes
