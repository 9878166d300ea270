"""A full state directory pauses commits, not the job (LifecycleConfig.storage_errors).

One process on a small tmpfs the test mounts (root only; skipped elsewhere): training goes on
while every commit fails, each logged as ``lifecycle.commit_skipped``; once space returns the
next commit is a full base and holds every row, bit for bit. Then real torchrun agents whose
state directory fills mid-run: no worker restarts, no agent exits, commits resume when the test
frees the space, and a later resize restores rows equal to the step-by-step replay."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import structlog
import torch
import torch.distributed as dist

from elastic_emb import Lifecycle, LifecycleConfig, StorageError
from elastic_emb.context import EmbContext
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.state import restore
from elastic_emb.testing.ports import free_port
from elastic_emb.topology import Topology
from tests.helpers.agents import Agent, first_commit_at, kill_all, start_agent, wait_for, worker_records
from tests.helpers.tmpfs import fill, mounted_tmpfs

TABLE = TableSpec(name="t", num_rows=64, dim=4)


def _factory(topology, store):
    return EmbContext(topology, store, tables=[TABLE], optimizer=OptimizerSpec(kind="sgd", lr=1.0), seed=0)


def _topology(generation: int) -> Topology:
    return Topology.build(
        run_id="fulldisk",
        generation=generation,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=1,
    )


def _step(ctx, step: int) -> None:
    # exactly representable: each step adds 1.0 to two rows (SGD, lr 1, gradient -1)
    ctx.apply_gradients("t", torch.tensor([step % 64, 63 - step % 64]), -torch.ones(2, 4))


def _lifecycle(state_dir, store, **kw) -> Lifecycle:
    config = LifecycleConfig(state_dir=str(state_dir), node_id="n0", transfer_timeout=30.0, **kw).resolved({})
    lc = Lifecycle(_factory, config, _topology(0), store)
    lc.context = _factory(_topology(0), store)
    return lc


@pytest.mark.parametrize("async_commit", [False, True])
def test_commits_skip_while_the_disk_is_full_and_the_next_one_holds_every_row(tmp_path, async_commit):
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mnt:
        lc = _lifecycle(mnt, store, async_commit=async_commit)
        for step in range(3):
            _step(lc.context, step)
            lc.commit(step)
        assert lc.wait_commit() == 2
        filler = mnt / "filler"
        fill(filler, most=4 << 20)
        with structlog.testing.capture_logs() as logs:
            for step in range(3, 9):
                _step(lc.context, step)
                lc.commit(step)  # never raises: the job trains on
            lc.wait_commit()
        skipped = [e for e in logs if e["event"] == "lifecycle.commit_skipped"]
        assert skipped and all(e["reason"] == "no_space" and e["committed_step"] == 2 for e in skipped), skipped
        assert lc.committed_step == 2
        filler.unlink()  # space returns: the next commit is complete, and holds the skipped steps' rows
        _step(lc.context, 9)
        lc.commit(9)
        assert lc.wait_commit() == 9 and lc.committed_step == 9
        want = lc.context.export_shard()["t"].weight.clone()
        lc.close()
        ctx = _factory(_topology(1), store)
        lc2 = _lifecycle(mnt, store)
        report = restore(ctx, lc2._committer.comm_for(ctx), snapshot=lc2.snapshot, durable=None)
        got = ctx.export_shard()["t"].weight
        assert report.step == 9 and torch.equal(got, want)
        # the replay, step by step: row r gained 1.0 for each step s <= 9 with s % 64 == r or 63 - s % 64 == r
        init = _factory(_topology(2), store).export_shard()["t"].weight
        for s in range(10):
            init[[s % 64, 63 - s % 64]] += 1.0
        assert torch.equal(got, init)
        lc2.close()


def test_storage_errors_raise_when_asked(tmp_path):
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mnt:
        lc = _lifecycle(mnt, store, async_commit=False, storage_errors="raise")
        _step(lc.context, 0)
        lc.commit(0)
        fill(mnt / "filler", most=4 << 20)
        _step(lc.context, 1)
        with pytest.raises(StorageError, match="No space left on device"):
            lc.commit(1)
        assert lc.committed_step == 0
        lc.close()


@pytest.fixture
def cluster(tmp_path):
    agents: list[Agent] = []
    with mounted_tmpfs(tmp_path / "state", "8m") as state:
        try:
            yield str(tmp_path), state, agents
        finally:
            kill_all(agents, str(tmp_path))


def _lagging(tmp: str, after: float, by: int) -> set[int]:
    """Ranks that logged, after ``after``, a step at least ``by`` past their newest complete commit."""
    return {
        r["rank"]
        for r in worker_records(tmp)
        if r["ev"] == "commit" and r["t"] > after and r["step"] - r["committed"] >= by
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_full_state_directory_pauses_commits_not_the_job(cluster):
    tmp, state, agents = cluster
    port = free_port()
    kw = dict(worker="lifecycle", nnodes="1:3", extra_env={"ELASTIC_EMB_STATE_DIR": str(state)})
    agents.append(start_agent("a", tmp, port, **kw))
    agents.append(start_agent("b", tmp, port, **kw))
    wait_for(
        lambda: (
            {r["rank"] for r in worker_records(tmp) if r["ev"] == "commit" and r["ws"] == 2 and r["committed"] >= 1}
            == {0, 1}
        ),
        120.0,
        "a complete commit at world size 2",
        agents,
    )
    t_full = worker_records(tmp)[-1]["t"]
    fill(state / "filler", most=64 << 20)
    # training goes on, ten steps and more past the newest complete commit, on both ranks
    wait_for(lambda: _lagging(tmp, t_full, 10) == {0, 1}, 120.0, "ten steps past the last commit", agents)
    assert all("lifecycle.commit_skipped" in a.output() for a in agents)
    # a node joins while the disk is full: the drain's commit fails too, so the new world
    # restores the newest complete commit and replays from there (rows checked at every start)
    t_join = worker_records(tmp)[-1]["t"]
    agents.append(start_agent("c", tmp, port, **kw))
    wait_for(lambda: first_commit_at(tmp, world_size=3, after=t_join), 180.0, "world size 3", agents)
    wait_for(lambda: _lagging(tmp, t_join, 5) == {0, 1, 2}, 120.0, "world size 3 training, disk still full", agents)
    # space returns: commits complete again, with no worker restart, on every rank
    t_free = worker_records(tmp)[-1]["t"]
    (state / "filler").unlink()
    wait_for(
        lambda: (
            {
                r["rank"]
                for r in worker_records(tmp)
                if r["ev"] == "commit" and r["t"] > t_free and r["ws"] == 3 and r["committed"] >= r["step"] - 3
            }
            == {0, 1, 2}
        ),
        120.0,
        "commits complete again",
        agents,
    )
    ready = [r for r in worker_records(tmp) if r["ev"] in ("ready", "reformed")]
    assert all(r["rows_ok"] for r in ready), ready
    # workers started only for the join (restart mode: every worker once), never for a failed commit
    assert {r["ws"] for r in ready if r["t"] > t_full} == {3}, ready
    assert all(a.proc.poll() is None for a in agents), [a.proc.poll() for a in agents]
    for a in agents:
        a.proc.send_signal(signal.SIGTERM)
