"""EmbContext with real gloo process groups: 4 ranks, 3 ranks with ep_size 2, 2 ranks.

Each configuration runs tests/helpers/context_worker.py once per rank (real processes, real TCPStore and
gloo on loopback); the worker checks lookups and gradients against a single-process
torch.nn.Embedding + optimizer exactly (integer data), invalid ids, every reset rule, close, a
re-construction at another world size with the rows imported, and DCP checkpoints saved at one
world size and loaded at another. The three runs are chained: the 3-rank run loads the 4-rank
run's checkpoint, the 2-rank run loads the 3-rank run's (saved with a rank that owns no rows).
"""

from __future__ import annotations

import json
import os

import pytest

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT as REPO
from elastic_emb.testing.procs import run_ranks, torchrun_env

WORKER = os.path.join(REPO, "tests", "helpers", "context_worker.py")

# (tag, world size, ep size, load the checkpoint of, re-construct at world size)
RUNS = [
    ("w4", 4, 4, None, 2),
    ("w3", 3, 2, "w4", 1),
    ("w2", 2, 2, "w3", None),
]
COMMON = [
    "sgd_matches_reference",
    "large_batches",
    "staging_grown",
    "adagrad_matches_reference",
    "invalid_ids",
    "mismatched_calls",
    "reset_rules",
    "reset_same_world",
    "reset_new_rank_mapping",
    "close_and_use_after_close",
    "init_rows_independent_of_world",
    "dcp",
    "nonfinite_and_changes",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the three worlds in order (each loads its predecessor's checkpoint); cache results."""
    shared = tmp_path_factory.mktemp("ctx")
    cache: dict[str, list] = {}

    def get(tag: str):
        for t, world, ep, load_from, shrink in RUNS:
            if t in cache:
                continue
            cfg = {"dir": str(shared), "tag": t, "load_from": load_from, "shrink_to": shrink}
            port = free_port()
            envs = [
                torchrun_env(
                    r,
                    world,
                    port,
                    run_id=f"ctx-{t}",
                    extra={"ELASTIC_EMB_EP_SIZE": str(ep), "CTX_TEST_CFG": json.dumps(cfg)},
                )
                for r in range(world)
            ]
            code = f"import runpy, sys; sys.argv = [{WORKER!r}]; runpy.run_path({WORKER!r}, run_name='__main__')"
            cache[t] = run_ranks(code, envs, timeout=120)
            if t == tag:
                break
        return cache[tag]

    return get


def _checks(results, tag):
    out = []
    for r in results:
        assert r.returncode == 0, f"{tag} rank {r.rank} exited {r.returncode}:\n{r.stderr[-4000:]}"
        out.append(r.value)
    return out


CASES = [(tag, name) for tag, world, ep, load_from, shrink in RUNS for name in COMMON]
CASES += [
    ("w3", "non_power_of_two_ep_when_allowed"),
    ("w4", "reconstruct_at_other_world_size"),
    ("w3", "reconstruct_at_other_world_size"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tag,check", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_context_gloo(runs, tag, check):
    per_rank = _checks(runs(tag), tag)
    for rank, res in enumerate(per_rank):
        assert check in res, f"{tag} rank {rank} did not run check {check}; ran {sorted(res)}"
        got = res[check]
        assert got["ok"], f"{tag} rank {rank} check {check} failed: {got.get('error')}\n{got.get('tb', '')}"
    if check == "invalid_ids":
        world = len(per_rank)
        kinds = [[k for k, _ in res[check]["seen"]] for res in per_rank]
        # round 1: the last rank passed a bad id; rounds 2 and 3: rank 0 did
        assert kinds[world - 1][0] == "invalid" and all(k[0] == "peer" for k in kinds[:-1])
        assert kinds[0][1:] == ["invalid", "invalid"] and all(k[1:] == ["peer", "peer"] for k in kinds[1:])
    if check == "dcp":
        load_from = {t: lf for t, _, _, lf, _ in RUNS}[tag]
        if load_from:
            assert all(res[check].get("loaded_from") == load_from for res in per_rank)
            assert per_rank[0][check].get("plain_load") is True
    if check == "close_and_use_after_close":
        assert all(len(res[check]["refused"]) == 7 for res in per_rank)


def test_arena_sized_from_world(runs):
    """Arena reports resident bytes for the owned rows and staging sized from the world size."""
    sizes = {}
    for tag, world, ep, _, _ in RUNS:
        per_rank = _checks(runs(tag), tag)
        for rank, res in enumerate(per_rank):
            arena = res["arena"]
            rows = arena["tables"]["big"]["rows"]
            assert arena["tables"]["big"]["local_rows"] == rows[1] - rows[0]
            if rank >= ep:
                assert rows[0] == rows[1], f"rank {rank} >= ep_size {ep} owns rows {rows}"
            assert arena["total_bytes"] == arena["resident_bytes"] + arena["staging_bytes"]
        # staging: 2 rows per peer (the worker's setting) x world, row of 'big' (16 B) + id (8 B),
        # 256-byte aligned, one buffer per direction
        assert per_rank[0]["arena"]["staging_bytes"] == 2 * (-(-2 * world * 24 // 256) * 256), (
            world,
            per_rank[0]["arena"],
        )
        sizes[world] = per_rank[0]["arena"]["staging_bytes"]
    assert sizes[4] >= sizes[3] >= sizes[2], sizes


PEER_DIES = r"""
import json, os, signal, time, torch
from elastic_emb.context import EmbContext, CommunicationError
from elastic_emb.protocol import TableSpec
from elastic_emb.store import worker_store
from elastic_emb.topology import Topology
t = Topology.from_env()
store = worker_store(t, timeout=30)
ctx = EmbContext(t, store, tables=[TableSpec(name="a", num_rows=100, dim=8)], timeout=20.0)
ctx.lookup("a", torch.arange(10)).wait()
ctx.barrier()
if t.rank == 1:
    store.set("dying", "1")
    os.kill(os.getpid(), signal.SIGKILL)
store.wait(["dying"])
time.sleep(0.3)
t0 = time.monotonic()
try:
    ctx.lookup("a", torch.arange(10)).wait()
    err = None
except CommunicationError as exc:
    err = str(exc)
failed_after = time.monotonic() - t0
healthy = ctx.healthy
t1 = time.monotonic()
ctx.close()
ctx.close()
print(json.dumps({"err": err, "failed_after": failed_after, "healthy_after_error": healthy,
                  "close_s": time.monotonic() - t1, "closed": ctx.closed}), flush=True)
"""


def test_peer_killed_fails_fast_and_close_aborts():
    """SIGKILL of a peer: the next lookup raises CommunicationError well before the 20 s timeout,
    the context reports unhealthy, and close() (abort) returns at once and is idempotent."""
    port = free_port()
    res = run_ranks(PEER_DIES, [torchrun_env(r, 2, port, run_id="ctx-kill") for r in range(2)], timeout=60)
    assert res[1].returncode == -9, f"rank 1 should have died by SIGKILL: {res[1].returncode}\n{res[1].stderr[-2000:]}"
    assert res[0].returncode == 0, res[0].stderr[-3000:]
    v = res[0].value
    assert v["err"] and "rank 0" in v["err"], v
    # bounds: half the context's 20 s timeout (what a hang would take), the margin for a loaded machine
    assert v["failed_after"] < 10, v
    assert v["healthy_after_error"] is False and v["closed"] is True, v
    assert v["close_s"] < 10, v


PEER_ABSENT = r"""
import json, time, torch
from elastic_emb.context import EmbContext, CommunicationError
from elastic_emb.protocol import TableSpec
from elastic_emb.store import worker_store
from elastic_emb.topology import Topology
t = Topology.from_env()
store = worker_store(t, timeout=30)
if t.rank == 1:
    store.wait(["done"])  # alive, but never constructs its context
    raise SystemExit(0)
t0 = time.monotonic()
try:
    EmbContext(t, store, tables=[TableSpec(name="a", num_rows=10, dim=2)], timeout=2.0)
    err = None
except CommunicationError as exc:
    err = str(exc)
print(json.dumps({"err": err, "seconds": time.monotonic() - t0}), flush=True)
store.set("done", "1")
time.sleep(0.5)
"""


@pytest.mark.slow
def test_construction_is_bounded_by_its_timeout():
    """A peer that never constructs: construction raises CommunicationError after about the
    context's timeout (2 s here), naming the rank, instead of waiting for ever."""
    port = free_port()
    res = run_ranks(PEER_ABSENT, [torchrun_env(r, 2, port, run_id="ctx-absent") for r in range(2)], timeout=60)
    assert res[0].returncode == 0, res[0].stderr[-3000:]
    v = res[0].value
    assert v["err"] and "rank 0/2" in v["err"] and "within 2.0s" in v["err"], v
    assert 1.5 <= v["seconds"] < 15, v


# -- in-process checks (a world of one rank: no subprocesses needed) ----------------------------

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from elastic_emb.context import EmbContext, InvalidIds, init_rows  # noqa: E402
from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec  # noqa: E402
from elastic_emb.sharding import RowRange  # noqa: E402
from elastic_emb.topology import Topology  # noqa: E402


def _solo(generation: int, port: int) -> Topology:
    return Topology.build(
        run_id="solo",
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
        master_port=port,
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9000),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**40),
    cuts=st.lists(st.integers(0, 9000), max_size=5),
)
def test_init_rows_do_not_depend_on_how_rows_are_split(n, dim, seed, cuts):
    spec = TableSpec(name="t", num_rows=n, dim=dim)
    bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
    pieces = [init_rows(spec, seed, RowRange(a, b)) for a, b in zip(bounds, bounds[1:])]
    whole = init_rows(spec, seed, RowRange(0, n))
    assert torch.equal(torch.cat(pieces), whole)
    assert whole.abs().max() <= 1 / dim**0.5
    assert not torch.equal(whole, init_rows(spec, seed + 1, RowRange(0, n))) or n * dim < 2


def test_two_contexts_live_in_one_process_without_a_default_group():
    """The old and the new context of a live reshard coexist; neither needs or touches the
    default process group. Also: every table dtype, idempotent wait."""
    assert not dist.is_initialized()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    tables = [
        TableSpec(name=f"t_{d}", num_rows=50, dim=3, dtype=d) for d in ("float32", "float16", "bfloat16", "float64")
    ]
    old = EmbContext(_solo(0, port), store, tables=tables, optimizer=OptimizerSpec(kind="sgd", lr=1.0))
    new = EmbContext(_solo(1, port), store, tables=tables, seed=None)
    assert not dist.is_initialized()
    try:
        full = {t.name: torch.randint(-9, 10, (50, 3)).to(t.torch_dtype) for t in tables}
        old.import_shard({n: ShardData(n, RowRange(0, 50), w) for n, w in full.items()})
        ids = torch.tensor([3, 3, 49, 0, 7] * 20)
        grads = torch.ones(len(ids), 3)
        for t in tables:
            h = old.lookup(t.name, ids)
            got = h.wait()
            assert got.dtype == t.torch_dtype and torch.equal(got, full[t.name][ids]), t.dtype
            assert h.wait() is got
            old.apply_gradients(t.name, ids, grads)
            expect = full[t.name].clone()
            expect.index_add_(0, ids, -grads.to(t.torch_dtype))
            assert torch.equal(old.lookup(t.name, torch.arange(50)).wait(), expect), t.dtype
            full[t.name] = expect
        # shard_views are the arena itself: writes through them are what lookups return
        views = old.shard_views()
        views[tables[0].name].weight[7] = 1000
        assert old.lookup(tables[0].name, torch.tensor([7])).wait()[0].tolist() == [1000.0] * 3
        views[tables[0].name].weight[7] = full[tables[0].name][7]
        # the live transfer: export from the old context, import into the new one, both open
        new.import_shard(old.export_shard())
        for t in tables:
            assert torch.equal(new.lookup(t.name, torch.arange(50)).wait(), full[t.name])
        with pytest.raises(InvalidIds, match="id 50 is out of range"):
            new.lookup(tables[0].name, torch.tensor([50]))
    finally:
        old.close()
        new.close()
        store = None
    assert not dist.is_initialized()


def test_rows_are_initialised_lazily_and_never_when_overwritten(monkeypatch):
    """A context built for a resize has its rows overwritten by the restore at once; seeding them
    first (seconds for large tables) would be wasted. Rows are seeded at the first read, and not
    at all after import_shard or a restore in place that calls mark_restored()."""
    import elastic_emb.context.arena as context_mod

    calls = []
    real = context_mod.init_rows
    monkeypatch.setattr(context_mod, "init_rows", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    spec = TableSpec(name="t", num_rows=40, dim=2)
    ctx = EmbContext(_solo(0, port), store, tables=[spec], seed=5)
    try:
        assert calls == [], "construction must not seed the rows"
        got = ctx.lookup("t", torch.arange(40)).wait()
        assert calls == [RowRange(0, 40)] and torch.equal(got, real(spec, 5, RowRange(0, 40)))
    finally:
        ctx.close()
    calls.clear()
    imported = EmbContext(_solo(1, port), store, tables=[spec], seed=5)
    restored = EmbContext(_solo(2, port), store, tables=[spec], seed=5)
    try:
        rows = torch.arange(80, dtype=torch.float32).reshape(40, 2)
        imported.import_shard({"t": ShardData("t", RowRange(0, 40), rows)})
        restored.shard_views()["t"].weight.copy_(rows)
        restored.mark_restored()
        for ctx in (imported, restored):
            assert torch.equal(ctx.lookup("t", torch.arange(40)).wait(), rows)
            assert torch.equal(ctx.export_shard()["t"].weight, rows)
        assert calls == [], "rows overwritten before their first read must never be seeded"
    finally:
        imported.close()
        restored.close()


def test_one_rank_handle_after_close_behaves_like_any_other():
    """A one-rank world gathers rows at lookup time; a handle not waited on before close() must
    still raise ContextClosed (as in larger worlds), and one already waited returns its rows."""
    from elastic_emb.errors import ContextClosed

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    ctx = EmbContext(_solo(0, port), store, tables=[TableSpec(name="t", num_rows=8, dim=2)])
    waited = ctx.lookup("t", torch.tensor([1, 2]))
    rows = waited.wait()
    pending = ctx.lookup("t", torch.tensor([3]))
    ctx.close()
    assert waited.wait() is rows
    with pytest.raises(ContextClosed, match="was closed"):
        pending.wait()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="no CUDA device: the Triton kernel runs on the GPU machine"
                ),
            ],
        ),
    ],
)
def test_gather_rows_reads_each_row_from_its_source(device):
    # The last step of a lookup: rows received from peers (pos >= 0) and the rank's own rows
    # (pos < 0, from the end of its shard), in one pass on CUDA, torch ops elsewhere.
    from elastic_emb.context.gather import gather_rows, kernel_status

    g = torch.Generator().manual_seed(3)
    table = torch.randn(1000, 37, generator=g).to(device)
    received = torch.randn(300, 37, generator=g).to(device)
    pos = torch.cat([torch.randint(0, 300, (5000,), generator=g), torch.randint(-1000, 0, (5000,), generator=g)])
    pos = pos[torch.randperm(pos.numel(), generator=g)].to(device)
    out = torch.full((pos.numel(), 37), float("nan"), device=device)
    gather_rows(out, table, received, pos)
    expect = torch.where((pos >= 0)[:, None], received[pos.clamp(min=0)], table[(pos + 1000).clamp(max=999)])
    assert torch.equal(out, expect)
    only_table = torch.full((7, 37), float("nan"), device=device)
    gather_rows(only_table, table, received[:0], torch.arange(-7, 0, device=device))
    assert torch.equal(only_table, table[-7:])
    if device == "cuda":
        assert kernel_status().startswith("triton") and "failed" not in kernel_status(), kernel_status()


