"""The durable tier saves in the background: a step never waits for DCP.

Two real gloo ranks train an :class:`~elastic_emb.context.EmbContext` with a durable tier. The
durable thread of both ranks is held at the fault point ``durable_saving`` of step 3 (a gate, not
a clock): steps 4 and 5 then run and commit while the checkpoint of step 3 is demonstrably still
in flight (no DCP file of this rank, no metadata and no manifest exist yet). Once the gate opens, the checkpoint completes and holds
the rows of step 3, not the later ones: plain ``torch.distributed.checkpoint.load`` reads it in
this test's single process (world size 1, saved at 2), bit for bit.
"""

from __future__ import annotations

import glob
import json

import pytest
import torch

from elastic_emb.testing.ports import free_port
from elastic_emb.testing.procs import run_ranks, torchrun_env

TABLES = [{"name": "items", "num_rows": 203, "dim": 4}, {"name": "users", "num_rows": 61, "dim": 3}]

WORKER = r"""
import glob, json, os, threading
import torch
from elastic_emb.state import points
from tests.helpers import lifecycle_worker as lw

spec = json.loads(os.environ["LCW_SPEC"])
entered, gate = threading.Event(), threading.Event()

def hold(point, step):
    if point == "durable_saving" and step == 3:
        entered.set()
        if not gate.wait(120):
            raise TimeoutError("the gate of durable_saving@3 was never opened")

points.set_hook(hold)
lc = lw.start_and_train(spec, 3, "step3")
if not entered.wait(60):
    raise TimeoutError("the durable thread never reached durable_saving@3")
seen = []
for step in (4, 5):  # the checkpoint of step 3 is held at its gate all along
    lw.train_step(lc.context, step)
    lc.commit(step)
    # This rank's DCP files and the checkpoint's metadata and manifest (the other rank may have
    # opened its own gate already and made the directory: its files are not this rank's save).
    ckpt = os.path.join(spec["config"]["durable_dir"], "test", "step-000000000003-*")
    files = [f for f in glob.glob(os.path.join(ckpt, "*")) + glob.glob(os.path.join(ckpt, ".*"))
             if os.path.basename(f).startswith((f"__{lc.topology.rank}", ".metadata", "elastic_emb_manifest"))]
    # the snapshot commit of the step completes (waited for) while the durable save is held
    seen.append({"step": step, "in_flight": lc.durable_in_flight, "committed": lc.wait_commit(), "files": files})
gate.set()
lc.wait_durable()
lc.close()
print(json.dumps({"seen": seen}))
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_durable_save_runs_behind_the_steps_and_plain_dcp_loads_it_at_another_world_size(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    durable = tmp_path / "durable"
    spec = {"out": str(out), "tables": TABLES, "config": {"durable_dir": str(durable), "durable_every": 3}}
    port = free_port()
    envs = [
        torchrun_env(r, 2, port, extra={"ELASTIC_EMB_STATE_DIR": str(tmp_path / "nodes"), "LCW_SPEC": json.dumps(spec)})
        for r in range(2)
    ]
    results = run_ranks(WORKER, envs, 120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} rc={r.returncode}\nstderr:{r.stderr[-4000:]}"
    for r in results:
        for s in r.value["seen"]:
            assert s["in_flight"] and not s["files"], (
                f"rank {r.rank}: {s}: the durable save did not run behind the step"
            )
            assert s["committed"] == s["step"], f"rank {r.rank}: {s}: the snapshot commit of the step was held up"
    # The checkpoint of step 3, read by plain DCP in one process (saved by two), bit for bit.
    import torch.distributed.checkpoint as dcp

    [ckpt] = glob.glob(str(durable / "test" / "step-000000000003-*"))
    want: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(glob.glob(str(out / "step3-g0-r*.pt"))):
        for name, (start, _stop, w, slots) in torch.load(f).items():
            parts = want.setdefault(name, {})
            for key, t in [("weight", w), *slots.items()]:
                parts.setdefault(key, []).append((start, t))
    full = {
        f"{n}.{k}": torch.cat([t for _, t in sorted(ps, key=lambda p: p[0])])
        for n, d in want.items()
        for k, ps in d.items()
    }
    assert len(full) == 4 and all(len(full[f"{t['name']}.weight"]) == t["num_rows"] for t in TABLES), sorted(full)
    got = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    dcp.load(got, checkpoint_id=ckpt, no_dist=True)
    for k in full:
        assert torch.equal(got[k], full[k]), f"{k}: the durable checkpoint of step 3 differs from the rows of step 3"
    manifest = json.loads((tmp_path / ckpt / "elastic_emb_manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2, manifest


# Rank 1 dies at the start of its durable save of step 3 (a fault point, after both ranks' snapshot
# commits of step 3 completed): it never publishes its part of the checkpoint. Rank 0 is told it
# is gone, as the in-process resize tells the survivors, and re-forms alone.
GONE_WORKER = r"""
import json, os, threading
from elastic_emb.state import points
from elastic_emb.topology import Topology
from tests.helpers import lifecycle_worker as lw

