"""A small gloo worker for the rendezvous tests and bench/resize.py, run under real torchrun agents.

Each generation: topology from torchrun's environment -> agreement over the worker store -> a
gloo process group on a store prefix of its own -> steps. A step is one all_reduce of the step
number over every rank (a collective the whole world takes part in), then a commit: the step is
appended to the rank's JSON-lines log. The next generation resumes after the highest step every
rank of the previous world committed (the max over the logs, agreed by an all_reduce MAX), so a
lost step shows up as a gap or a repeat in the logs.

With the elastic_emb watcher (``ELASTIC_EMB_RDZV_ENDPOINT`` set) the worker drains: after each
commit it asks ``drain_requested(step)``, and once the agreed last step is committed it
acknowledges and idles until the agent's SIGTERM. Under a stock torchrun agent the watcher takes
one last look at the rendezvous state at SIGTERM (:func:`look_once_more_on_sigterm`).

``RDZV_TEST_WORKER=lifecycle`` runs the acceptance worker instead (:func:`main_lifecycle`):
elastic_emb's Lifecycle over an EmbContext, committing every step, checking at every start that
the restored rows are bit-exact: :func:`expected_rows` replays every step with the optimizer's
own row update, so it holds for any step count (tests/test_workers.py checks it against a real
context for rows hit 10 times).

Environment: ``RDZV_TEST_LOG_DIR`` (where the per-rank logs go), ``RDZV_TEST_MODE`` (``busy``:
step continuously; ``idle``: one step per generation, then sleep), ``RDZV_TEST_STEP_S`` (sleep
per step, default 0.05), ``RDZV_TEST_MAX_STEPS`` (stop after this step, default 100000),
``RDZV_TEST_NODE_FAULT`` (a fault point where the worker kills its agent and itself:
:func:`kill_node_at`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.rdzv.keys import ENV_AGENT_PID
from elastic_emb.store import generation_store, worker_store
from elastic_emb.topology import Topology, agree
from elastic_emb.watch import heartbeat
from elastic_emb.watch.watcher import Watcher

LOG_DIR = os.environ.get("RDZV_TEST_LOG_DIR", "")  # required by main() and main_lifecycle()
MODE = os.environ.get("RDZV_TEST_MODE", "busy")
STEP_S = float(os.environ.get("RDZV_TEST_STEP_S", "0.05"))
MAX_STEPS = int(os.environ.get("RDZV_TEST_MAX_STEPS", "100000"))


def log(record: dict) -> None:
    record["t"] = time.time()
    record["pid"] = os.getpid()
    with open(os.path.join(LOG_DIR, f"worker-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def log_watch_events(watcher, gen: int, rank: int) -> None:
    if watcher is not None:
        for e in watcher.events():
            log(
                {
                    "ev": "membership",
                    "gen": gen,
                    "rank": rank,
                    "kind": e.kind,
                    "nodes": list(e.nodes),
                    "state_round": e.state_round,
                    "watch_round": e.round,
                    "watch_node": watcher.node,
                }
            )


def look_once_more_on_sigterm(watcher, gen: int, rank: int) -> None:
    """Under a stock torchrun agent: at SIGTERM, record what the rendezvous state says, then die.

    Stock torchrun restarts the workers when it sees a node in the wait list, and it stops them
    *before* it re-rendezvouses (``LocalElasticAgent._restart_workers``: ``_stop_workers``, then
    ``_rendezvous``), so the state that made it stop us is still in the store when SIGTERM
    arrives. Without this last look, a join is seen only if the watcher's 0.1 s poll catches the
    wait list and the main loop logs it before the SIGTERM, which comes 0.1 to ~1 s after the
    joiner entered the wait list (the agent's 1 s state cache): a race that a stall loses. The
    look is bounded (10 s, generous for a loaded machine: it ends as soon as the watcher's thread
    reports the join; torch waits 30 s before SIGKILL). The elastic_emb backend needs none: it
    drains first, and its SIGTERM timings are what bench/resize.py measures.
    """

    def on_sigterm(signum, frame):
        try:
            watcher.membership_change_pending(timeout=10.0)
            log_watch_events(watcher, gen, rank)
            log({"ev": "sigterm", "gen": gen, "rank": rank})
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def last_committed() -> int:
    best = -1
    for name in os.listdir(LOG_DIR):
        if not name.startswith("worker-"):
            continue
        with open(os.path.join(LOG_DIR, name)) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if rec.get("ev") == "commit":
                    best = max(best, rec["step"])
    return best


def main() -> int:
    t_start = time.time()
    topo = Topology.from_env()
    store = worker_store(topo, timeout=30.0)
    topo = agree(topo, store, timeout=30.0)
    dist.init_process_group(
        "gloo",
        store=generation_store(store, topo, "pg"),
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timedelta(seconds=30),
    )
    watcher = Watcher.from_env()
    if watcher is not None:
        watcher.start()
        if ENV_AGENT_PID not in os.environ:  # set by the elastic_emb backend only: this agent is stock torchrun
            look_once_more_on_sigterm(watcher, topo.generation, topo.rank)
    t = torch.tensor([last_committed()], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step = int(t.item()) + 1
    log(
        {
            "ev": "ready",
            "gen": topo.generation,
            "rank": topo.rank,
            "ws": topo.world_size,
            "resume": step,
            "boot_s": time.time() - t_start,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
            "node": os.environ.get("ELASTIC_EMB_RDZV_NODE"),
            "agent_pid": os.getppid(),
        }
    )
    while step <= MAX_STEPS:
        if watcher is not None and watcher.evicted:
            log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
            os._exit(3)  # outside the membership: no teardown that could touch shared state
        log_watch_events(watcher, topo.generation, topo.rank)
        log({"ev": "start", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "step": step})
        x = torch.tensor([step], dtype=torch.int64)
        try:
            dist.all_reduce(x)
        except Exception:
            log_watch_events(watcher, topo.generation, topo.rank)
            if watcher is not None and watcher.membership_change_pending(timeout=5.0):
                log_watch_events(watcher, topo.generation, topo.rank)
                log({"ev": "collective_failed_membership", "gen": topo.generation, "rank": topo.rank, "step": step})
            raise
        if int(x.item()) != step * topo.world_size:
            raise RuntimeError(f"step {step}: all_reduce gave {int(x.item())}, expected {step * topo.world_size}")
        log({"ev": "commit", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "step": step})
        if watcher is not None and watcher.drain_requested(step):
            watcher.ack_drain(step)
            log({"ev": "drained", "gen": topo.generation, "rank": topo.rank, "step": step})
            break
        step += 1
        if MODE == "idle":
            break
        time.sleep(STEP_S)
    # Idle (or drained): no collectives, wait for the agent to restart or stop us.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        log_watch_events(watcher, topo.generation, topo.rank)
        if watcher is not None and watcher.evicted:
            log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
            os._exit(3)  # outside the membership: no teardown that could touch shared state
        time.sleep(0.05)
    return 0


# -- the acceptance worker: elastic_emb's Lifecycle and EmbContext --------------------------------

SEED = 0
# The table (RDZV_TEST_ROWS x RDZV_TEST_DIM fp32; bench/resize.py --table-mb sizes it). The steps
# hit rows 0..63 only; a start checks the first CHECK_ROWS rows of each shard, which is every row
# of the tests' 64-row table and, in a large one, every row a step touched (rank 0's shard).
TABLE_ROWS = int(os.environ.get("RDZV_TEST_ROWS", "64"))
TABLE_DIM = int(os.environ.get("RDZV_TEST_DIM", "4"))
HIT_ROWS, CHECK_ROWS = min(64, TABLE_ROWS), 4096


def table_spec():
    from elastic_emb.protocol import TableSpec

    return TableSpec(name="t", num_rows=TABLE_ROWS, dim=TABLE_DIM)


def optimizer_spec():
    from elastic_emb.protocol import OptimizerSpec

    return OptimizerSpec(kind="sgd", lr=1.0)


def step_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and gradients ``rank`` sends at ``step``: rank 0 sends -1 for row ``step % 64``."""
    ids = torch.tensor([step % HIT_ROWS] if rank == 0 else [], dtype=torch.int64)
    return ids, -torch.ones(len(ids), TABLE_DIM)


def train_step(ctx, step: int, rank: int) -> None:
    """One step of the worker (collective: every rank calls it)."""
    ids, grads = step_batch(step, rank)
    ctx.apply_gradients("t", ids, grads)


def expected_rows(lo: int, hi: int, last_step: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the table after steps 0..last_step, replayed step by step.

    Each step's batch (rank 0's; the others send none) goes through the optimizer's own update
    as the owner applies it: duplicates summed into a zero buffer, then one fp32 ``index_add_``
    per step. Adding 1.0 once per hit rounds after every addition, which a closed form
    (``init + hits``) does not: on random fp32 rows the two differ from 4 hits of a row on.
    """
    from elastic_emb.context import init_rows
    from elastic_emb.context.optim import dense_reference_step
    from elastic_emb.sharding import RowRange

    rows = init_rows(table_spec(), SEED, RowRange(lo, hi)).clone()
    opt = optimizer_spec()
    for step in range(last_step + 1):
        ids, grads = step_batch(step, 0)
        mine = (ids >= lo) & (ids < hi)
        if mine.any():
            dense_reference_step(opt, rows, {}, ids[mine] - lo, grads[mine])
    return rows


def rows_match(shard, step: int) -> bool:
    """The shard's first CHECK_ROWS rows equal the step-by-step replay, bit for bit."""
    lo = shard.rows.start
    hi = min(shard.rows.stop, lo + CHECK_ROWS)
    return bool(torch.equal(shard.weight[: hi - lo], expected_rows(lo, hi, step)))


def main_lifecycle() -> int:
    """Each step: rank 0 sends a gradient of -1 for row ``step % 64`` (SGD, lr 1: +1.0), every
    rank takes part in the collective apply, then the lifecycle commits. At every start the
    restored rows must equal :func:`expected_rows` for the restored step, bit for bit."""
    import functools

    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.context import EmbContext

    t_start = time.time()
    factory = functools.partial(EmbContext, tables=[table_spec()], optimizer=optimizer_spec(), seed=SEED)
    watcher = Watcher.from_env()
    if watcher is not None:
        watcher.start()
    # transfer_timeout bounds a commit's store exchange with a peer that died (in-process resize
    # re-forms when it expires); the table is 1 KiB, so 10 s is ample for every real transfer.
    # resize=in_process: the first generation's store waits end when a member leaves (the
    # survivors re-form instead of waiting out a commit's timeout for a dead peer).
    from elastic_emb import config as settings
    from elastic_emb.inprocess.interruptible import interruptible_store
    from elastic_emb.inprocess.resize import InProcessResize, ResizeFallback
    from elastic_emb.store import worker_store
    from elastic_emb.topology import Topology

    lc_config = LifecycleConfig(agree_timeout=30.0, transfer_timeout=10.0)
    # RDZV_TEST_DENSE=1: a dense part with Adam, a schedule and a sampler, as app state (dense_part.py)
    dense = None
    if os.environ.get("RDZV_TEST_DENSE") == "1":
        from tests.helpers.dense_part import DensePart, replay

        dense = DensePart()
    app_state = dense.objects() if dense is not None else None

    def dense_record() -> dict:
        if dense is None:
            return {}
        return {"dense_ok": dense.digest() == replay(lc.step), "cursor": dense.sampler.cursor}

    joined = settings.load(None, "joiner").joiner
    if joined:  # this node joined a running world in process: wait to be included, then start
        try:
            lc, resizer = InProcessResize.join(factory, lc_config, watcher, timeout=20.0, app_state=app_state)
        except ResizeFallback:
            log({"ev": "resize_fallback", "gen": -1, "rank": -1})
            time.sleep(60)  # the agents restart everyone (restart mode); their SIGTERM ends us
            return 3
    else:
        store = interruptible_store(worker_store(Topology.from_env(), timeout=30.0), watcher)
        lc = Lifecycle.start(factory, lc_config, watcher=watcher, store=store, app_state=app_state)
        resizer = InProcessResize(lc, watcher)
    topo = lc.topology
    shard = lc.context.export_shard()["t"]
    rows_ok = rows_match(shard, lc.step)
    log(
        {
            "ev": "ready",
            "gen": topo.generation,
            "rank": topo.rank,
            "ws": topo.world_size,
            "resume": lc.next_step,
            "boot_s": time.time() - t_start,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
            "node": os.environ.get("ELASTIC_EMB_RDZV_NODE"),
            "agent_pid": os.getppid(),
            "rows_ok": rows_ok,
            "rows": [shard.rows.start, shard.rows.stop],
            "joined": joined,
            **dense_record(),
        }
    )
    if not rows_ok:
        raise RuntimeError(f"rank {topo.rank}: restored rows of step {lc.step} differ from the step-by-step replay")

    def reform(failed: bool):
        # resize=in_process: the survivors re-form in this process; the rows must be bit-exact.
        try:
            event = resizer.run(failed=failed)
        except ResizeFallback:
            log({"ev": "resize_fallback", "gen": lc.topology.generation, "rank": lc.topology.rank})
            lc.wait_for_restart(60)
            sys.exit(3)
        t = lc.topology
        # the arena's own rows (restored in place), not a copy: the check is not part of the pause
        got = (lc.context.shard_views() if lc.step >= 0 else lc.context.export_shard())["t"]
        ok = rows_match(got, lc.step)
        log(
            {
                "ev": "reformed",
                "gen": t.generation,
                "rank": t.rank,
                "ws": t.world_size,
                "resume": lc.next_step,
                "rows_ok": ok,
                "rows": [got.rows.start, got.rows.stop],
                "failed": failed,
                "tiers": event.source_tiers,
                "total_s": event.total_s,
                **dense_record(),
            }
        )
        if not ok:
            raise RuntimeError(f"rank {t.rank}: rows after the in-process resize differ from step {lc.step}")
        first_step_due[0] = True
        return t

    first_step_due = [False]  # the lifecycle.resize event completes at the first commit after a re-form

    while lc.next_step <= MAX_STEPS:
        if resizer.pending():
            topo = reform(failed=False)
        step = lc.next_step
        log({"ev": "start", "gen": topo.generation, "rank": topo.rank, "ws": topo.world_size, "step": step})
        try:
            train_step(lc.context, step, topo.rank)
            samples = None
            if dense is not None:
                samples = dense.train(step, topo.rank, topo.world_size, lc.context.process_group)
            lc.commit(step)
        except Exception as exc:
            if resizer.enabled:
                log(
                    {
                        "ev": "collective_failed",
                        "gen": topo.generation,
                        "rank": topo.rank,
                        "step": step,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                )
                topo = reform(failed=True)
                continue
            # A peer vanished mid-collective. If the membership changed, the agent is about to
            # restart us: wait for its SIGTERM rather than fail (a failure spends restart budget).
            # The change may show only a while after the collective failed (a SIGTERMed agent
            # leaves at its exit, after stopping its workers; a dead one's heartbeat expires):
            # the bound is generous for a loaded machine, and the wait ends as soon as it shows.
            heartbeat.pause()  # waiting on purpose for the agent's restart
            if watcher is not None and watcher.membership_change_pending(timeout=30.0):
                log({"ev": "collective_failed_membership", "gen": topo.generation, "rank": topo.rank, "step": step})
                time.sleep(30)
            raise
        # committed: the newest complete commit (this step's may still be in flight, async commits)
        log(
            {
                "ev": "commit",
                "gen": topo.generation,
                "rank": topo.rank,
                "ws": topo.world_size,
                "step": step,
                "committed": lc.committed_step,
                **({"samples": samples, "cursor": dense.sampler.cursor} if dense is not None else {}),
            }
        )
        if first_step_due[0]:
            first_step_due[0] = False
            ev = lc.events[-1].model_dump()
            log(
                {
                    "ev": "resize_event",
                    "gen": topo.generation,
                    "rank": topo.rank,
                    "event_pid": ev["pid"],
                    **{k: v for k, v in ev.items() if k not in ("shard_tiers", "rank", "pid")},
                }
            )
        if lc.draining:
            log({"ev": "drained", "gen": topo.generation, "rank": topo.rank, "step": step})
            if lc.wait_for_restart(60):
                # The agent's SIGTERM after the drain: every step is committed, so die at once, as
                # SIG_DFL would (see __main__). An interpreter shutdown took 5-14 s at load 16, and
                # the agent rejoins only after it: past the next round's last call, which then
                # formed without this node (and a second drain and round followed).
                os._exit(0)
            return 3
        if MODE == "idle":
            # idle: no collective until a change; in process, the next generation takes one step
            # (a join plan names the step to take first), then idles again. Idling on purpose:
            # the agent's hang watchdog is disarmed until the next commit.
            heartbeat.pause()
            deadline = time.monotonic() + 600
            while resizer.enabled and not (resizer.pending() or resizer.planned()) and time.monotonic() < deadline:
                if watcher.evicted:
                    log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
                    os._exit(3)
                time.sleep(0.02)
            if not resizer.enabled:
                break
            continue
        time.sleep(STEP_S)
    heartbeat.pause()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # idle: no collectives, wait for a restart or an eviction
        if watcher is not None and watcher.evicted:
            log({"ev": "evicted", "gen": topo.generation, "rank": topo.rank})
            os._exit(3)  # outside the membership: no teardown that could touch shared state
        time.sleep(0.05)
    return 0


def kill_node_at(point: str) -> None:
    """``RDZV_TEST_NODE_FAULT=<point>``: at that fault point (``elastic_emb.state.points``) this
    worker SIGKILLs its agent, then itself: the whole node is lost there (no orphan is left to
    report it; the survivors learn it from the heartbeat expiry)."""
    from elastic_emb.state import points

    def hook(reached: str, step: int | None) -> None:
        if reached == point:
            log({"ev": "node_fault", "point": point, "step": step, "agent_pid": os.getppid()})
            os.kill(int(os.environ.get(ENV_AGENT_PID, os.getppid())), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    points.set_hook(hook)


if __name__ == "__main__":
    # The agent's SIGTERM ends the generation: every step is already committed, so let the
    # kernel's default action end the process at once. A Python-level handler would run only
    # when the main thread returns to the interpreter: blocked in a store wait of a commit whose
    # peer is gone, that is up to the wait's timeout, and the restart waits for it. (The plain
    # worker under a stock agent, which makes no such waits, takes one bounded last look.)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from elastic_emb.testing.faults import arm_from_env

    arm_from_env()  # ELASTIC_EMB_FAULT, when a test sets it
    if os.environ.get("RDZV_TEST_NODE_FAULT"):
        kill_node_at(os.environ["RDZV_TEST_NODE_FAULT"])
    sys.exit(main_lifecycle() if os.environ.get("RDZV_TEST_WORKER") == "lifecycle" else main())
