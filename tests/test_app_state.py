"""The training state beside the tables (``Lifecycle.start(app_state=...)``): a dense module, Adam,
a learning-rate schedule and an ElasticSampler are committed with every step and restored with the
tables, bit for bit; bad objects and states that do not load are one-line errors naming them.

One rank of a real gloo world per lifecycle (a TCPStore on loopback); the multi-node paths (a node
with an empty directory receiving the state from a peer, a SIGKILLed node) run under real torchrun
agents in tests/test_app_state_agents.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic_emb import ConfigError, Lifecycle, LifecycleConfig, RestoreError
from elastic_emb.context import EmbContext
from elastic_emb.data import ElasticSampler
from elastic_emb.protocol import OptimizerSpec, TableSpec
from elastic_emb.state import app
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import torchrun_env

TABLE = TableSpec(name="t", num_rows=32, dim=4)


def _factory(topology, store):
    return EmbContext(topology, store, tables=[TABLE], optimizer=OptimizerSpec(kind="sgd", lr=1.0), seed=0)


class Dense:
    """A dense part, its Adam, a schedule and a sampler, built the same way every time."""

    def __init__(self, width: int = 6) -> None:
        torch.manual_seed(7)
        self.model = torch.nn.Linear(width, 3)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.01, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=3, gamma=0.5)
        self.sampler = ElasticSampler(50, 2, seed=3)

    def objects(self) -> dict:
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "sampler": self.sampler}

    def step(self, step: int, world_size: int = 1) -> None:
        ids = self.sampler.indices(0, world_size)
        x = (ids.to(torch.float32)[:, None] + torch.arange(self.model.in_features)) / 64
        loss = self.model(x).square().sum() + step
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.sched.step()
        self.sampler.advance(world_size)


def _state(dense: Dense) -> dict:
    return app.capture(dense.objects())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def world(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30), use_libuv=True)
    gen = [0]

    def start(objects, rank_state=None, **config) -> Lifecycle:
        env = torchrun_env(
            0,
            1,
            port,
            run_id="appstate",
            generation=gen[0],
            extra={"ELASTIC_EMB_STATE_DIR": str(tmp_path / "state"), "ELASTIC_EMB_NODE_ID": "n0"},
        )
        gen[0] += 1
        cfg = LifecycleConfig(transfer_timeout=30.0, agree_timeout=30.0, **config)
        return Lifecycle.start(_factory, cfg, env=env, store=store, app_state=objects, rank_state=rank_state)

    yield start, tmp_path / "state"


@pytest.mark.parametrize("async_commit", [False, True])
def test_app_state_is_committed_with_each_step_and_restored_bit_for_bit(world, async_commit):
    start, _ = world
    dense = Dense()
    lc = start(dense.objects(), async_commit=async_commit)
    assert lc.step == -1
    states = {}
    for step in range(7):
        dense.step(step)
        states[step] = _state(dense)
        lc.context.apply_gradients("t", torch.tensor([step]), -torch.ones(1, 4))
        lc.commit(step)
    assert lc.wait_commit() == 6
    lc.close()
    fresh = Dense()  # built as the job builds it: its initial values, not step 6's
    assert not _equal(_state(fresh), states[6])
    lc2 = start(fresh.objects(), async_commit=async_commit)
    assert lc2.step == 6
    assert _equal(_state(fresh), states[6])
    assert fresh.sampler.cursor == 7 * 2
    # training goes on from there exactly as it would have
    dense.step(7)
    fresh.step(7)
    assert _equal(_state(fresh), _state(dense))
    lc2.close()


def test_objects_without_state_dict_are_refused_at_start_naming_them(world):
    start, _ = world
    with pytest.raises(ConfigError, match=r"app_state\['loader'\] \(list\) has no state_dict\(\)"):
        start({"model": torch.nn.Linear(2, 2), "loader": [1, 2, 3]})
    with pytest.raises(ConfigError, match=r"app_state name '../x'"):
        start({"../x": torch.nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match=r"app_state=list: pass a dict"):
        start([torch.nn.Linear(2, 2)])


def test_a_state_its_object_refuses_is_an_error_naming_object_and_step(world):
    start, _ = world
    dense = Dense(width=6)
    lc = start(dense.objects())
    dense.step(0)
    lc.commit(0)
    lc.close()
    other = Dense(width=5)  # a model built differently: its weights do not fit
    with pytest.raises(
        RestoreError, match=r"app_state\['model'\] \(Linear\) refused the state of step 0: RuntimeError"
    ):
        start(other.objects())


def test_other_names_than_the_committed_ones_are_an_error_naming_both(world):
    start, _ = world
    dense = Dense()
    lc = start(dense.objects())
    dense.step(0)
    lc.commit(0)
    lc.close()
    with pytest.raises(RestoreError, match=r"holds \['model', 'optim', 'sched', 'sampler'\]|holds \['model'"):
        start({"model": Dense().model})


def test_a_corrupt_app_file_is_never_loaded(world):
    start, state_dir = world
    dense = Dense()
    lc = start(dense.objects(), async_commit=False)
    dense.step(0)
    lc.commit(0)
    lc.close()
    (path,) = state_dir.rglob(app.APP_FILE)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(RestoreError, match=r"no rank holds the app state .* of the restored step 0"):
        start(Dense().objects())


def test_the_first_start_keeps_the_objects_as_built(world):
    start, _ = world
    dense, built = Dense(), _state(Dense())
    lc = start(dense.objects())
    assert lc.step == -1 and _equal(_state(dense), built)
    lc.close()


def test_the_disk_holds_the_app_state_of_the_newest_commits_only(world):
    # a chain keeps its base and deltas for their rows; their app state is never restored
    from elastic_emb.lifecycle.committer import COMMIT_DEPTH
    from elastic_emb.state.snapshot import APP_SLACK

    assert APP_SLACK >= COMMIT_DEPTH  # the commits in flight after the newest complete one keep theirs

    start, state_dir = world
    dense = Dense()
    lc = start(dense.objects(), async_commit=False, keep=2, max_chain=8)
    for step in range(20):
        dense.step(step)
        lc.context.apply_gradients("t", torch.tensor([step]), -torch.ones(1, 4))
        lc.commit(step)
    steps = sorted(int(p.parent.name.split("-")[1]) for p in state_dir.rglob(app.APP_FILE))
    # the newest (a restore's choice is among them), at most keep + APP_SLACK of them
    assert steps == list(range(20 - len(steps), 20)) and 2 <= len(steps) <= 2 + APP_SLACK, steps
    assert len(list(state_dir.rglob("step-*"))) > len(steps)  # the chains' older commits stay, without it
    lc.close()
    fresh = Dense()
    start(fresh.objects()).close()
    assert fresh.sampler.cursor == 20 * 2


def test_with_the_node_directory_lost_the_durable_tier_restores_the_app_state(world, tmp_path):
    import shutil

    start, state_dir = world
    dense = Dense()
    durable = dict(durable_dir=str(tmp_path / "durable"), durable_every=2, durable_async=False)
    lc = start(dense.objects(), **durable)
    states = {}
    for step in range(4):
        dense.step(step)
        states[step] = _state(dense)
        lc.context.apply_gradients("t", torch.tensor([step]), -torch.ones(1, 4))
        lc.commit(step)
    lc.close()
    shutil.rmtree(state_dir)  # the node's snapshots are gone: the newest durable checkpoint is step 2
    fresh = Dense()
    lc2 = start(fresh.objects(), **durable)
    assert lc2.step == 2 and _equal(_state(fresh), states[2])
    lc2.close()


class RankRng:
    """A per-rank RNG stream, as a job keeps one for dropout or negative sampling."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng"])


