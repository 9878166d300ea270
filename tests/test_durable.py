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
from tests.helpers.procs import run_ranks, torchrun_env

TABLES = [{"name": "items", "num_rows": 203, "dim": 4}, {"name": "users", "num_rows": 61, "dim": 3}]

WORKER = r"""
import glob, json, os, threading
import torch
from elastic_emb.lifecycle import Lifecycle, LifecycleConfig
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
lc = Lifecycle.start(lw.make_factory(spec), LifecycleConfig(**spec["config"]))
lw.integer_start(lc.context)
for step in range(4):
    lw.train_step(lc.context, step)
    lc.commit(step)
lw.dump(lc.context, spec["out"], "step3")
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_durable_save_runs_behind_the_steps_and_plain_dcp_loads_it_at_another_world_size(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    durable = tmp_path / "durable"
    spec = {"out": str(out), "tables": TABLES, "config": {"durable_dir": str(durable), "durable_every": 3}}
    port = free_port()
    envs = [torchrun_env(r, 2, port, extra={"ELASTIC_EMB_STATE_DIR": str(tmp_path / "nodes"), "LCW_SPEC": json.dumps(spec)})
            for r in range(2)]
    results = run_ranks(WORKER, envs, 120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} rc={r.returncode}\nstderr:{r.stderr[-4000:]}"
    for r in results:
        for s in r.value["seen"]:
            assert s["in_flight"] and not s["files"], f"rank {r.rank}: {s}: the durable save did not run behind the step"
            assert s["committed"] == s["step"], f"rank {r.rank}: {s}: the snapshot commit of the step was held up"
    # The checkpoint of step 3, read by plain DCP in one process (saved by two), bit for bit.
    import torch.distributed.checkpoint as dcp

    [ckpt] = glob.glob(str(durable / "test" / "step-000000000003-*"))
    want: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(glob.glob(str(out / "step3-g0-r*.pt"))):
        for name, (start, stop, w, slots) in torch.load(f).items():
            parts = want.setdefault(name, {})
            for key, t in [("weight", w), *slots.items()]:
                parts.setdefault(key, []).append((start, t))
    full = {f"{n}.{k}": torch.cat([t for _, t in sorted(ps, key=lambda p: p[0])]) for n, d in want.items() for k, ps in d.items()}
    assert len(full) == 4 and all(len(full[f"{t['name']}.weight"]) == t["num_rows"] for t in TABLES), sorted(full)
    got = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    dcp.load(got, checkpoint_id=ckpt, no_dist=True)
    for k in full:
        assert torch.equal(got[k], full[k]), f"{k}: the durable checkpoint of step 3 differs from the rows of step 3"
    manifest = json.loads((tmp_path / ckpt / "elastic_emb_manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2, manifest
