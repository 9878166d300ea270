"""Eight-rank elastic scenarios on CPU: a hub process that forks one process per rank.

Starting eight Python + torch interpreters per phase costs more CPU than the scenarios
themselves on a 2-core machine, so the hub imports torch and elastic_emb once and then
``os.fork()``s every rank (before any thread, communicator or store exists in the hub). Each
child is a real, separate process: it sets its own torchrun environment, talks over a real
TCPStore and real gloo groups, and is ended by real signals (SIGKILL, SIGTERM) sent by the hub.

A scenario is a list of *phases*, each a layout: the process ids of the world in rank order
(``"A0"`` is slot 0 of simulated node A; the node id and state directory are ``A``). Between
two phases:

* a process in both layouts is a **survivor**: it stays alive and calls
  ``Lifecycle.on_membership_change`` (in-process resize, live tier);
* a process only in the earlier one is a **leaver**, and the transition's ``how`` says how it
  goes: ``term`` (commit, then wait for SIGTERM from the hub and exit 0: a graceful drain) or
  ``kill`` (every rank starts the next step; leavers finish the first table's lookup and
  gradients, then are SIGKILLed by the hub while the survivors wait inside the second table's
  lookup, so the survivors' live rows are *newer* than the last commit and partly torn);
* ``restart-kill``: every process of the earlier phase ends. Those on nodes absent from the
  later phase are SIGKILLed mid-step as in ``kill``; the others see that step fail and exit 0
  (a torchrun worker whose collective failed); the later phase's processes are new incarnations
  (``"A0.1"``) on the same nodes that restore from the node directories;
* a process only in the later one is a **joiner**: forked at the start, it waits until the
  previous phase is done and then starts a Lifecycle (restore from the survivors' live rows).

Phase k trains up to step ``until[k]`` (committing every step); every rank dumps its shard
right after a start/resize (``resized-g<k>-r<rank>.pt``) and after training (``trained-g<k>``)
for the test to compare bit for bit with a single-process reference. Run it as
``python -c "from tests.helpers import ep8_worker; ep8_worker.hub()"`` with ``EP8_SPEC`` (JSON) in the
environment; the last stdout line is JSON: exit status per process id.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time
import traceback

from elastic_emb import Lifecycle, LifecycleConfig
from elastic_emb.topology import Topology
from tests.helpers import lifecycle_worker as lw

DEADLINE_S = 120.0  # the whole scenario, hub side


def node_of(pid: str) -> str:
    """``"A0"`` and its restarted incarnation ``"A0.1"`` both run on node ``A``."""
    return pid.split(".")[0][:-1]


def layout_env(layout: list[str], rank: int, port: int, gen: int, ep_size: int | None = None) -> dict:
    """torchrun's variables for ``rank`` of ``layout`` (process ids; node = id without its slot)."""
    nodes = list(dict.fromkeys(node_of(p) for p in layout))
    node = node_of(layout[rank])
    members = [r for r, p in enumerate(layout) if node_of(p) == node]
    env = {
        "RANK": rank,
        "WORLD_SIZE": len(layout),
        "LOCAL_RANK": members.index(rank),
        "LOCAL_WORLD_SIZE": len(members),
        "GROUP_RANK": nodes.index(node),
        "GROUP_WORLD_SIZE": len(nodes),
        "ELASTIC_EMB_GENERATION": gen,
        "MASTER_PORT": port,
    }
    if ep_size is not None:
        env["ELASTIC_EMB_EP_SIZE"] = ep_size
    return {k: str(v) for k, v in env.items()}