# -- non-finite gradients and change tracking, one rank (the multi-rank forms run in context_worker) ----


def _ctx1(port: int, generation: int, optimizer: OptimizerSpec, **kw) -> EmbContext:
    store = dist.TCPStore("127.0.0.1", port, 1, generation == 0, timeout=timedelta(seconds=10))
    spec = TableSpec(name="t", num_rows=50, dim=3)
    ctx = EmbContext(_solo(generation, port), store, tables=[spec], optimizer=optimizer, seed=None, **kw)
    rows = torch.arange(150, dtype=torch.float32).reshape(50, 3) / 8  # exactly representable
    slots = {"accumulator": torch.full((50,), 0.5)} if optimizer.kind == "adagrad" else {}
    ctx.import_shard({"t": ShardData("t", RowRange(0, 50), rows, slots)})
    ctx.take_changes()  # the import marked every row; start from none
    ctx._store = store  # keep the server alive as long as the context
    return ctx


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_nonfinite_gradients_are_refused_or_skipped(kind):
    """NaN/inf gradients: by default the call raises NonFiniteGradients naming the table and the
    rows, and no row or slot changes; with nonfinite_gradients='skip' the finite rows are updated
    exactly as the optimizer would alone, the others are left bit for bit, and an event counts them."""
    import structlog

    from elastic_emb.context.optim import apply_rows
    from elastic_emb.errors import NonFiniteGradients

    opt = OptimizerSpec(kind=kind, lr=0.5)
    port = free_port()
    ids = torch.tensor([3, 7, 7, 12, 40])
    grads = torch.full((5, 3), 0.25)
    grads[1, 0] = float("nan")  # row 7 (twice: one NaN position makes the row non-finite)
    grads[3, 2] = float("inf")  # row 12
    refuse = _ctx1(port, 0, opt)
    try:
        before = refuse.export_shard()["t"]
        with pytest.raises(NonFiniteGradients, match=r"2 row\(s\) of table 't'") as info:
            refuse.apply_gradients("t", ids, grads)
        assert info.value.table == "t" and info.value.rows == 2
        after = refuse.export_shard()["t"]
        assert torch.equal(after.weight, before.weight)
        assert all(torch.equal(after.slots[k], before.slots[k]) for k in before.slots)
        assert not refuse.take_changes()["t"].any(), "a refused call marked rows as written"
    finally:
        refuse.close()
    skip = _ctx1(port, 1, opt, nonfinite_gradients="skip")
    try:
        before = skip.export_shard()["t"]
        with structlog.testing.capture_logs() as events:
            skip.apply_gradients("t", ids, grads)
        assert [(e["table"], e["rows"]) for e in events if e["event"] == "context.nonfinite_gradients_skipped"] == [
            ("t", 2)
        ], events
        expect_w, expect_s = before.weight.clone(), {k: v.clone() for k, v in before.slots.items()}
        apply_rows(opt, expect_w, expect_s, torch.tensor([3, 40]), torch.full((2, 3), 0.25))
        after = skip.export_shard()["t"]
        assert torch.equal(after.weight, expect_w)
        assert all(torch.equal(after.slots[k], expect_s[k]) for k in expect_s)
        changed = skip.take_changes()["t"]
        assert changed.nonzero().squeeze(1).tolist() == [3, 40]
    finally:
        skip.close()


