"""The seed's kind of context, native C++ (examples/native_context), driven by the lifecycle.

The extension is compiled once per machine (torch.utils.cpp_extension into a cache directory) and
loaded by every rank. Real processes on a real TCPStore and gloo: a world of 2 loses a node (1),
gains one back (2), then re-forms at the same size. The native object's own counters prove the
rule: constructed anew at each size change, ``reset`` only for the same-size re-form. Rows and
accumulators are compared bit for bit with the closed form of the native training step.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from elastic_emb.testing import conformance
from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT as REPO
from elastic_emb.testing.procs import run_ranks, torchrun_env
from tests.helpers import adapters_worker as aw

sys.path.insert(0, os.path.join(REPO, "examples", "native_context"))
import native_context as nc  # noqa: E402

TABLES = [{"name": "items", "num_rows": 203, "dim": 4}, {"name": "users", "num_rows": 61, "dim": 3}]


def _native_target() -> conformance.Target:
    import functools

    from elastic_emb.protocol import TableSpec

    factory = functools.partial(nc.NativeContext, tables=[TableSpec(**t) for t in TABLES], timeout=5.0)
    return conformance.Target(factory=factory, collective=lambda ctx: ctx.barrier())


NATIVE = _native_target


@pytest.fixture(scope="module")
def native():
    return nc.build()  # compiles on the first run on this machine, loads from the cache after


def _store(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)


def _topology(world_size: int, rank: int = 0, generation: int = 0, port: int = 0):
    from elastic_emb.topology import Topology

    return Topology.build(
        run_id="native",
        generation=generation,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
        num_nodes=1,
        ep_size=1,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )


def test_reset_across_sizes_raises_world_size_changed_with_the_seed_message(native):
    from elastic_emb.errors import WorldSizeChanged
    from elastic_emb.protocol import TableSpec

    port = free_port()
    store = _store(port)
    ctx = nc.NativeContext(_topology(1, port=port), store, tables=[TableSpec(**t) for t in TABLES])
    before = ctx.native_counters()
    with pytest.raises(WorldSizeChanged) as info:
        ctx.reset(0, 2, topology=_topology(2, generation=1, port=port), store=store)
    assert str(info.value).startswith("async_emb world size changed from 1 to 2")
    assert (info.value.old, info.value.new) == (1, 2)
    assert ctx.native_counters()["resets"] == before["resets"]  # refused: not counted
    ctx.reset(0, 1, topology=_topology(1, generation=1, port=port), store=store)
    assert ctx.native_counters()["resets"] == before["resets"] + 1
    ctx.close()
    ctx.close()  # idempotent
    assert ctx.native_counters()["releases"] == before["releases"] + 1


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 2, 2), "async_emb rank 2 is outside world size 2"),
        ((-1, 2, 2), "async_emb rank -1 is outside world size 2"),
        ((0, 0, 1), "async_emb world size 0 must be >= 1"),
        ((0, 3, 3), "async_emb ep size 3 must be a power of two <= world size 3"),
        ((0, 2, 4), "async_emb ep size 4 must be a power of two <= world size 2"),
    ],
)
def test_native_constructor_rejects_invalid_topologies(native, args, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        native.AsyncEmbContext(*args, [("items", 10, 2)], "cpu")


def test_native_reset_rejects_an_invalid_rank(native):
    c = native.AsyncEmbContext(0, 2, 2, [("items", 10, 2)], "cpu")
    with pytest.raises(ValueError, match="^async_emb rank 5 is outside world size 2$"):
        c.reset(5, 2)
    assert c.resets == 0


def _env(layout: list[str], rank: int, port: int, gen: int, tmp, spec: dict | None = None) -> dict:
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
        run_id="native",
        extra={
            **{k: str(v) for k, v in over.items()},
            "ELASTIC_EMB_NODE_ID": node,
            "ELASTIC_EMB_STATE_DIR": str(tmp / "nodes" / node),
            "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
            "ADW_SPEC": json.dumps(spec),
        },
    )


def _gather(out, name: str, world: int) -> dict:
    parts = [torch.load(out / f"{name}-r{r}.pt") for r in range(world)]
    full = {}
    for t in TABLES:
        ps = sorted((p[t["name"]] for p in parts), key=lambda x: x[0])
        assert [(a, b) for a, b, *_ in ps] == [(0, ps[0][1])] + [(ps[i][0], ps[i][1]) for i in range(1, len(ps))]
        assert ps[-1][1] == t["num_rows"] and all(ps[i][1] == ps[i + 1][0] for i in range(len(ps) - 1)), ps
        full[t["name"]] = (torch.cat([p[2] for p in ps]), torch.cat([p[3]["accumulator"] for p in ps]))
    return full


def _expected(last_step: int) -> dict:
    """Closed form of NativeContext.train_step after steps 0..last_step from the integer start."""
    want = {}
    for t in TABLES:
        n, dim = t["num_rows"], t["dim"]
        rows = torch.arange(n)
        w = aw.int_rows(0, n, dim)
        for s in range(last_step + 1):
            w = w + ((rows + s) % 5 - 2).to(torch.float32)[:, None]
        want[t["name"]] = (w, aw.int_slot(0, n) + (last_step + 1))
    return want


@pytest.mark.slow
def test_lifecycle_drives_the_native_context_2_1_2(native, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    two, one = ["A", "B"], ["A"]
    base = {"context": "native", "out": str(out), "tables": TABLES}
    rank0 = {
        **base,
        "phases": [
            {"until": 2, "dump": "w2"},
            {"env": _env(one, 0, port, 1, tmp_path), "until": 4, "dump": "w1"},
            {"env": _env(two, 0, port, 2, tmp_path), "until": 6, "dump": "w2again"},
            {"env": _env(two, 0, port, 3, tmp_path), "until": 7, "dump": "final"},
        ],
    }
    leaver = {**base, "phases": [{"until": 2, "dump": "w2"}, {"depart": True}]}
    joiner = {
        **base,
        "wait_file": str(out / "w1-r0.pt"),
        "phases": [
            {"until": 6, "dump": "w2again"},
            {"env": _env(two, 1, port, 3, tmp_path), "until": 7, "dump": "final"},
        ],
    }
    envs = [
        _env(two, 0, port, 0, tmp_path, rank0),
        _env(two, 1, port, 0, tmp_path, leaver),
        _env(two, 1, port, 2, tmp_path, joiner),
    ]
    results = run_ranks(aw.CODE, envs, timeout=240)
    for r in results:
        assert r.returncode == 0, f"process {r.rank} rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    first, _, second = (r.value for r in results)

    for name, world, last in (("w2", 2, 2), ("w1", 1, 4), ("w2again", 2, 6), ("final", 2, 7)):
        got, want = _gather(out, name, world), _expected(last)
        for t in want:
            assert torch.equal(got[t][0], want[t][0]), f"{name}: table {t} rows differ from the closed form"
            assert torch.equal(got[t][1], want[t][1]), f"{name}: table {t} accumulators differ"

    # Rank 0 lived through every phase in one process: constructed anew at each size change
    # (2 -> 1, 1 -> 2), reset once, for the same-size re-form only.
    assert [e["kind"] for e in first["events"]] == ["start", "rebuild", "rebuild", "reset"]
    assert [(c["constructions"], c["resets"], c["releases"]) for c in first["counters"]] == [
        (1, 0, 0),
        (2, 0, 1),
        (3, 0, 2),
        (3, 1, 2),
    ]
    assert [e["new_world_size"] for e in first["events"]] == [2, 1, 2, 2]
    assert [e["kind"] for e in second["events"]] == ["start", "reset"]
    assert [(c["constructions"], c["resets"]) for c in second["counters"]] == [(1, 0), (1, 1)]
    # the lost node's rows came back from the replica its neighbour kept
    assert "replica" in first["events"][1]["source_tiers"]


def test_native_context_passes_the_conformance_suite(native):
    report = conformance.run(f"{__name__}:NATIVE", world_size=2, ep_size=2, timeout=240)
    assert report.passed == {c: [0, 1] for c in conformance.CHECKS}