def test_rank_state_is_restored_to_its_rank_at_its_world_size(world):
    start, state_dir = world
    dense, rng = Dense(), RankRng(5)
    with pytest.raises(ConfigError, match=r"names \['model'\] are in both app_state and rank_state"):
        start(dense.objects(), rank_state={"model": rng})
    lc = start(dense.objects(), rank_state={"rng": rng})
    for step in range(3):
        dense.step(step)
        torch.rand(4, generator=rng.gen)  # the step draws from the rank's stream
        lc.commit(step)
    lc.wait_commit()
    lc.close()
    want = torch.rand(4, generator=RankRng(5).gen.set_state(rng.gen.get_state()))  # the draw after step 2
    assert list(state_dir.rglob("rank0.state.pt"))
    again = RankRng(99)
    start(Dense().objects(), rank_state={"rng": again}).close()
    assert torch.equal(torch.rand(4, generator=again.gen), want)


def test_rank_state_of_another_world_size_is_kept_as_built_and_said(world):
    import json

    start, state_dir = world
    lc = start(None, rank_state={"rng": RankRng(5)})
    lc.commit(0)
    lc.wait_commit()
    lc.close()
    for path in state_dir.rglob("rank0.json"):  # as if the commit had been taken by a world of two
        m = json.loads(path.read_text())
        m["world_size"] = 2
        path.write_text(json.dumps(m))
    built = RankRng(99)
    with structlog_logs() as logs:
        start(None, rank_state={"rng": built}).close()
    assert torch.equal(built.gen.get_state(), RankRng(99).gen.get_state())
    (event,) = [e for e in logs if e["event"] == "rank_state_not_restored"]
    assert event["world_size"] == 1 and "world size 1" in event["reason"], event


def structlog_logs():
    import structlog

    return structlog.testing.capture_logs()