@settings(max_examples=25, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 49), max_size=30), min_size=1, max_size=6),
    takes=st.lists(st.sampled_from([None, "mask", "rows", "raw"]), min_size=6, max_size=6),
)
def test_take_changes_marks_exactly_the_rows_written(batches, takes):
    """Random batches with duplicates and empty ones: after each step, the rows take_changes()
    (the mask) or take_changed_rows() (the row numbers, deduplicated or raw) reports are exactly
    the ids applied since the previous take, and exactly the rows whose value changed (SGD with
    non-zero gradients changes every row it touches). Six batches of up to 30 ids exceed the 50
    rows, so the tracker's fold into a mask is exercised too."""
    ctx = _ctx1(free_port(), 0, OptimizerSpec(kind="sgd", lr=1.0))
    try:
        since, base = set(), ctx.export_shard()["t"].weight
        for batch, take in zip(batches, takes):
            ids = torch.tensor(batch, dtype=torch.int64)
            ctx.apply_gradients("t", ids, torch.ones(len(batch), 3))
            since |= set(batch)
            if take is None:
                continue
            if take == "mask":
                mask = ctx.take_changes()["t"]
                assert mask.dtype == torch.bool and mask.shape == (50,)
                got = set(mask.nonzero().squeeze(1).tolist())
            elif take == "rows":
                rows = ctx.take_changed_rows()["t"]
                assert rows.dtype == torch.int64 and rows.tolist() == sorted(set(rows.tolist())), "sorted, distinct"
                got = set(rows.tolist())
            else:
                raw = ctx.take_changed_rows(unique=False)["t"].tolist()
                assert all(0 <= r <= 50 for r in raw), f"raw rows {raw} outside the shard and its dump number"
                got = set(raw) - {50}
            now = ctx.export_shard()["t"].weight
            assert got == since
            assert set((now != base).any(dim=1).nonzero().squeeze(1).tolist()) == since
            since, base = set(), now
        ctx.import_shard(ctx.export_shard())
        assert ctx.take_changes()["t"].all(), "import_shard writes every row"
        assert not ctx.take_changes()["t"].any(), "take_changes hands over its mask and starts afresh"
        ctx.import_shard(ctx.export_shard())
        assert ctx.take_changed_rows()["t"] is None, "import_shard writes every row: None stands for all"
        assert ctx.take_changed_rows()["t"].numel() == 0, "take_changed_rows hands over its rows and starts afresh"
    finally:
        ctx.close()