spec = json.loads(os.environ["LCW_SPEC"])
rank = int(os.environ["RANK"])
committed = threading.Event()

def die(point, step):
    if rank == 1 and point == "durable_saving" and step == 3:
        if not committed.wait(60):
            raise TimeoutError("rank 1's snapshot commit of step 3 did not complete within 60 s")
        os._exit(0)  # like a node lost: its part of the checkpoint never comes

points.set_hook(die)
lc = lw.start_and_train(spec, 3, "step3")
done = lc.wait_commit()
committed.set()
if rank == 1:
    threading.Event().wait(60)
    raise SystemExit("rank 1 should have died in its durable thread")
lc.give_up_on([1], "node B is gone")
event = lc.on_membership_change(Topology.from_env(lw.new_env(
    {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1,
     "ELASTIC_EMB_GENERATION": 1})))
lw.dump(lc.context, spec["out"], "resized")
lc.close()
print(json.dumps({"committed": done, "event": event.model_dump()}))
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_durable_save_waiting_for_a_dead_rank_ends_when_it_is_given_up_on(tmp_path):
    """The survivor's durable save in flight waits for the dead rank's part of the checkpoint; the
    re-form first waits for that save. Given up on, the rank's missing part ends the save at once
    (``_CommAborted``, logged as ``lifecycle.durable_failed``), and the re-form restores step 3 from
    the snapshot tier, bit for bit. Before the durable communicator polled the store, its blocking
    wait ignored the give-up: the re-form waited ``transfer_timeout`` (here 600 s, past the
    test's 120 s)."""
    out = tmp_path / "out"
    out.mkdir()
    durable = tmp_path / "durable"
    spec = {
        "out": str(out),
        "tables": TABLES,
        "config": {"durable_dir": str(durable), "durable_every": 3, "transfer_timeout": 600.0},
    }
    port = free_port()
    envs = [
        torchrun_env(
            r,
            2,
            port,
            local_world_size=1,
            extra={
                "ELASTIC_EMB_STATE_DIR": str(tmp_path / "nodes"),
                "ELASTIC_EMB_NODE_ID": "AB"[r],
                "LCW_SPEC": json.dumps(spec),
            },
        )
        for r in range(2)
    ]
    survivor, lost = run_ranks(GONE_WORKER, envs, 120)
    assert lost.returncode == 0 and not lost.stdout.strip(), f"rank 1 rc={lost.returncode}\n{lost.stderr[-3000:]}"
    assert survivor.returncode == 0, f"rank 0 rc={survivor.returncode}\n{survivor.stderr[-4000:]}"
    failed = [json.loads(line) for line in survivor.stderr.splitlines() if '"lifecycle.durable_failed"' in line]
    assert len(failed) == 1 and "_CommAborted" in failed[0]["error"], survivor.stderr[-3000:]
    assert "ranks [1] will never publish (node B is gone)" in failed[0]["error"], failed
    assert survivor.value["committed"] == 3
    event = survivor.value["event"]
    assert event["kind"] == "rebuild" and event["restored_step"] == 3, event
    assert not glob.glob(str(durable / "test" / "step-000000000003-*" / "elastic_emb_manifest.json"))
    before = [torch.load(out / f"step3-g0-r{r}.pt") for r in range(2)]
    [after] = [torch.load(out / "resized-g1-r0.pt")]
    for t in TABLES:
        name = t["name"]
        parts = sorted((b[name] for b in before), key=lambda p: p[0])
        start, stop, weight, slots = after[name]
        assert (start, stop) == (0, t["num_rows"])
        assert torch.equal(weight, torch.cat([p[2] for p in parts])), f"{name}: rows differ from step 3's"
        for k in slots:
            assert torch.equal(slots[k], torch.cat([p[3][k] for p in parts])), f"{name}.{k} differs from step 3's"
