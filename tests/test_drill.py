"""Drills end to end: real torchrun agents, real SIGTERM/SIGKILL, tables checked bit for bit.

The fast tests check the pieces a drill's verdict rests on (the exactness of the example's
gradient scheme, scenario validation, the verifier on tampered outputs). The drill tests run
whole scenarios (scale-up, scale-down, node loss, worker crash, a planted silent corruption)
through :func:`elastic_emb.drill.run_drill` and assert zero loss, the world sizes seen, and that
no process or network namespace is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_emb.drill import PRESETS, LossDetected, Scenario, chaos, load_scenario, procs, run_drill, verify
from elastic_emb.drill.network import netns_works
from elastic_emb.drill.replay import EXAMPLE, load_script
from elastic_emb.drill.scenario import Fault
from tests.helpers.drill_report import merge_restart_retries

REPO = Path(__file__).resolve().parents[1]
NETNS_OK, NETNS_WHY = netns_works()

# -- the exactness scheme ---------------------------------------------------------------------


def test_gradients_are_independent_of_the_rank_slicing_and_match_torch_func():
    """A sample's quantised gradient is the same whatever rank slice it is computed in, and the
    closed-form backward equals torch.func's per-sample gradients after quantisation."""
    from torch.func import grad, vmap

    m = load_script()
    cfg = m.Config()
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(cfg.dense_params, generator=gen) * 0.3
    table = torch.randn(4096, cfg.dim, generator=gen) * 0.3
    data, sampler = m.generate_dataset(cfg), m.make_sampler(cfg)
    for step in range(5):
        users, items, labels = m.batch_of(data, sampler.indices(0, 1), cfg)
        sampler.advance(1)
        u, i = table[users], table[items % 4096]
        _, gd, gu, gi = m.sample_gradients(cfg, dense, u, i, labels)
        for world in (2, 3, 5, 8):
            parts = [
                m.sample_gradients(cfg, dense, u[s], i[s], labels[s])
                for s in (m.rank_slice(cfg.batch, r, world) for r in range(world))
            ]
            for k, full in ((1, gd), (2, gu), (3, gi)):
                assert torch.equal(torch.cat([p[k] for p in parts]), full), (step, world, k)
        per_sample = vmap(
            grad(lambda d, uu, ii, yy: m.tower_loss(cfg, d, uu[None], ii[None], yy[None]).sum(), argnums=(0, 1, 2)),
            in_dims=(None, 0, 0, 0),
        )
        fd, fu, fi = per_sample(dense.double(), u.double(), i.double(), labels)
        assert torch.equal(m.quantise(fd.reshape(len(labels), -1)[:, : cfg.dense_params]), gd)
        assert torch.equal(m.quantise(fu), gu) and torch.equal(m.quantise(fi), gi)


def test_the_dataset_file_is_generated_once_deterministically_and_refused_when_it_does_not_fit(tmp_path):
    """The example's dataset: the same bytes from the same seed (so ranks racing to write it agree),
    written atomically (no temporary left), and a file of another shape or dtype refused in one line."""
    m = load_script()
    cfg = m.Config(samples=300)
    path = m.default_data_path(tmp_path, cfg)
    first = m.load_dataset(path, cfg)
    assert first.shape == (300, 3) and first.dtype.name == "int64" and set(first[:, 2].tolist()) == {0, 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    path.unlink()
    assert m.dataset_crc(m.load_dataset(path, cfg)) == m.dataset_crc(first) == m.dataset_crc(m.generate_dataset(cfg))
    with pytest.raises(ValueError, match=r"holds int64 \(300, 3\), this run needs int64 \(400, 3\).*--samples 300"):
        m.load_dataset(path, m.Config(samples=400))
    import numpy as np

    np.save(path, first.astype(np.int32))
    with pytest.raises(ValueError, match="holds int32"):
        m.load_dataset(path, cfg)
    path.write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="not a NumPy array file"):
        m.load_dataset(path, cfg)


def test_quantised_sums_are_exact_in_any_order():
    m = load_script()
    g = m.quantise(torch.randn(m.Config().batch, 545, generator=torch.Generator().manual_seed(0)) * 3)
    forward = g.sum(0)
    for seed in range(3):
        perm = torch.randperm(len(g), generator=torch.Generator().manual_seed(seed))
        acc = torch.zeros_like(forward)
        for chunk in g[perm].split(7):  # ranks summing their slices, then an all-reduce
            acc += chunk.sum(0)
        assert torch.equal(acc, forward)


def test_rank_slices_partition_the_global_batch():
    m = load_script()
    for n in (8, 255, 256):
        for world in range(1, 9):
            idx = [i for r in range(world) for i in range(n)[m.rank_slice(n, r, world)]]
            assert idx == list(range(n))


