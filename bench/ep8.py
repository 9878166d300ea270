"""Eight simulated ranks on the CPU (issue 9): live reshard 8 -> 4 and 4 -> 8, context destroy +
reconstruct at world 8, topology agreement at world 8.

The 8-GPU machine was not lent, so this is the CPU simulation with gloo: one hub process
imports torch once and forks eight rank processes (4 simulated nodes x 2 ranks, each node its own
``ELASTIC_EMB_NODE_ID`` and state directory under ``--state-dir``), all on one real TCPStore.
Per run, in the same processes:

* ``agree``: :func:`elastic_emb.topology.agree` of a fresh world-8 generation (slowest rank);
* ``rebuild``: ``close()`` of a world-8 EmbContext + construction of the next generation's
  (``seed=None``: a restore overwrites the rows anyway), slowest rank;
* ``shrink`` 8 -> 4: the Lifecycle's in-process resize (``on_membership_change``) on the four
  ranks of nodes A and C after nodes B and D left following a commit: the survivors' rows move
  live, B's and D's come from the replicas A and C hold (read from ``--state-dir``, CRC-checked);
* ``grow`` 4 -> 8: the survivors' resize to world 8 with B and D back (``Lifecycle.start`` in the
  returning processes): every row moves live.
* ``a2a``: the baseline, a plain gloo ``alltoall_base`` at world 8 in which each rank sends as
  many bytes as it holds (split evenly over its peers): the transport's own speed here.

Reshard throughput per rank = bytes the restore moved (all ranks) / ranks of the new world /
the slowest rank's seconds; ``restore`` covers inventory, plan, file reads and the exchange,
``transfer`` the row exchange alone. Every restore is checked: each row and slot holds its global
row index. Medians over ``--runs``; ratios against the all-to-all baseline of the same run set.

  python bench/ep8.py --mb 256 --runs 5          # writes out/ep8.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

from elastic_emb.testing.ports import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, as a script or as -m bench.*
from _report import write_json  # noqa: E402

LAYOUT = ["A0", "A1", "B0", "B1", "C0", "C1", "D0", "D1"]
SURVIVORS = ["A0", "A1", "C0", "C1"]
DIM = 64


def _env(layout: list[str], me: str, port: int, gen: int, run_id: str) -> dict:
    nodes = list(dict.fromkeys(p[0] for p in layout))
    rank = layout.index(me)
    members = [r for r, p in enumerate(layout) if p[0] == me[0]]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(layout)),
        "LOCAL_RANK": str(members.index(rank)),
        "LOCAL_WORLD_SIZE": str(len(members)),
        "GROUP_RANK": str(nodes.index(me[0])),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        "ELASTIC_EMB_GENERATION": str(gen),
        "MASTER_PORT": str(port),
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RUN_ID": run_id,
        "ELASTIC_EMB_BACKEND": "gloo",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _wait_files(pattern_dir: str, prefix: str, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for f in os.listdir(pattern_dir) if f.startswith(prefix)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {count} files {prefix}* in {pattern_dir}")
        time.sleep(0.005)


def _flag(d: str, name: str) -> None:
    open(os.path.join(d, name), "w").close()


def _check_rows(ctx, what: str) -> None:
    """Every row and slot holds its global row index (set at the start, never trained)."""
    import torch

    for name, s in ctx.shard_views().items():
        want = torch.arange(s.rows.start, s.rows.stop, dtype=s.weight.dtype)
        if not (
            torch.equal(s.weight[:, 0], want)
            and torch.equal(s.weight[:, -1], want)
            and all(torch.equal(v.reshape(len(want), -1)[:, 0], want) for v in s.slots.values())
        ):
            raise AssertionError(
                f"{what}: rows of {name} [{s.rows.start}, {s.rows.stop}) lost their values: "
                f"{s.weight[:3, :2].tolist()} {[v.reshape(len(want), -1)[:3, 0].tolist() for v in s.slots.values()]}"
            )


def rank_main(me: str, args, port: int, flags: str) -> dict:
    import torch

    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.context import EmbContext
    from elastic_emb.protocol import OptimizerSpec, TableSpec
    from elastic_emb.topology import Topology, agree

    torch.set_num_threads(1)
    rows = max(8, args.mb * 2**20 // (4 * (DIM + 1)))  # fp32 weight + adagrad accumulator per row
    tables = [TableSpec(name="t", num_rows=rows, dim=DIM)]
    opt = OptimizerSpec(kind="adagrad", lr=0.1)

    def factory(topology, store):
        return EmbContext(topology, store, tables=tables, optimizer=opt, seed=None, timeout=120.0)

    def lc_env(layout, gen):
        return {
            **os.environ,
            **_env(layout, me, port, gen, "ep8"),
            "ELASTIC_EMB_NODE_ID": me[0],
            "ELASTIC_EMB_STATE_DIR": os.path.join(args.state_dir, me[0]),
        }

    config = LifecycleConfig(replication=1, keep=1, transfer_timeout=300.0, agree_timeout=300.0)
    out: dict = {"agree": [], "rebuild": [], "a2a": [], "shrink": [], "grow": []}
    lc = Lifecycle.start(factory, config, env=lc_env(LAYOUT, 0))
    store = lc.store
    for s in lc.context.shard_views().values():  # row index everywhere: checkable after each move
        idx = torch.arange(s.rows.start, s.rows.stop, dtype=s.weight.dtype)
        s.weight.copy_(idx[:, None].expand_as(s.weight))
        for v in s.slots.values():
            v.copy_(idx.reshape(-1, *([1] * (v.dim() - 1))).expand_as(v))
    lc.context.mark_restored()  # written through shard_views: no lazy initial fill over them
    step = 0
    lc.commit(step)
    # A second world-8 context (own run id) for the destroy + reconstruct timing.
    rb_topo = lambda g: Topology.from_env(_env(LAYOUT, me, port, g, "ep8-rebuild"))  # noqa: E731
    ctx = factory(rb_topo(0), store)
    for run in range(args.runs):
        # agreement at world 8
        topo = Topology.from_env(_env(LAYOUT, me, port, run, "ep8-agree"))
        ctx.barrier()
        t0 = time.perf_counter()
        agree(topo, store, timeout=120.0)
        out["agree"].append(time.perf_counter() - t0)
        # destroy + reconstruct at world 8
        ctx.barrier()
        t0 = time.perf_counter()
        ctx.close()
        ctx = factory(rb_topo(run + 1), store)
        out["rebuild"].append(time.perf_counter() - t0)
        # baseline: each rank sends what it holds, split evenly over its 8 peers
        pg = lc.context.process_group
        held = rows * 4 * (DIM + 1) // 8  # an owner's share; the same number on every rank
        per = held // 8 // 4
        inp, outp = torch.ones(per * 8, dtype=torch.float32), torch.empty(per * 8, dtype=torch.float32)
        ctx.barrier()
        t0 = time.perf_counter()
        pg.alltoall_base(outp, inp, [per] * 8, [per] * 8).wait()
        out["a2a"].append([time.perf_counter() - t0, per * 8 * 4])
        # shrink 8 -> 4: B and D leave after the commit of ``step``
        g_shrink, g_grow = 1 + 2 * run, 2 + 2 * run
        if me in SURVIVORS:
            ev = lc.on_membership_change(Topology.from_env(lc_env(SURVIVORS, g_shrink)))
            _check_rows(lc.context, f"run {run} after 8 -> 4")
            out["shrink"].append(ev.model_dump())
            step += 1
            lc.commit(step)  # world 4 trains on; the grow then moves this commit's rows live
            _flag(flags, f"shrunk-{run}-{me}")
            ev = lc.on_membership_change(Topology.from_env(lc_env(LAYOUT, g_grow)))
        else:
            lc.close()  # leaves (its node directory keeps its snapshot)
            _wait_files(flags, f"shrunk-{run}-", len(SURVIVORS))
            step += 1
            lc = Lifecycle.start(factory, config, env=lc_env(LAYOUT, g_grow))
            ev = lc.events[-1]
        _check_rows(lc.context, f"run {run} after 4 -> 8")
        out["grow"].append(ev.model_dump())
        step += 1
        lc.commit(step)  # the next shrink's live and replica rows are at this commit
    ctx.close()
    lc.close()
    return out


def hub(args) -> dict:
    import torch  # noqa: F401  (imported once here; the forked ranks inherit it)

    import elastic_emb.context  # noqa: F401
    import elastic_emb.lifecycle.manager  # noqa: F401

    port = free_port()  # reserved until the hub exits: the forked rank 0 binds its TCPStore beside it
    flags = tempfile.mkdtemp(prefix="ep8_flags_")
    children = {}
    for me in LAYOUT:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                res = rank_main(me, args, port, flags)
                with open(os.path.join(flags, f"result-{me}.json"), "w") as f:
                    json.dump(res, f)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = me
    deadline = time.monotonic() + args.timeout
    status = {}
    while len(status) < len(children) and time.monotonic() < deadline:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid:
            status[children[pid]] = st
        else:
            time.sleep(0.05)
    for pid, me in children.items():
        if me not in status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status[me] = "timeout"
    bad = {m: s for m, s in status.items() if s != 0}
    if bad:
        raise SystemExit(f"ranks failed: {bad} (their tracebacks are above); --timeout={args.timeout}")
    res = {me: json.load(open(os.path.join(flags, f"result-{me}.json"))) for me in LAYOUT}
    shutil.rmtree(flags, ignore_errors=True)
    return res


def summarize(res: dict, args) -> dict:
    runs = args.runs
    med = statistics.median

    def slowest(key):
        return [max(res[m][key][i] for m in LAYOUT) for i in range(runs)]

    def resize(key, ranks):
        evs = [[res[m][key][i] for m in ranks] for i in range(runs)]
        n = len(ranks)
        restore = [max(e["restore_s"] for e in run) for run in evs]
        transfer = [max(e["transfer_s"] for e in run) for run in evs]
        total = [max(e["total_s"] for e in run if e["kind"] == "rebuild") for run in evs]
        moved = [sum(e["bytes_moved"] for e in run) for run in evs]
        tiers = sorted({t for run in evs for e in run for t in e["source_tiers"]})
        return {
            "restore_s": med(restore),
            "transfer_s": med(transfer),
            "resize_total_s": med(total),
            "bytes_moved": med(moved),
            "tiers": tiers,
            "gbps_per_rank": med(b / n / r / 1e9 for b, r in zip(moved, restore)),
            "transfer_gbps_per_rank": med(b / n / t / 1e9 for b, t in zip(moved, transfer)),
            "phases_s": {
                k: med(max(e[k] for e in run if e["kind"] == "rebuild") for run in evs)
                for k in ("teardown_s", "agreement_s", "construct_s", "restore_s")
            },
        }

    a2a = [max(res[m]["a2a"][i][0] for m in LAYOUT) for i in range(runs)]
    a2a_bytes = res[LAYOUT[0]]["a2a"][0][1]
    base = a2a_bytes / med(a2a) / 1e9
    shrink, grow = resize("shrink", SURVIVORS), resize("grow", LAYOUT)
    for r in (shrink, grow):
        r["vs_alltoall"] = r["gbps_per_rank"] / base
    return {
        "world": 8,
        "nodes": 4,
        "procs_per_node": 2,
        "backend": "gloo",
        "device": "cpu",
        "table_mb": args.mb,
        "runs": runs,
        "agree_s": med(slowest("agree")),
        "rebuild_s": med(slowest("rebuild")),
        "alltoall_gbps_per_rank": base,
        "alltoall_bytes_per_rank": a2a_bytes,
        "shrink_8_to_4": shrink,
        "grow_4_to_8": grow,
        "raw": {"agree_s": slowest("agree"), "rebuild_s": slowest("rebuild"), "a2a_s": a2a},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="table size in MB (weights + adagrad slot, all ranks)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--state-dir", default=None, help="node directories (default: a temp dir in /dev/shm)")
    ap.add_argument("--json", default="out/ep8.json")
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit for the whole benchmark, seconds")
    args = ap.parse_args()
    if args.runs < 1 or args.mb < 1:
        ap.error(f"--runs={args.runs} and --mb={args.mb} must be >= 1")
    own_dir = args.state_dir is None
    if own_dir:
        args.state_dir = tempfile.mkdtemp(prefix="ep8_state_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ.setdefault("ELASTIC_EMB_LOG_LEVEL", "warning")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        res = hub(args)
    finally:
        if own_dir:
            shutil.rmtree(args.state_dir, ignore_errors=True)
    s = summarize(res, args)
    write_json(args.json, "ep8", s)
    print(f"\n8 simulated ranks (4 nodes x 2, gloo, CPU), table {args.mb} MB, median of {args.runs} runs\n")
    print(f"{'measure':44} {'value':>12}")
    print(f"{'topology agreement, world 8':44} {s['agree_s'] * 1e3:>10.2f} ms")
    print(f"{'context destroy + reconstruct, world 8':44} {s['rebuild_s'] * 1e3:>10.2f} ms")
    print(f"{'baseline gloo all-to-all, per rank':44} {s['alltoall_gbps_per_rank']:>8.3f} GB/s")
    for name, r in (("8 -> 4", s["shrink_8_to_4"]), ("4 -> 8", s["grow_4_to_8"])):
        print(
            f"{'reshard ' + name + ' per rank (restore)':44} {r['gbps_per_rank']:>8.3f} GB/s"
            f"  ({r['vs_alltoall']:.2f}x all-to-all; tiers {','.join(r['tiers'])})"
        )
        print(f"{'reshard ' + name + ' per rank (transfer)':44} {r['transfer_gbps_per_rank']:>8.3f} GB/s")
        print(
            f"{'resize ' + name + ' total (slowest survivor)':44} {r['resize_total_s'] * 1e3:>10.1f} ms"
            f"  (teardown {r['phases_s']['teardown_s'] * 1e3:.1f}, agree {r['phases_s']['agreement_s'] * 1e3:.1f},"
            f" construct {r['phases_s']['construct_s'] * 1e3:.1f}, restore {r['phases_s']['restore_s'] * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