def test_raw_rows_carry_the_values_of_a_tables_one_write():
    """What a GPU commit copies instead of gathering (elastic_emb.state.capture): once the rows
    were taken raw, a table written once since hands over, with its rows, the values that write
    left in them (Adagrad computes them whole), equal bit for bit to the table's rows and slots
    at each entry that is a row (the skipped ones are the dump number 50); none after a second
    write, none to a deduplicated take, none before the first raw take (nothing kept)."""
    ctx = _ctx1(free_port(), 0, OptimizerSpec(kind="adagrad", lr=0.5), nonfinite_gradients="skip")
    ids, grads = torch.tensor([3, 7, 7, 12, 40]), torch.full((5, 3), 0.25)
    grads[3, 2] = float("nan")  # row 12 skipped
    try:
        ctx.apply_gradients("t", ids, grads)
        assert ctx.take_changed_rows(unique=False).written == {}, "values kept before any raw take"
        ctx.apply_gradients("t", ids, grads)
        taken = ctx.take_changed_rows(unique=False)
        rows, vals = taken["t"], taken.written["t"]
        assert sorted(set(rows.tolist())) == [3, 7, 40, 50]
        shard, real = ctx.export_shard()["t"], rows < 50
        assert set(vals) == {"weight", "accumulator"}
        assert torch.equal(vals["weight"][real], shard.weight[rows[real]])
        assert torch.equal(vals["accumulator"][real], shard.slots["accumulator"][rows[real]])
        ctx.apply_gradients("t", ids, grads)
        ctx.apply_gradients("t", ids, grads)
        assert ctx.take_changed_rows(unique=False).written == {}, "two writes: no values (the capture gathers)"
        ctx.apply_gradients("t", ids, grads)
        assert ctx.take_changed_rows().written == {}, "a deduplicated take carries no values"
    finally:
        ctx.close()