def _flag(out: str, name: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(str(os.getpid()))


def _wait_for(pattern: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(glob.glob(pattern)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {count} files {pattern}, found {len(glob.glob(pattern))}")
        time.sleep(0.02)


def _half_step(ctx, step: int, leaver: bool) -> str | None:
    """Step ``step`` until the leavers are gone: the first table's lookup + gradients on every
    rank; then survivors enter the second table's lookup, which fails once the leavers die."""
    t = ctx.topology
    names = list(ctx.tables)
    first, spec = names[0], ctx.tables[names[0]]
    ids, g = lw.global_batch(step, spec.num_rows)
    mine = ids[t.rank :: t.world_size]
    ctx.lookup(first, mine).wait(timeout=60)
    ctx.apply_gradients(first, mine, g[t.rank :: t.world_size][:, None].expand(-1, spec.dim).contiguous())
    if leaver:
        return None
    second = ctx.tables[names[1]]
    ids2, _ = lw.global_batch(step, second.num_rows)
    try:
        ctx.lookup(names[1], ids2[t.rank :: t.world_size]).wait(timeout=60)
    except Exception as exc:  # expected: a peer was SIGKILLed inside this collective
        return type(exc).__name__
    raise AssertionError(f"rank {t.rank}: lookup of {names[1]!r} at step {step} succeeded with its peers SIGKILLed")


def rank_main(spec: dict, me: str) -> None:
    out = spec["out"]
    phases: list[list[str]] = spec["phases"]
    until: list[int] = spec["until"]
    hows: list[str] = spec["how"]  # how[k]: transition k -> k+1 for the leavers ("term" | "kill")
    eps: list[int | None] = spec.get("ep", [None] * len(phases))
    mine = [k for k, layout in enumerate(phases) if me in layout]
    first, last = mine[0], mine[-1]
    assert mine == list(range(first, last + 1)), f"{me} must be in consecutive phases, is in {mine}"
    ports: list[int] = spec["ports"]

    def env_of(k: int) -> dict:
        return layout_env(phases[k], phases[k].index(me), ports[k], k, eps[k])

    os.environ.update(env_of(first))
    os.environ["ELASTIC_EMB_NODE_ID"] = node_of(me)
    os.environ["ELASTIC_EMB_STATE_DIR"] = os.path.join(spec["nodes"], node_of(me))
    result: dict = {"id": me, "events": [], "failed_steps": []}
    if first > 0:  # a joiner: start once the previous phase's survivors finished training
        _wait_for(os.path.join(out, f"trained-g{first - 1}-r*.pt"), len(phases[first - 1]), 90)
        if hows[first - 1].startswith("restart"):  # and once every process of that phase is gone
            _wait_for(os.path.join(out, f"gone-g{first - 1}-*"), len(phases[first - 1]), 90)
    lc = Lifecycle.start(lw.make_factory(spec), LifecycleConfig(**spec.get("config", {})))
    result["events"].append(lc.events[-1].model_dump())
    result["start_step"] = lc.step
    if lc.step == -1:
        lw.integer_start(lc.context)
    lw.dump(lc.context, out, "resized")
    for k in mine:
        if k != first:
            if hows[k - 1] == "kill":
                result["failed_steps"].append([until[k - 1] + 1, _half_step(lc.context, until[k - 1] + 1, False)])
            ev = lc.on_membership_change(Topology.from_env({**os.environ, **env_of(k)}))
            result["events"].append(ev.model_dump())
            lw.dump(lc.context, out, "resized")
        for step in range(lc.next_step, until[k] + 1):
            lw.train_step(lc.context, step)
            lc.commit(step)
        lc.wait_commit()  # the phase's last commit is complete before its transition (a drain waits; the kills come later)
        lw.dump(lc.context, out, "trained")
    result["step"] = lc.step
    if last < len(phases) - 1:  # this process leaves after phase ``last``
        how = hows[last]
        victim = how in ("kill", "term") or node_of(me) not in {node_of(p) for p in phases[last + 1]}
        result["left"] = how
        if how == "term":
            with open(os.path.join(out, f"result-{me}.json"), "w") as f:
                json.dump(result, f)
            # The handler is in place before the hub is told, so the SIGTERM cannot come first.
            term = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: term.set())
            _flag(out, f"ready-{me}")
            # Poll rather than one long Event.wait: in one run with a single 60 s wait the
            # leaver did not see the hub's SIGTERM before the wait timed out (not reproduced
            # in a minimal script; polling bounds the delay either way).
            deadline = time.monotonic() + 60
            while not term.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
            os._exit(0 if term.is_set() else 4)
        if victim:  # SIGKILLed by the hub in the middle of the next step
            with open(os.path.join(out, f"result-{me}.json"), "w") as f:
                json.dump(result, f)
            _half_step(lc.context, until[last] + 1, True)
            _flag(out, f"ready-{me}")
            time.sleep(60)
            os._exit(5)  # never reached when the hub's SIGKILL arrives
        # restart-kill, a node that stays: the step in flight fails, and the process ends as a
        # torchrun worker whose collective failed does; the agent starts a new one (next phase).
        result["failed_steps"].append([until[last] + 1, _half_step(lc.context, until[last] + 1, False)])
    lc.close()
    with open(os.path.join(out, f"result-{me}.json"), "w") as f:
        json.dump(result, f)


def hub() -> None:
    spec = json.loads(os.environ["EP8_SPEC"])
    out = spec["out"]
    phases = spec["phases"]
    everyone = list(dict.fromkeys(p for layout in phases for p in layout))
    children: dict[int, str] = {}
    for me in everyone:
        pid = os.fork()
        if pid == 0:  # the child: one rank, its own process from here on
            log = os.open(os.path.join(out, f"log-{me}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            code = 0
            try:
                rank_main(spec, me)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = me
    # Faults: leavers flag that they are ready to go; the hub sends the transition's signal.
    leavers = {}
    for k, layout in enumerate(phases[:-1]):
        nodes_next = {node_of(p) for p in phases[k + 1]}
        for p in layout:
            how = spec["how"][k]
            if how in ("kill", "term") and p not in phases[k + 1]:
                leavers[p] = how
            elif how == "restart-kill" and node_of(p) not in nodes_next:
                leavers[p] = "kill"
    status: dict[str, int] = {}
    signalled: set[str] = set()
    pid_of = {v: k for k, v in children.items()}
    deadline = time.monotonic() + DEADLINE_S
    while len(status) < len(children) and time.monotonic() < deadline:
        for me, how in leavers.items():
            if me not in signalled and os.path.exists(os.path.join(out, f"ready-{me}")):
                os.kill(pid_of[me], signal.SIGKILL if how == "kill" else signal.SIGTERM)
                signalled.add(me)
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid:
            me = children[pid]
            status[me] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
            last = max(k for k, layout in enumerate(phases) if me in layout)
            _flag(out, f"gone-g{last}-{me}")  # a restarted phase starts once the old one is gone
        else:
            time.sleep(0.02)
    for pid, me in children.items():  # bounded: whatever is still running is killed and reported
        if me not in status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status[me] = "timeout"
    print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    hub()
