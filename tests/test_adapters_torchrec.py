"""Elastic TorchRec (elastic_emb.adapters.torchrec) with real processes.

A TorchRec DistributedModelParallel with two row-wise tables and fused row-wise Adagrad
(tests/helpers/torchrec_model.py: exact dyadic gradients) goes, inside the same processes, through world
sizes 2 -> 1 -> 2 (a node lost, a node back), a same-size re-form, 2 -> 3, and a same-size re-form
that renumbers every rank. After every phase
each table's rows and Adagrad state (fbgemm's ``momentum1``) are compared bit for bit with a
single-process TorchRec run of the same global batches. The conformance suite runs on the
adapter too. Skipped only when the optional extra is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

if importlib.util.find_spec("torchrec") is None:
    pytest.skip(
        "the torchrec extra is not installed: pip install 'elastic-emb[torchrec]' (README: TorchRec)",
        allow_module_level=True,
    )

from elastic_emb.testing import conformance  # noqa: E402
from elastic_emb.testing.ports import free_port  # noqa: E402
from elastic_emb.testing.procs import SOURCE_ROOT as REPO  # noqa: E402
from elastic_emb.testing.procs import run_ranks, torchrun_env
from tests.helpers import adapters_worker as aw  # noqa: E402
from tests.helpers import torchrec_model as tm  # noqa: E402


def _env(layout: list[str], rank: int, port: int, gen: int, tmp, spec: dict | None = None, run_id="torchrec"):
    nodes = list(dict.fromkeys(layout))
    node = layout[rank]
    members = [r for r, n in enumerate(layout) if n == node]
    over = {
        "RANK": rank,
        "WORLD_SIZE": len(layout),
        "LOCAL_RANK": members.index(rank),
        "LOCAL_WORLD_SIZE": len(members),
        "GROUP_RANK": nodes.index(node),
        "GROUP_WORLD_SIZE": len(nodes),
        "ELASTIC_EMB_GENERATION": gen,
        "MASTER_PORT": port,
    }
    if spec is None:
        return over
    return torchrun_env(
        rank,
        len(layout),
        port,
        generation=gen,
        run_id=run_id,
        extra={
            **{k: str(v) for k, v in over.items()},
            "ELASTIC_EMB_NODE_ID": node,
            "ELASTIC_EMB_STATE_DIR": str(tmp / run_id / node),
            "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
            "ADW_SPEC": json.dumps(spec),
        },
    )


def _gather(out, name: str, world: int) -> dict:
    parts = [torch.load(out / f"{name}-r{r}.pt") for r in range(world)]
    full = {}
    for t in tm.TABLES:
        ps = sorted((p[t["name"]] for p in parts), key=lambda x: x[0])
        assert ps[0][0] == 0 and ps[-1][1] == t["num_rows"], f"{name}: {t['name']} covers {[p[:2] for p in ps]}"
        assert all(ps[i][1] == ps[i + 1][0] for i in range(len(ps) - 1)), (
            f"{name}: gap or overlap {[p[:2] for p in ps]}"
        )
        full[t["name"]] = (torch.cat([p[2] for p in ps]), {k: torch.cat([p[3][k] for p in ps]) for k in ps[0][3]})
    return full


def _assert_equal(got: dict, want: dict, what: str) -> None:
    for name, (w, slots) in want.items():
        gw, gslots = got[name]
        bad = (gw != w).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{what}: table {name} rows {bad[:10]} differ from the single-process run"
        assert set(gslots) == set(slots) == {"momentum1"}, (what, name, sorted(gslots))
        for k in slots:
            assert torch.equal(gslots[k], slots[k]), f"{what}: table {name} optimizer state {k} differs"


@pytest.mark.slow
def test_torchrec_2_1_2_reform_then_2_3_equals_a_single_process(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port, ref_port = free_port(), free_port()
    two, one, three = ["A", "B"], ["A"], ["A", "B", "C"]
    renumbered = ["B", "C", "A"]  # a same-size re-form that gives every process another rank
    # A durable tier too: its asynchronous DCP saves use the default group while TorchRec trains on
    # the context's own group.
    base = {
        "context": "torchrec",
        "out": str(out),
        "tables": tm.TABLES,
        "config": {"durable_dir": str(tmp_path / "durable"), "durable_every": 2},
    }
    rank0 = {
        **base,
        "phases": [
            {"until": 2, "dump": "a"},
            # The leaver is gone (as the in-process resize tells the survivors): its part of step 2's
            # asynchronous durable save never comes, and the save in flight ends instead of waiting.
            {"env": _env(one, 0, port, 1, tmp_path), "gone": [1], "until": 4, "dump": "b"},
            {"env": _env(two, 0, port, 2, tmp_path), "until": 6, "dump": "c"},
            {"env": _env(two, 0, port, 3, tmp_path), "until": 7, "dump": "d"},
            {"env": _env(three, 0, port, 4, tmp_path), "until": 9, "dump": "e"},
            {"env": _env(renumbered, 2, port, 5, tmp_path), "until": 10, "dump": "f"},
        ],
    }
    leaver = {**base, "phases": [{"until": 2, "dump": "a"}, {"depart": True}]}
    joiner1 = {
        **base,
        "wait_file": str(out / "b-r0.pt"),
        "phases": [
            {"until": 6, "dump": "c"},
            {"env": _env(two, 1, port, 3, tmp_path), "until": 7, "dump": "d"},
            {"env": _env(three, 1, port, 4, tmp_path), "until": 9, "dump": "e"},
            {"env": _env(renumbered, 0, port, 5, tmp_path), "until": 10, "dump": "f"},
        ],
    }
    joiner2 = {
        **base,
        "wait_file": str(out / "d-r0.pt"),
        "phases": [
            {"until": 9, "dump": "e"},
            {"env": _env(renumbered, 1, port, 5, tmp_path), "until": 10, "dump": "f"},
        ],
    }
    reference = {**base, "config": {}, "phases": [{"until": 10, "dump": "ref", "dump_steps": [2, 4, 6, 7, 9, 10]}]}
    envs = [
        _env(two, 0, port, 0, tmp_path, rank0),
        _env(two, 1, port, 0, tmp_path, leaver),
        _env(two, 1, port, 2, tmp_path, joiner1),
        _env(three, 2, port, 4, tmp_path, joiner2),
        _env(one, 0, ref_port, 0, tmp_path, reference, run_id="reference"),
    ]
    results = run_ranks(aw.CODE, envs, timeout=280)
    for r in results:
        (tmp_path / f"process{r.rank}.log").write_text(r.stdout + "\n" + r.stderr)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(f"process {r.rank} rc={r.returncode}\n{r.stderr[-3000:]}" for r in failed)
    first, _, second, third, _ = (r.value for r in results)

    for name, world, step in (("a", 2, 2), ("b", 1, 4), ("c", 2, 6), ("d", 2, 7), ("e", 3, 9), ("f", 3, 10)):
        _assert_equal(_gather(out, name, world), _gather(out, f"ref{step}", 1), f"after step {step} at world {world}")
    assert [e["kind"] for e in first["events"]] == ["start", "rebuild", "rebuild", "reset", "rebuild", "reset"]
    assert [e["new_world_size"] for e in first["events"]] == [2, 1, 2, 2, 3, 3]
    assert [e["rank"] for e in first["events"]][-2:] == [0, 2]  # the last re-form renumbered the ranks
    assert [e["kind"] for e in second["events"]] == ["start", "reset", "rebuild", "reset"]
    assert [e["kind"] for e in third["events"]] == ["start", "reset"] and third["events"][0]["restored_step"] == 7
    assert "replica" in first["events"][1]["source_tiers"]  # the lost node's rows: its neighbour's replica
    # The commits were incremental (the lookup hook's marks): deltas naming a parent, or bases their
    # holders folded from such deltas, on every node.
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "torchrec").rglob("step-*/rank*.json")]
    assert {m["source_node"] for m in manifests if m.get("parent") or m.get("folded_from")} == {"A", "B", "C"}, sorted(
        (m["step"], m["source_node"], m.get("parent")) for m in manifests
    )


# With a replicated layer, so the suite also checks the adapter's ``dense`` table (round trip,
# views written then mark_restored's all-gather, reset keeping the parameters).
def TORCHREC():
    return conformance.Target(
        factory=tm.factory(timeout=5.0, dense=True),
        collective=lambda ctx: ctx.barrier(),
        write=tm.write_rows,
    )


@pytest.mark.slow
def test_torchrec_context_passes_the_conformance_suite():
    report = conformance.run(f"{__name__}:TORCHREC", world_size=2, ep_size=2, timeout=280)
    assert report.passed == {c: [0, 1] for c in conformance.CHECKS}
    # The lookup hook marks exactly the rows a step wrote, and the dense table exactly its changed rows.
    assert all(report.notes["changes"][r].startswith("exact") for r in (0, 1)), report.notes["changes"]


@pytest.mark.parametrize(
    "plan, message",
    [
        ("table_wise", "table 't_users' (module 'ebc') is sharded table_wise; elastic_emb moves row-wise tables only"),
        ("dense_kernel", "table 't_users' (module 'ebc') uses the 'dense' kernel; elastic_emb needs 'fused'"),
    ],
)
def test_torchrec_context_refuses_tables_it_cannot_move_row_by_row(plan, message):
    import functools

    import torch.distributed as dist

    from elastic_emb.adapters.torchrec import TorchRecContext
    from elastic_emb.errors import UnsupportedSharding
    from elastic_emb.topology import Topology

    topo = Topology.build(
        run_id="refuse",
        generation=0,
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
    build = functools.partial(tm.build, planned={"t_users": plan})  # the user's plan, one table planned otherwise
    with pytest.raises(UnsupportedSharding, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        TorchRecContext(topo, dist.HashStore(), build=build)
    assert not dist.is_initialized()  # the failed construction released its process group


@pytest.mark.slow
def test_drill_preset_torchrec_loses_nothing(tmp_path):
    """`elastic-emb drill --scenario torchrec`: 1 -> 2 -> 1 (the second node SIGKILLed) on real
    torchrun agents; the drill compares the final tables with a one-process TorchRec replay."""
    from elastic_emb.drill import PRESETS, run_drill

    # The drill's own deadline (its error names the logs) before pytest's 300 s; the preset allows 420 s.
    scenario = PRESETS["torchrec"].model_copy(update={"timeout": 240})
    report = run_drill(scenario, tmp_path / "drill", progress="lines", summary=False)
    assert report["ok"], (report["error"], report["verification"])
    assert report["world_sizes"] == [1, 2, 1]
    v = report["verification"]
    assert v["step"] == PRESETS["torchrec"].steps - 1 and v["rows_checked"] == 1000 + 2000 + 64 + 27
    assert [r["steps_lost"] for r in report["resizes"]] == [0, 0]


class _TwoCollections(torch.nn.Module):
    """Two EmbeddingBagCollections whose tables ("a" and "b") are both fed by a feature named "f"."""

    def __init__(self, first, second) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, kjt_first, kjt_second):
        return torch.cat([self.first(kjt_first).values(), self.second(kjt_second).values()], dim=1)


def _two_collections(topology, env, device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5})
    ebcs, plans = [], {}
    for name, table, rows in (("first", "a", 40), ("second", "b", 50)):
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=table, embedding_dim=4, num_embeddings=rows, feature_names=["f"])],
            device=torch.device("meta"),
        )
        ebcs.append(ebc)
        plans[name] = construct_module_sharding_plan(
            ebc,
            {table: row_wise(compute_kernel="fused")},
            world_size=topology.world_size,
            device_type=device.type,
            sharder=sharder,
        )
    return DistributedModelParallel(
        _TwoCollections(*ebcs), env=env, device=device, plan=ShardingPlan(plans), sharders=[sharder]
    )


def test_torchrec_change_marks_follow_each_module_when_feature_names_repeat():
    """The lookup hook of each sharded module marks the rows of that module's tables: a feature
    name used by two modules ("f" feeds table "a" in one and "b" in the other) must not mark the
    other module's table."""
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    from elastic_emb.adapters.torchrec import TorchRecContext
    from elastic_emb.topology import Topology

    topo = Topology.build(
        run_id="twocoll",
        generation=0,
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
    ctx = TorchRecContext(topo, dist.HashStore(), build=_two_collections, dense_table=None)
    try:
        assert ctx.tracks_changes and set(ctx.tables) == {"a", "b"}
        ctx.take_changes()
        first = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor([3, 7, 7]), lengths=torch.tensor([2, 1])
        )
        second = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor([45, 0]), lengths=torch.tensor([1, 1])
        )
        ctx.model(first, second).sum().backward()
        got = {n: m.nonzero().flatten().tolist() for n, m in ctx.take_changes().items()}
        assert got == {"a": [3, 7], "b": [0, 45]}, got
    finally:
        ctx.close()
