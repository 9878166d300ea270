"""Lifecycle with real processes: resizes in-process (live tier) and across restarts (snapshot
tier), torn commits, lost nodes, and the rule that ``reset`` is never used across sizes.

Every rank is a separate interpreter (elastic_emb/testing/procs.py) on a real TCPStore and gloo groups. Data
are integer-valued; after each scenario every row and optimizer slot of every table is compared
bit for bit with a reference run at world size 1 (same global batches, no resize), and training
continues from the committed step. Simulated nodes: each node id has its own state directory.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil

import pytest
import torch

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import SOURCE_ROOT as REPO
from elastic_emb.testing.procs import run_ranks, torchrun_env
from tests.helpers import lifecycle_worker as lw

TABLES = [{"name": "items", "num_rows": 203, "dim": 4}, {"name": "users", "num_rows": 61, "dim": 3}]


# -- environment of a simulated multi-node world ------------------------------------------------


def layout_env(layout: list[str], rank: int, port: int, gen: int) -> dict:
    """torchrun's variables for ``rank`` when rank r runs on node ``layout[r]``."""
    nodes = list(dict.fromkeys(layout))
    node = layout[rank]
    members = [r for r, n in enumerate(layout) if n == node]
    return {
        "RANK": rank,
        "WORLD_SIZE": len(layout),
        "LOCAL_RANK": members.index(rank),
        "LOCAL_WORLD_SIZE": len(members),
        "GROUP_RANK": nodes.index(node),
        "GROUP_WORLD_SIZE": len(nodes),
        "ELASTIC_EMB_GENERATION": gen,
        "MASTER_PORT": port,
    }


def rank_env(tmp, layout, rank, port, gen, spec: dict, extra: dict | None = None) -> dict:
    base = {k: str(v) for k, v in layout_env(layout, rank, port, gen).items()}
    node = layout[rank]
    env = torchrun_env(
        rank,
        len(layout),
        port,
        generation=gen,
        extra={
            **base,
            "ELASTIC_EMB_NODE_ID": node,
            "ELASTIC_EMB_STATE_DIR": str(tmp / "nodes" / node),
            "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p),
            "LCW_SPEC": json.dumps(spec),
            **(extra or {}),
        },
    )
    return env


# -- reference ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def reference(steps: int, optimizer: str = "adagrad") -> tuple:
    """Full tables after steps 0..steps-1 at world size 1 (integer start), for every prefix."""
    import torch.distributed as dist

    from elastic_emb.topology import Topology

    port = free_port()
    topo = Topology.build(
        run_id="reference",
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
        master_port=port,
    )
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    ctx = lw.make_factory({"tables": TABLES, "optimizer": optimizer})(topo, store)
    lw.integer_start(ctx)
    out = [_full(ctx)]  # out[k]: after steps 0..k-1
    for s in range(steps):
        lw.train_step(ctx, s)
        out.append(_full(ctx))
    ctx.close()
    return tuple(out)


def _full(ctx) -> dict:
    return {n: (s.weight.clone(), {k: v.clone() for k, v in s.slots.items()}) for n, s in ctx.export_shard().items()}


def ref_after(step: int, optimizer: str = "adagrad") -> dict:
    """State after committed step ``step`` (-1: the integer start)."""
    return reference(12, optimizer)[step + 1]


def gather(out, phase: str, gen: int) -> dict:
    """Assemble the full tables from every rank's dump of one phase."""
    files = sorted(glob.glob(str(out / f"{phase}-g{gen}-r*.pt")))
    assert files, f"no dumps {phase}-g{gen}-r*.pt in {out}"
    parts: dict[str, list] = {}
    for f in files:
        for name, (start, stop, w, slots) in torch.load(f).items():
            parts.setdefault(name, []).append((start, stop, w, slots))
    full = {}
    for name, ps in parts.items():
        ps.sort(key=lambda p: p[0])
        covered = [(a, b) for a, b, _, _ in ps if b > a]
        for (_a0, b0), (a1, _b1) in zip(covered, covered[1:]):
            assert b0 == a1, f"{name}: shards {covered} overlap or leave a gap"
        full[name] = (torch.cat([p[2] for p in ps]), {k: torch.cat([p[3][k] for p in ps]) for k in ps[0][3]})
    return full