# -- scenarios ------------------------------------------------------------------------------------


def test_presets_validate_and_simulate():
    for name, s in PRESETS.items():
        history = s.simulate()
        assert history[0] == list(range(s.initial_nodes)), name
        for mode in ("restart", "in_process"):  # every preset validates in both modes (gpu-2-1-2 too)
            assert Scenario.model_validate({**s.model_dump(), "mode": mode}).simulate() == history, (name, mode)
    assert PRESETS["demo"].simulate() == [[0], [0, 1], [0]]


def test_scenario_file_yaml_and_json(tmp_path):
    s = load_scenario(str(REPO / "examples" / "scenarios" / "rolling.yaml"))
    assert s.name == "rolling" and [f.kind for f in s.faults] == ["join", "join", "crash_worker", "kill_node"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"initial_nodes": 2, "faults": [{"kind": "leave", "at_step": 5}]}))
    assert load_scenario(str(path)).name == "mine"
    # No mode named: in process with the elastic_emb rendezvous, restart with stock c10d (its only mode).
    assert (s.mode, load_scenario(str(path)).mode) == ("in_process", "in_process")
    for extra, mode in (({"rendezvous": "c10d"}, "restart"), ({"mode": "restart"}, "restart")):
        path.write_text(json.dumps({"initial_nodes": 2, **extra}))
        assert load_scenario(str(path)).mode == mode, extra
    assert PRESETS["gpu-2-1-2"].mode == "restart"  # not yet drilled in process on two GPUs


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"faults": [{"kind": "join", "at_step": 5}, {"kind": "join", "at_step": 9}]}, "max_nodes=2"),
        ({"initial_nodes": 2, "faults": [{"kind": "kill_node", "at_step": 5, "node": 3}]}, "node 3 is not live"),
        ({"faults": [{"kind": "join", "at_step": 5, "at_time": 1.0}]}, "exactly one of at_step or at_time"),
        ({"steps": 10, "faults": [{"kind": "join", "at_step": 10}]}, "training ends at step 9"),
        ({"faults": [{"kind": "explode", "at_step": 1}]}, "kind"),
        ({"initial_nodes": 1, "faults": [{"kind": "leave", "at_step": 3}]}, "min_nodes=1"),
        ({"bogus": 1}, "bogus"),
        ({"mode": "in_process", "rendezvous": "c10d"}, "mode='in_process' needs rendezvous='elastic_emb'"),
    ],
)
def test_invalid_scenarios_are_refused_naming_the_fault(tmp_path, data, needle):
    path = tmp_path / "bad.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_scenario(str(path))


def test_chaos_is_reproducible_and_always_feasible():
    assert chaos(7) == chaos(7)
    assert chaos(7) != chaos(8)
    for seed in range(200):
        s = chaos(seed)
        assert all(1 <= len(live) <= s.max_nodes for live in s.simulate())


def test_unknown_scenario_names_the_presets():
    with pytest.raises(ValueError, match="scale-up"):
        load_scenario("no-such-drill")


# -- drills end to end ----------------------------------------------------------------------------

# worker-crash runs in process: the crashed worker's node leaves (2 -> 1) and rejoins (1 -> 2).
# scale-up (an in-process join, 1 -> 2) is the first half of the demo preset, whose test below
# makes the same checks: one launch instead of two. (scale-up keeps the rendezvous in the drill's
# own store server, demo in the agent's; an in-process join over the drill's store is
# worker-crash's rejoin.)
EXPECTED_WORLDS = {"scale-down": [2, 1], "node-loss": [2, 1], "worker-crash": [2, 1, 2], "agent-loss": [2, 1]}
# Loopback for two drills, one namespace per node for the other two (when root can make them),
# so both network modes run in every test pass.
NETWORK = {"scale-down": "loopback", "node-loss": "auto", "worker-crash": "auto", "agent-loss": "loopback"}
# The drill's own deadline for the tests marked timeout(240): well under pytest's, so a hang fails
# with the drill's error naming its logs (and _explain keeps its directory), not a bare pytest
# timeout that kills the test before the drill can say anything. These drills take 15-35 s loaded.
DRILL_S = 180


def _leftovers(out: Path) -> list[str]:
    """Processes of this drill still alive (agents or workers), by their state dir or out dir."""
    marker = str(out).encode()
    found = []
    for pid in procs.all_pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (marker in env or marker in cmd) and procs.alive(pid):
            found.append(f"{pid}: {procs.cmdline(pid)[:120]}")
    return found


def _namespaces() -> set[str]:
    if not NETNS_OK:
        return set()
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    # Only the namespaces of drills this process ran (their names carry the creating pid): another
    # suite or drill on the same machine makes and removes its own meanwhile.
    mine = f"ee{os.getpid()}x"
    return {line.split()[0] for line in r.stdout.splitlines() if line.startswith(mine)}


def _run(name: str, tmp_path: Path, **update) -> tuple[dict, Path]:
    scenario = PRESETS[name]
    if update:
        scenario = Scenario.model_validate({**scenario.model_dump(), **update})
    out = tmp_path / name
    before = _namespaces()
    report = run_drill(scenario, out, progress="lines")
    assert not _leftovers(out), f"processes left behind: {_leftovers(out)}"
    assert _namespaces() <= before, f"namespaces left behind: {_namespaces() - before}"
    return report, out


def _explain(report: dict, out: Path) -> str:
    """The failure message (evaluated only when an assertion fails): the error, the log tails, and
    a copy of the whole drill directory outside pytest's rotating tmp dirs, for a post-mortem."""
    keep = (
        Path(os.environ.get("ELASTIC_EMB_FAILED_DRILLS", "/tmp/elastic_emb-failed-drills"))
        / f"{out.name}-{os.getpid()}"
    )
    shutil.copytree(out, keep, dirs_exist_ok=True, ignore_dangling_symlinks=True)
    tails = [f"drill directory kept at {keep}"]
    for log in sorted((out / "logs").glob("*.log")):
        tails.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return f"error: {report['error']}\nverification: {report['verification']}\n" + "\n".join(tails)


def _check_lossless(report: dict, out: Path, name: str, worlds: list[int], network: str) -> None:
    """A drill of preset ``name`` passed: every row and committed step equal to the replay, the
    worlds expected, no step lost, its report written (JSON and plot)."""
    assert report["ok"], _explain(report, out)
    v = report["verification"]
    assert v["ok"] and v["step"] == PRESETS[name].steps - 1
    assert v["rows_checked"] == 4096 + 4096
    assert v["samples_accounted"] == PRESETS[name].steps * PRESETS[name].batch  # each step read its global batch
    assert v["step_checksums_checked"] >= PRESETS[name].steps  # every committed step was checked
    assert report["world_sizes"] == worlds, _explain(report, out)
    assert [r["steps_lost"] for r in report["resizes"]] == [0] * (len(worlds) - 1), report["resizes"]
    assert report["network"] == ("netns" if network == "auto" and NETNS_OK else "loopback")
    assert (out / "report.png").stat().st_size > 10_000
    saved = json.loads((out / "report.json").read_text())
    assert saved["resizes"][0]["recovery_seconds"] > 0 and saved["faults"][0]["kind"] == PRESETS[name].faults[0].kind


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(EXPECTED_WORLDS))
def test_drill_loses_nothing(name, tmp_path):
    report, out = _run(name, tmp_path, network=NETWORK[name], timeout=DRILL_S)
    _check_lossless(report, out, name, EXPECTED_WORLDS[name], NETWORK[name])
    if name == "worker-crash":
        # In process: the crashed worker's node leaves the world and rejoins it; the survivor lives on.
        causes = [r["cause"] for r in report["resizes"]]
        assert causes == ["crash_worker node1", "rejoin node1 (crash_worker)"], report["resizes"]
    if name == "agent-loss":
        # The orphaned worker (its agent SIGKILLed) left by itself, before the drill's cleanup.
        assert report["faults"][0]["orphans"] and report["orphans_alive_at_end"] == []
    if name in ("node-loss", "agent-loss"):
        # The dead node's rows can only have come from the replicas on the survivor.
        assert "replica" in report["resizes"][0]["source_tiers"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["in_process", "restart"])
def test_planted_silent_corruption_fails_loudly_naming_rows_and_steps(tmp_path, mode):
    """Rows of the newest commit are changed *with matching checksums* (a state-layer bug, not
    a disk error), then the workers are killed so they restore from it: only the comparison with
    the replay can tell, and it must name the rows and the step. Commits are incremental by
    default, so the newest commit is a delta: the planted rows are its first changed rows (the
    ones that step wrote), not the first rows of the table. In both resize modes (the join after
    the planting re-forms in process, or restarts every worker; under load it may come after the
    end, which changes nothing here: the restore of the planted commit is the planting's restart)."""
    report, out = _run("corrupt-snapshot", tmp_path, network="loopback", mode=mode, timeout=DRILL_S)
    if mode == "restart":  # every change restarted every worker (in process, the planting does too)
        assert report["resizes"] and {r["mode"] for r in report["resizes"]} == {"restart"}, report["resizes"]
    assert report["ok"] is False
    v = report["verification"]
    assert v["ok"] is False and "LOSS DETECTED" in v["error"], _explain(report, out)
    planted = report["faults"][0]["corrupted"][0]
    assert planted["table"] == "user" and len(planted["row_list"]) == 3
    rows = {(f["table"], f["row"]) for f in v["findings"] if "row" in f}
    assert {("user", r) for r in planted["row_list"]} <= rows
    first = [f for f in v["findings"] if f["problem"] == "first divergence from the replay" and f["table"] == "user"]
    assert first and first[0]["step"] == planted["step"] + 1 and first[0]["process_restored_step"] == planted["step"]
    assert f"right after step {planted['step'] + 1}" in v["error"]