def assert_bit_exact(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        gw, gs = got[name]
        ww, ws = want[name]
        assert gw.shape == ww.shape, f"{what}: {name} weight shape {tuple(gw.shape)} != {tuple(ww.shape)}"
        bad = (gw != ww).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{what}: table {name} rows {bad[:10]} differ from the reference"
        for k in ws:
            assert torch.equal(gs[k], ws[k]), f"{what}: table {name} slot {k} differs from the reference"


def ok(results) -> list[dict]:
    for r in results:
        assert r.returncode == 0, (
            f"rank {r.rank} rc={r.returncode}\nstdout:{r.stdout[-2000:]}\nstderr:{r.stderr[-4000:]}"
        )
    return [r.value for r in results]


def spec_of(out, **kw) -> dict:
    return {"out": str(out), "tables": TABLES, **kw}


# -- resize in one process: live tier -----------------------------------------------------------

CASES = {
    "4to2": (["A", "A", "B", "B"], ["A", "A"]),
    "2to4": (["A", "B"], ["A", "B", "C", "D"]),
    "4to3": (["A", "B", "C", "D"], ["A", "B", "C"]),
    "3to1": (["A", "B", "B"], ["A"]),
}


def _in_process(
    tmp_path,
    old: list[str],
    new: list[str],
    extra: dict,
    optimizer: str = "adagrad",
    until: int = 2,
    config: dict | None = None,
) -> list[dict]:
    """Old world trains steps 0-2; then in the same processes the new world is formed (leavers
    exit, joiners start), restores, trains steps 3-4. Checks every row and slot at each point."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    envs = []
    for r in range(max(len(old), len(new))):
        if r < len(old):
            resize = {"env": layout_env(new, r, port, 1)} if r < len(new) else {"env": None}
            spec = spec_of(
                out, train_until=until, resize=resize, then_until=until + 2, optimizer=optimizer, config=config or {}
            )
            envs.append(rank_env(tmp_path, old, r, port, 0, spec, extra))
        else:  # a joiner: starts in generation 1 once the old world finished phase 1
            spec = spec_of(
                out,
                train_until=until + 2,
                joiner=True,
                wait_file=str(out / "phase1-g0-r0.pt"),
                optimizer=optimizer,
                config=config or {},
            )
            envs.append(rank_env(tmp_path, new, r, port, 1, spec, extra))
    values = ok(run_ranks(lw.CODE, envs, timeout=120))
    what = f"{len(old)}->{len(new)}"
    assert_bit_exact(gather(out, "phase1", 0), ref_after(until, optimizer), f"{what}: before the resize")
    assert_bit_exact(gather(out, "resized", 1), ref_after(until, optimizer), f"{what}: right after the resize")
    assert_bit_exact(gather(out, "final", 1), ref_after(until + 2, optimizer), f"{what}: after training on")
    survivors = [v for v in values if not v.get("departed")]
    assert len(survivors) == len(new)
    for v in survivors:
        ev = v["events"][-1]
        every = (config or {}).get("commit_every", 1)
        # the last step taken, and the last one the cadence committed
        assert ev["restored_step"] == until and v["step"] == until + 2
        assert v["committed"] == (until + 2) // every * every
        if ev["kind"] == "rebuild":  # the old ranks: destroy + construct, never reset
            assert ev["old_world_size"] == len(old) and ev["new_world_size"] == len(new)
            assert "live" in ev["source_tiers"], ev
            for key in ("teardown_s", "agreement_s", "construct_s", "restore_s"):
                assert ev[key] >= 0
    moved = sum(v["events"][-1]["bytes_moved"] for v in survivors)
    local = sum(v["events"][-1]["bytes_local"] for v in survivors)
    assert (moved > 0) == (len(new) > 1) and moved + local > 0, (moved, local)
    return survivors


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resize_in_process(tmp_path, case):
    old, new = CASES[case]
    # On CPU rows are pulled out of the senders' memory (cma, the default) or travel by posted
    # gloo send/recv (p2p); two cases take the packed all-to-all that NCCL uses.
    forced = {"4to2": "alltoall", "2to4": "alltoall", "4to3": "cma", "3to1": "p2p"}[case]
    survivors = _in_process(tmp_path, old, new, {"ELASTIC_EMB_TRANSPORT": forced})
    assert {v["events"][-1]["transport"] for v in survivors} == {forced}
    tiers = set().union(*(set(v["events"][-1]["source_tiers"]) for v in survivors))
    if len(new) < len(old):
        # The departed node's rows come from the replicas its neighbours hold.
        assert tiers == {"live", "replica"}, tiers
    else:
        assert tiers == {"live"}, tiers


@pytest.mark.slow
def test_scale_up_commits_uncommitted_progress_first(tmp_path):
    """commit_every=2 and the resize comes after step 3, which the cadence did not commit: the
    healthy old world commits it before tearing down, and the new world goes on from step 3."""
    survivors = _in_process(tmp_path, ["A", "B"], ["A", "B", "C", "D"], {}, until=3, config={"commit_every": 2})
    old_ranks = [v for v in survivors if v["events"][-1]["kind"] == "rebuild"]
    assert len(old_ranks) == 2 and all(v["events"][-1]["committed_before"] for v in old_ranks)
    assert {t for v in survivors for t in v["events"][-1]["source_tiers"]} == {"live"}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs with NCCL (the lead runs it on the GPU machine)",
)
@pytest.mark.parametrize("case", ["2to1", "1to2"])
def test_resize_in_process_nccl(tmp_path, case):
    """The same on NCCL, one GPU per rank on one node; SGD keeps integer rows exact on any device."""
    old, new = {"2to1": (["A", "A"], ["A"]), "1to2": (["A"], ["A", "A"])}[case]
    survivors = _in_process(tmp_path, old, new, {"ELASTIC_EMB_BACKEND": "nccl"}, optimizer="sgd")
    tiers = set().union(*(set(v["events"][-1]["source_tiers"]) for v in survivors))
    # 2->1: the leaver's rows come from its snapshot on the shared node directory.
    assert tiers == ({"live", "snapshot"} if case == "2to1" else {"live"}), tiers


# -- resize across a restart: snapshot tier -----------------------------------------------------


@pytest.mark.slow
def test_resize_across_restarts(tmp_path):
    """New processes each time, state only in the node directories: 4 -> 2 (node B gone) -> 4
    (B back, its stale commit ignored) -> 3 (uneven: EP 2, one rank owns nothing) -> 1 (B gone).
    Every phase restores the previous phase's last commit and trains two more steps."""
    phases = [["A", "A", "B", "B"], ["A", "A"], ["A", "A", "B", "B"], ["A", "B", "B"], ["A"]]
    out = tmp_path / "out"
    out.mkdir()
    last = -1
    for gen, layout in enumerate(phases):
        port = free_port()
        until = last + (3 if gen == 0 else 2)
        envs = [rank_env(tmp_path, layout, r, port, gen, spec_of(out, train_until=until)) for r in range(len(layout))]
        values = ok(run_ranks(lw.CODE, envs, 120))
        what = f"phase {gen} ({len(phases[gen - 1]) if gen else 0} -> {len(layout)} ranks)"
        assert_bit_exact(gather(out, "start", gen), ref_after(last), f"{what}: restored in new processes")
        assert_bit_exact(gather(out, "phase1", gen), ref_after(until), f"{what}: after training on")
        for v in values:
            assert v["start_step"] == last and v["step"] == until, (what, v)
        tiers = set().union(*(set(v["events"][0]["source_tiers"]) for v in values))
        if gen == 0:
            assert tiers == {"init"}
        elif len(set(phases[gen - 1]) - set(layout)):  # a node is gone: its rows come from replicas
            assert "replica" in tiers and tiers <= {"snapshot", "replica"}, (what, tiers)
        else:
            assert "snapshot" in tiers and tiers <= {"snapshot", "replica"}, (what, tiers)
        last = until


# -- first start ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_first_start_rows_are_the_same_whatever_the_world_size(tmp_path):
    """No state anywhere: every world size starts from the same seeded rows (the context's init)."""
    starts = {}
    for world in (1, 3):
        out = tmp_path / f"out{world}"
        out.mkdir()
        p = free_port()
        layout = ["A"] * world
        values = ok(
            run_ranks(
                lw.CODE,
                [
                    rank_env(tmp_path / f"w{world}", layout, r, p, 0, spec_of(out, seeded_start=True))
                    for r in range(world)
                ],
                90,
            )
        )
        assert all(v["start_step"] == -1 and v["events"][0]["source_tiers"] == ["init"] for v in values)
        starts[world] = gather(out, "start", 0)
    for name, (w1, s1) in starts[1].items():
        w3, s3 = starts[3][name]
        assert torch.equal(w1, w3) and all(torch.equal(s1[k], s3[k]) for k in s1)
        assert w1.abs().sum() > 0  # seeded values, not zeros


# -- torn commit ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_between_data_and_manifest_uses_previous_commit(tmp_path):
    layout = ["A", "B"]
    out = tmp_path / "out"
    out.mkdir()
    p0 = free_port()
    fault = {"ELASTIC_EMB_FAULT": "snapshot_before_manifest@2"}
    results = run_ranks(
        lw.CODE, [rank_env(tmp_path, layout, r, p0, 0, spec_of(out, train_until=3), fault) for r in range(2)], 90
    )
    # Both ranks are armed; the first to reach the point (after the replica exchange) is killed, and its
    # peer is killed there too, or fails in a collective with the dead rank first (exit 1). Never a clean exit.
    codes = [r.returncode for r in results]
    assert -9 in codes and 0 not in codes, [(r.returncode, r.stderr[-1500:]) for r in results]
    # The torn commit: data of step 2 on both nodes, no manifest for it anywhere.
    step2 = glob.glob(str(tmp_path / "nodes" / "*" / "test" / "*" / "step-000000000002-*"))
    assert len(step2) == 2
    for d in step2:
        assert glob.glob(os.path.join(d, "*.bin")) and not glob.glob(os.path.join(d, "*.json")), os.listdir(d)
    p1 = free_port()
    values = ok(
        run_ranks(lw.CODE, [rank_env(tmp_path, layout, r, p1, 1, spec_of(out, train_until=3)) for r in range(2)], 90)
    )
    assert [v["start_step"] for v in values] == [1, 1]
    assert_bit_exact(gather(out, "start", 1), ref_after(1), "restored after the torn commit")
    assert_bit_exact(gather(out, "phase1", 1), ref_after(3), "trained on from step 2")


# -- a lost node ----------------------------------------------------------------------------------


def _two_nodes_then_lose_b(tmp_path, out, config: dict) -> None:
    p0 = free_port()
    envs = [rank_env(tmp_path, ["A", "B"], r, p0, 0, spec_of(out, train_until=2, config=config)) for r in range(2)]
    ok(run_ranks(lw.CODE, envs, 90))
    shutil.rmtree(tmp_path / "nodes" / "B")


@pytest.mark.slow
def test_lost_node_with_replication_loses_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _two_nodes_then_lose_b(tmp_path, out, {"replication": 1})
    p1 = free_port()
    [v] = ok(
        run_ranks(
            lw.CODE, [rank_env(tmp_path, ["A"], 0, p1, 1, spec_of(out, train_until=3, config={"replication": 1}))], 90
        )
    )
    assert v["start_step"] == 2
    assert v["events"][0]["source_tiers"] == ["replica", "snapshot"]
    assert_bit_exact(gather(out, "start", 1), ref_after(2), "restored from A's own snapshot + B's replica")
    assert_bit_exact(gather(out, "phase1", 1), ref_after(3), "trained on")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lost_node_without_replication_durable_then_error(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    durable = tmp_path / "durable"
    config = {"replication": 0, "durable_dir": str(durable)}
    _two_nodes_then_lose_b(tmp_path, out, config)
    # The durable checkpoint is plain DCP: load it here, one process, no elastic_emb involved.
    import torch.distributed.checkpoint as dcp

    [ckpt] = glob.glob(str(durable / "test" / "step-000000000002-*"))
    want = ref_after(2)
    sd = {f"{n}.weight": torch.empty_like(w) for n, (w, _) in want.items()}
    sd.update({f"{n}.{k}": torch.empty_like(v) for n, (_, slots) in want.items() for k, v in slots.items()})
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    assert_bit_exact(
        {n: (sd[f"{n}.weight"], {k: sd[f"{n}.{k}"] for k in slots}) for n, (_, slots) in want.items()},
        want,
        "durable checkpoint read by plain DCP",
    )
    p1 = free_port()
    [v] = ok(run_ranks(lw.CODE, [rank_env(tmp_path, ["A"], 0, p1, 1, spec_of(out, train_until=2, config=config))], 90))
    ev = v["events"][0]
    assert v["start_step"] == 2 and ev["source_tiers"] == ["durable"], ev
    assert ev["fallback"] and "durable" in ev["fallback"], ev
    assert_bit_exact(gather(out, "start", 1), ref_after(2), "restored from the durable tier")
    # Neither a replica nor a durable checkpoint: a clear error naming the rows, no fresh rows.
    shutil.rmtree(durable)
    p2 = free_port()
    [r] = run_ranks(lw.CODE, [rank_env(tmp_path, ["A"], 0, p2, 2, spec_of(out / "x", config={"replication": 0}))], 90)
    assert r.returncode == 3, r.stderr[-3000:]
    err = r.value
    assert err["error"] == "RestoreError"
    # Node B (old rank 1) held items [102, 203) and users [31, 61).
    assert sorted(map(tuple, err["missing"])) == [("items", 102, 203), ("users", 31, 61)], err
    assert "items[102, 203)" in err["message"] and "users[31, 61)" in err["message"]


# -- reset is for same-size re-forms only; a second context class proves the protocol --------------


@pytest.mark.slow
def test_minimal_context_resize_never_resets_across_sizes(tmp_path):
    old, new = ["A", "A", "B", "B"], ["A", "A"]
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    envs = []
    for r in range(4):
        calls = str(tmp_path / f"calls{r}.jsonl")
        if r < 2:
            spec = spec_of(
                out,
                context="mini",
                calls_file=calls,
                train_until=2,
                then_until=4,
                resize={"env": layout_env(new, r, port, 1)},
                reform=layout_env(new, r, port, 2),
            )
        else:
            spec = spec_of(out, context="mini", calls_file=calls, train_until=2, resize={"env": None})
        envs.append(rank_env(tmp_path, old, r, port, 0, spec))
    values = ok(run_ranks(lw.CODE, envs, 120))
    for r in range(2):
        calls = [json.loads(line) for line in open(tmp_path / f"calls{r}.jsonl")]
        kinds = [c["call"] for c in calls]
        # construct(4) ... close(4), construct(2), reset(2 on a 2-world context), close(2)
        assert kinds == ["construct", "close", "construct", "reset", "close"], calls
        assert [c["world_size"] for c in calls] == [4, 4, 2, 2, 2]
        resets = [c for c in calls if c["call"] == "reset"]
        assert all(c["world_size"] == c["built_for"] for c in resets), resets
        assert [e["kind"] for e in values[r]["events"]] == ["start", "rebuild", "reset"]
    # Mini training is local and closed-form: w = init + sum_s ((row + s) % 5 - 2), acc = steps.
    final = gather(out, "final", 2)
    for t in TABLES:
        n, dim = t["num_rows"], t["dim"]
        rows = torch.arange(n)
        want = _mini_init(n, dim)
        for s in range(5):
            want = want + ((rows + s) % 5 - 2).to(torch.float64)[:, None]
        w, slots = final[t["name"]]
        assert torch.equal(w, want)
        assert torch.equal(slots["accumulator"], torch.full((n,), 5.0, dtype=torch.float64))


def _mini_init(n: int, dim: int) -> torch.Tensor:
    from elastic_emb.sharding import RowRange

    return lw.int_init(RowRange(0, n), dim, torch.float64)