# -- the verifier on tampered outputs (no processes: reuses a finished drill's files) -------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small real run (torchrun, 2 workers, 12 steps) whose output the tamper tests copy."""
    out = tmp_path_factory.mktemp("run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "ELASTIC_EMB_"))}
    env.update(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        ELASTIC_EMB_BACKEND="gloo",
        OMP_NUM_THREADS="1",
        ELASTIC_EMB_STATE_DIR=str(out / "state"),
        ELASTIC_EMB_LOG_FORMAT="json",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(EXAMPLE),
        "--steps",
        "12",
        "--out",
        str(out / "run"),
        "--checksums",
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


@pytest.mark.slow
def test_verify_accepts_the_untouched_run(finished_run):
    v = verify(finished_run)
    assert v["ok"] and v["step"] == 11 and v["world_size"] == 2


def test_verify_names_a_changed_row(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    path = sorted((run / "final").glob("*-r1-*.pt"))[0]
    payload = torch.load(path, weights_only=True)
    shard = payload["shards"]["item"]
    shard["weight"][5] = torch.nextafter(shard["weight"][5], torch.full_like(shard["weight"][5], 9.0))  # 1 ulp
    torch.save(payload, path)
    with pytest.raises(LossDetected) as err:
        verify(run)
    row = shard["start"] + 5
    assert any(f.get("table") == "item" and f.get("row") == row for f in err.value.findings)
    assert f"item[{row}]" in str(err.value)


def test_verify_names_missing_and_duplicated_rows(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    path = sorted((run / "final").glob("*-r1-*.pt"))[0]
    payload = torch.load(path, weights_only=True)
    user = payload["shards"]["user"]
    user["start"], user["weight"] = user["start"] - 10, torch.cat([user["weight"][:10], user["weight"][:-10]])
    user["stop"] -= 10  # now overlaps rank 0 by 10 rows and leaves the last 10 rows unowned
    torch.save(payload, path)
    with pytest.raises(LossDetected, match=r"rows lost or duplicated") as err:
        verify(run)
    problems = {(f["table"], f["problem"], tuple(map(tuple, f["rows"]))) for f in err.value.findings}
    assert ("user", "no rank holds", ((4086, 4096),)) in problems
    assert ("user", "several ranks hold", ((2038, 2048),)) in problems


def test_verify_detects_a_step_applied_twice(finished_run, tmp_path):
    """Re-applying the last step's gradients on top of the final rows is caught (row-level)."""
    run = _copy(finished_run, tmp_path)
    m = load_script()
    cfg = m.Config()
    from elastic_emb.drill.replay import replay

    data = m.generate_dataset(cfg)
    tables, _, _, dense = replay(m, cfg, 11, data=data, keep_history=False)
    sampler = m.make_sampler(cfg)
    sampler.advance(1, steps=11)  # step 11's samples
    users, items, labels = m.batch_of(data, sampler.indices(0, 1), cfg)
    _, _, gu, _ = m.sample_gradients(cfg, dense.model.flat(), tables["user"][users], tables["item"][items], labels)
    for path in sorted((run / "final").glob("*.pt")):
        payload = torch.load(path, weights_only=True)
        sh = payload["shards"]["user"]
        mine = (users >= sh["start"]) & (users < sh["stop"])
        sh["weight"].index_add_(0, users[mine] - sh["start"], gu[mine], alpha=-cfg.lr)
        torch.save(payload, path)
    with pytest.raises(LossDetected) as err:
        verify(run)
    wrong = {f["row"] for f in err.value.findings if f.get("table") == "user" and "row" in f}
    assert wrong and wrong <= set(users.tolist())


def test_verify_checks_the_replicated_state_bit_for_bit(finished_run, tmp_path):
    """One ulp of one of Adam's moments on every rank is named; on one rank only, the ranks' disagreement is."""
    run = _copy(finished_run, tmp_path)
    paths = sorted((run / "final").glob("*.pt"))
    for path in paths:
        payload = torch.load(path, weights_only=True)
        m2 = payload["app"]["optim"]["state"][0]["exp_avg_sq"]
        m2.view(-1)[3] = torch.nextafter(m2.view(-1)[3], torch.tensor(9.0))
        torch.save(payload, path)
    with pytest.raises(LossDetected, match=r"app\.optim\.state\.0\.exp_avg_sq") as err:
        verify(run)
    assert any(f.get("problem") == "replicated state differs from the replay" for f in err.value.findings)
    payload = torch.load(paths[0], weights_only=True)
    payload["app"]["sampler"]["cursor"] += cfg_batch(run)  # a step's samples counted twice, on rank 0 only
    torch.save(payload, paths[0])
    with pytest.raises(LossDetected, match=r"app\.sampler\.cursor: ranks 0 and 1 hold different replicated state"):
        verify(run)


def cfg_batch(run: Path) -> int:
    return torch.load(sorted((run / "final").glob("*.pt"))[0], weights_only=True)["config"]["batch"]


def test_verify_names_a_rank_that_read_other_samples(finished_run, tmp_path):
    """The sample accounting, step by step: a rank whose progress line says it read other samples is named."""
    run = _copy(finished_run, tmp_path)
    events = sorted((run / "events").glob("*.jsonl"))[0]
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    for e in lines:
        if e.get("event") == "step" and e["step"] == 7:
            e["samples_crc"] ^= 1
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    with pytest.raises(LossDetected, match=r"read samples other than the global order names at step 7"):
        verify(run)


def test_verify_without_final_tables_says_so(tmp_path):
    (tmp_path / "final").mkdir()
    with pytest.raises(LossDetected, match="never finished"):
        verify(tmp_path)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl, one GPU per simulated node)")
def test_gpu_drill_2_1_2_loses_nothing(tmp_path):
    report, out = _run("gpu-2-1-2", tmp_path)
    assert report["ok"], _explain(report, out)
    assert report["world_sizes"] == [2, 1, 2, 1, 2], _explain(report, out)
    assert all(r["steps_lost"] == 0 for r in report["resizes"])


def test_a_fault_waits_until_every_rank_of_the_new_world_has_a_commit_of_it(tmp_path):
    """The wait after a membership fault (slow steps; the next step-triggered fault held back) ends
    only once every rank of the new world said a commit made in that world is complete: commits
    are written in the background, so its first steps may carry only the older world's commit, and
    a kill then (etcd v3 drill: node 0, alone before the join) would leave nothing to restore from."""
    from elastic_emb.drill.orchestrator import Drill

    drill = Drill(PRESETS["agent-loss"], tmp_path / "d")
    drill.slow_file.parent.mkdir(parents=True)
    drill.slow_file.touch()
    drill.rank0_pid, drill.generation = 100, 0
    drill.awaiting = (100, 0, 2, time.monotonic() + 60)  # rank 0's pid and generation at the fault; world 2

    def step(rank: int, step: int, committed: int, generation: int = 1, pid: int = 200) -> None:
        drill._observe(
            [
                {
                    "event": "step",
                    "t": time.time(),
                    "step": step,
                    "world": 2,
                    "rank": rank,
                    "generation": generation,
                    "pid": pid + rank,
                    "committed": committed,
                }
            ]
        )

    step(0, 30, 29)  # the new world steps; its newest complete commit is the old world's (restored) step
    step(1, 30, 29)
    step(0, 31, 30)  # rank 0 has a commit of generation 1; rank 1 not yet
    assert drill.awaiting is not None and drill.slow_file.exists()
    step(1, 31, 30)
    assert drill.awaiting is None and not drill.slow_file.exists()


@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable here: {NETNS_WHY}")
def test_namespaces_left_by_a_killed_drill_are_removed():
    """A drill killed with SIGKILL cannot clean up; the next drill removes its namespaces (their
    names carry the creating pid), and leaves those of live drills alone."""
    from elastic_emb.drill.network import remove_stale_namespaces

    dead = next(p for p in range(4_000_000, 4_100_000) if not procs.alive(p))
    stale, live = f"ee{dead}xabcn0", f"ee{os.getpid()}xabcn0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        removed = remove_stale_namespaces()
        assert stale in removed and live not in removed
        assert stale not in _namespaces() and live in _namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def test_cli_lists_presets_and_refuses_a_bad_scenario(tmp_path):
    from click.testing import CliRunner

    from elastic_emb.cli.main import main

    runner = CliRunner()
    listed = runner.invoke(main, ["drill", "--list"])
    assert listed.exit_code == 0 and all(name in listed.output for name in PRESETS)
    assert "Issue" not in listed.output  # descriptions say what a drill does, not where it came from
    # --help names the same presets as --list (the option's help is built from PRESETS).
    helped = runner.invoke(main, ["drill", "--help"], terminal_width=1000, max_content_width=1000)
    assert helped.exit_code == 0 and all(name in helped.output for name in PRESETS), helped.output
    bad = runner.invoke(main, ["drill", "--scenario", "nope", "--out", str(tmp_path / "d")])
    assert bad.exit_code == 2 and "neither a preset" in bad.output
    missing = runner.invoke(main, ["drill"])
    assert missing.exit_code == 2 and "--scenario is required" in missing.output


def test_cli_mode_runs_any_preset_in_either_mode(tmp_path, monkeypatch):
    """``--mode restart|in_process`` overrides the preset's mode (what is run is the validated
    scenario); in process with stock c10d is refused before anything starts."""
    from click.testing import CliRunner

    from elastic_emb.cli.main import main
    from elastic_emb.drill import command

    ran = []
    monkeypatch.setattr(command, "_run", lambda scenario, out, script, progress: ran.append(scenario) or 0)
    runner = CliRunner()
    for name in ("worker-crash", "demo"):
        for mode in ("restart", "in_process"):
            r = runner.invoke(main, ["drill", "--scenario", name, "--mode", mode, "--out", str(tmp_path / name)])
            assert r.exit_code == 0, r.output
            assert (ran[-1].name, ran[-1].mode) == (name, mode)
            assert ran[-1].faults == PRESETS[name].faults
    refused = runner.invoke(
        main,
        ["drill", "--scenario", "demo", "--mode", "in_process", "--rendezvous", "c10d", "--out", str(tmp_path / "c")],
    )
    assert refused.exit_code == 2 and "needs the elastic_emb rendezvous" in refused.output
    assert len(ran) == 4


def test_default_out_is_the_working_directory_or_a_temporary_one(tmp_path, monkeypatch):
    from elastic_emb.drill.command import default_out

    monkeypatch.chdir(tmp_path)
    assert default_out("demo") == tmp_path / "drill-demo"
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    monkeypatch.chdir(locked)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode bits: make the check see it read-only
            monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
        out = default_out("demo")
        assert out.is_dir() and not out.is_relative_to(locked) and out.name.startswith("elastic-emb-drill-demo-")
        out.rmdir()
    finally:
        locked.chmod(0o755)


@pytest.mark.slow
def test_a_worker_failing_before_its_first_step_is_named_in_the_drill_error(tmp_path):
    """The cause (the worker's last error line) is in the drill's own message, not only in a log."""
    script = tmp_path / "broken.py"
    script.write_text("import sys\nraise RuntimeError('model config missing: set MODEL_CONFIG')\n")
    scenario = Scenario.model_validate(
        {
            **PRESETS["scale-up"].model_dump(),
            "faults": (),
            "steps": 5,
            "network": "loopback",
            "max_restarts": 0,
            "timeout": 120,
        }
    )
    report = run_drill(scenario, tmp_path / "d", script=script, progress="lines", summary=False)
    assert report["ok"] is False
    assert "before the first committed step" in report["error"], report["error"]
    assert "RuntimeError: model config missing: set MODEL_CONFIG" in report["error"], report["error"]


def test_drill_refuses_to_overwrite_a_directory_it_did_not_make(tmp_path):
    from elastic_emb.drill import Drill, DrillError

    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(DrillError, match="not a drill directory"):
        Drill(PRESETS["scale-up"], tmp_path).run()
    assert (tmp_path / "precious.txt").read_text() == "keep me"


# -- Prometheus metrics, scraped during a real drill ------------------------------------------------


class _Scraper:
    """Scrapes the drill's metrics endpoints every 0.2 s (bounded), keeping each port's last reading."""

    def __init__(self, ports: list[int], seconds: float) -> None:
        import threading

        self.ports, self.latest, self.stop = ports, {}, threading.Event()
        self.deadline = time.monotonic() + seconds
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        while not self.stop.is_set() and time.monotonic() < self.deadline:
            for port in self.ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                        text = r.read().decode()
                except OSError:
                    continue
                samples = {}
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                self.latest[port] = samples
            self.stop.wait(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def _value(samples: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_scraped_during_a_drill_match_its_report(tmp_path):
    """scale-up (1 -> 2 nodes) with ELASTIC_EMB_METRICS_PORT: each worker's endpoint, last read
    before it exited, agrees with the drill's report (world size, generation, restore time, steps
    lost) and with what it must have done (a commit and 35 dense-row lookups per step)."""
    from elastic_emb.testing.ports import free_ports

    # node n: agent base + 2n, worker base + 2n + 1 (nproc_per_node 1). All four are reserved for
    # the whole test: the scraper keeps reading after the drill's processes exited (and before
    # they bound), and an unreserved port may then be served by any other listener on the machine
    # (seen once: a worker port's last reading was a page without a single sample).
    base = free_ports(4)
    scenario = PRESETS["scale-up"].model_copy(update={"network": "loopback", "mode": "restart"})  # restarted workers
    ports = [base + 2 * n + k for n in range(2) for k in range(2)]
    with _Scraper(ports, seconds=280) as scraper:
        report = run_drill(scenario, tmp_path / "d", progress="lines", summary=False, metrics_port=base)
    out = tmp_path / "d"
    assert report["ok"], _explain(report, out)
    final = report["segments"][-1]
    resize = report["resizes"][-1]
    workers = [scraper.latest[p] for p in (base + 1, base + 3) if p in scraper.latest]
    assert len(workers) == 2, f"scraped worker ports: {sorted(scraper.latest)} of {ports}"
    for w in workers:
        # The last reading is of the final world's worker (each process serves from its start).
        assert _value(w, "elastic_emb_world_size") == final["world"] == 2
        assert _value(w, "elastic_emb_generation") == final["generation"]
        assert _value(w, "elastic_emb_resizes_total", mode="start") == _value(w, "elastic_emb_resizes_total") == 1
        assert _value(w, "elastic_emb_steps_lost_total") == resize["steps_lost"] == 0
        for phase in ("teardown", "agreement", "construct", "restore", "transfer", "total"):
            assert _value(w, "elastic_emb_resize_phase_seconds_count", phase=phase) == 1
        commits = _value(w, "elastic_emb_commits_total")
        assert commits >= 1 and _value(w, "elastic_emb_commit_seconds_count") == commits
        assert _value(w, "elastic_emb_commit_bytes_total", tier="snapshot") > 0
        assert _value(w, "elastic_emb_commit_bytes_total", tier="replica") > 0  # two nodes: replicas
        assert final["first_step"] <= _value(w, "elastic_emb_step") <= final["last_step"]
        users = _value(w, "elastic_emb_lookups_total", table="user")
        # a rank's slice of the 256-sample global batch per step: all of it at world 1, half at 2
        assert 128 * commits <= users <= 256 * (commits + 1)
    # The agents' backends: node0 started the job and saw node1 join; node1's first round is that join.
    agents = [scraper.latest.get(base), scraper.latest.get(base + 2)]
    assert all(a is not None for a in agents), f"scraped agent ports: {sorted(scraper.latest)}"
    assert _value(agents[0], "elastic_emb_rendezvous_rounds_total", cause="start") == 1
    assert _value(agents[0], "elastic_emb_rendezvous_rounds_total", cause="join", mode="rebuild") == 1
    assert _value(agents[1], "elastic_emb_rendezvous_rounds_total") == 1
    for a in agents:
        assert _value(a, "elastic_emb_world_size") == final["world"]  # one worker per node
        assert _value(a, "elastic_emb_generation") == final["generation"]
        assert _value(a, "elastic_emb_store_outages_total") == 0
    # Rank 0's restore time is the one the report shows (rounded there to ms).
    rank0 = next(w for w in workers if _value(w, "elastic_emb_rank") == 0)
    assert (
        abs(_value(rank0, "elastic_emb_resize_phase_seconds_sum", phase="restore") - resize["phases"]["restore"])
        <= 0.0006
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # the session's wheel build and venv come first when this test runs before test_wheel
def test_demo_drill_in_process_mode_keeps_the_survivor_and_loses_nothing(wheel_demo):
    """``mode: in_process`` (``make demo``'s preset): 1 -> 2 -> 1 with ``--rdzv-conf resize=in_process``. Node 0's
    worker is one process from the first step to the last (it re-forms twice in place), and the
    final tables equal the single-process replay bit for bit (the drill's verification). Its
    first half is the scale-up preset (an in-process join on loopback, slowed steps until the
    joiner is in), checked here as test_drill_loses_nothing checks the others. The drill checked
    is the one ``elastic-emb demo`` ran from the wheel (the ``wheel_demo`` session fixture, which
    tests/test_wheel.py checks too): one launch of the preset for both."""
    assert PRESETS["demo"].mode == "in_process"
    up, demo = PRESETS["scale-up"], PRESETS["demo"]
    assert (up.mode, up.initial_nodes, up.max_nodes, up.slow_delay, [f.kind for f in up.faults]) == (
        demo.mode,
        demo.initial_nodes,
        demo.max_nodes,
        demo.slow_delay,
        [f.kind for f in demo.faults][:1],
    )
    out = wheel_demo.out
    assert wheel_demo.returncode == 0 and (out / "report.json").is_file(), wheel_demo.output[-6000:]
    assert not _leftovers(out), f"processes left behind: {_leftovers(out)}"
    report = json.loads((out / "report.json").read_text())
    assert report["scenario"] == json.loads(PRESETS["demo"].model_dump_json())  # the preset, as it is here
    _check_lossless(report, out, "demo", [1, 2, 1], "loopback")
    events = [json.loads(line) for f in sorted((out / "run" / "events").glob("*.jsonl")) for line in f.open()]
    node0 = {e["pid"] for e in events if e["node"] == "node0" and e["event"] in ("start", "step")}
    assert len(node0) == 1, node0  # never restarted
    resized = [e for e in events if e["event"] == "resized"]
    assert [(e["world"], e["pid"]) for e in resized if e["node"] == "node0"] == [(2, *node0), (1, *node0)], resized
    # the report sees both in-process resizes, with nothing lost and the survivors' pause measured
    assert report["world_sizes"] == [1, 2, 1], report["world_sizes"]
    assert [(r["mode"], r["steps_lost"]) for r in report["resizes"]] == [("in_process", 0)] * 2, report["resizes"]
    assert all(0 < r["pause_seconds"] < 30 for r in report["resizes"]), report["resizes"]
    print(f"\nin-process demo: pauses {[r['pause_seconds'] for r in report['resizes']]} s")


# -- restart mode of the presets that run in process by default -------------------------------------

# One drill in restart mode (the agents restart every worker at each change) with the faults whose
# restart paths the in-process presets differ in: an etcd outage with a join after it
# (store-host-loss, scale-up), a worker crash (worker-crash), a whole node SIGKILLed (node-loss,
# flapping, torchrec, ep8). One drill instead of one per preset: each costs 20-70 s on the 2-core
# machine (the torch import of every restarted worker). corrupt-snapshot runs in both modes above; a
# graceful leave in restart mode is tests/test_rendezvous.py's SIGTERM scale-down; the TorchRec and
# EP8 restart paths across processes are tests/test_ep8.py's restart-kill flavour and
# `elastic-emb drill --scenario torchrec|ep8|ep8-term|flapping|store-member-loss --mode restart`.
RESTART_MIX = Scenario(
    name="restart-mix",
    description="Restart mode: store-host-loss, worker-crash and node-loss in one drill.",
    initial_nodes=1,
    max_nodes=2,
    store="etcd",
    network="loopback",
    mode="restart",
    steps=62,
    step_delay=0.05,
    faults=(
        Fault(kind="kill_store", at_step=6, duration=3.0),
        Fault(kind="join", at_step=18),
        Fault(kind="crash_worker", at_step=32, node=1),
        Fault(kind="kill_node", at_step=46, node=1),
    ),
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restart_mode_drill_of_the_in_process_presets_loses_nothing(tmp_path):
    """:data:`RESTART_MIX`: 1 -> 2 (after an etcd outage) -> 2 (a worker crashed, every worker
    restarted) -> 1 (a node SIGKILLed), each change a restart of every worker, nothing lost, the
    final tables equal the single-process replay bit for bit."""
    if not shutil.which("etcd"):
        pytest.skip("etcd-server is not installed (Debian package etcd-server)")
    out = tmp_path / RESTART_MIX.name
    report = run_drill(RESTART_MIX, out, progress="lines", summary=False)
    assert not _leftovers(out), f"processes left behind: {_leftovers(out)}"
    assert report["ok"], _explain(report, out)
    v = report["verification"]
    assert v["ok"] and v["step"] == RESTART_MIX.steps - 1 and v["step_checksums_checked"] >= RESTART_MIX.steps
    # the join and the crashed worker's return each take one round, or two when a node comes after
    # the round's last call (a loaded machine): merged here, nothing may be lost in either
    worlds, resizes = merge_restart_retries(report)
    assert worlds == [1, 2, 2, 1], _explain(report, out)
    causes = [(r["cause"], r["mode"], r["steps_lost"]) for r in resizes]
    assert causes == [
        ("join node1", "restart", 0),
        ("crash_worker node1", "restart", 0),
        ("kill_node node1", "restart", 0),
    ], causes
    assert [f["kind"] for f in report["faults"]] == [f.kind for f in RESTART_MIX.faults], report["faults"]
    print(f"\nrestart mode mix: recoveries {[r['recovery_seconds'] for r in report['resizes']]} s")
