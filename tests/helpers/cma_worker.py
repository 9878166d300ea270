"""A worker process for test_cma.py: one rank of a real gloo world that restores live rows.

Run as ``python -c "from tests.helpers import cma_worker; cma_worker.main()"`` with the rank's torchrun environment
(``ELASTIC_EMB_EP_SIZE`` sets the new layout's owners) and ``CMAW_SPEC`` (JSON):

* ``old``: ranks of the old layout; old shard i holds rows ``owned_range(n, old, i)`` of every table;
* ``holders``: {old shard: rank of the new world holding it in memory} (shards not listed: rank i);
* ``sabotage``: optional ``[mode, rank]``: on that rank, ``"token"`` publishes a wrong probe token, ``"forge"`` an offer naming a process outside the job,
  (readers must refuse it before reading rows), ``"addr"`` publishes unmapped row addresses (the
  probe passes, the pull fails with EFAULT).

Every tensor holds a value computed from (table, tensor, global row, column), so the receiver
checks every byte it got. Sources and destinations mix layouts on purpose: the ``step`` slot is a
strided column of a wider buffer on both sides (not contiguous). The last stdout line is JSON.
"""

from __future__ import annotations

import json
import os

import torch

from elastic_emb.protocol import ContextBase, ShardData
from elastic_emb.sharding import owned_range
from elastic_emb.topology import Topology

TABLES = {"items": (203, 4), "users": (61, 3)}  # name -> (rows, dim)


def value(table: str, tname: str, rows: range, dim: int) -> torch.Tensor:
    """The exact content of rows ``rows`` of one tensor (float64 math, cast per tensor)."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.float64)[:, None]
    c = torch.arange(max(dim, 1), dtype=torch.float64)[None, :]
    base = 1000.0 * (list(TABLES).index(table) + 1)
    if tname == "weight":
        return (base + r + c / 8).float()
    if tname == "sum":
        return (-(base + 7 * r + c)).float()
    return (base + r / 4 + 1e-3)[:, 0]  # "step": float64, one per row


class Holder:
    """Row storage of one layout: weight [n, dim] f32, slot ``sum`` [n, dim] f32 (items only)
    and slot ``step`` f64 as column 0 of an [n, 2] buffer (a strided, non-contiguous view)."""

    def __init__(self, table: str, rows: range, fill: float | None):
        n, dim = len(rows), TABLES[table][1]
        self.table, self.rows = table, rows
        self.weight = torch.full((n, dim), -7.0) if fill is not None else value(table, "weight", rows, dim)
        self.slots = {}
        if table == "items":
            self.slots["sum"] = torch.full((n, dim), -7.0) if fill is not None else value(table, "sum", rows, dim)
        buf = torch.full((n, 2), -7.0, dtype=torch.float64)
        if fill is None:
            buf[:, 0] = value(table, "step", rows, dim)
        self.slots["step"] = buf[:, 0]

    def shard(self) -> ShardData:
        return ShardData(self.table, self.rows, self.weight, dict(self.slots))


class Ctx(ContextBase):
    """A context filled in place (``shard_views``), as EmbContext is."""

    owner_ranks = None  # rows laid out over the topology's ep_size, as EmbContext does

    def __init__(self, topo: Topology):
        self.topology = topo
        self.holders = {
            t: Holder(t, owned_range(n, topo.ep_size, topo.rank), fill=-7.0) for t, (n, _) in TABLES.items()
        }

    def shard_views(self):
        return {t: h.shard() for t, h in self.holders.items()}

    def export_shard(self):
        return self.shard_views()

    def import_shard(self, shards):
        raise AssertionError("in place: import_shard is not used")


def sabotage(mode: str, comm) -> None:
    from elastic_emb.state import cma

    if mode == "token":
        real = cma.identity

        def wrong():
            me = real()
            addr, tok = me["token"]
            me["token"] = [addr, "00" * 16 if tok != "00" * 16 else "11" * 16]
            return me

        cma.identity = wrong
    elif mode == "addr":
        real_exchange = comm.exchange

        def exchange(name, obj):
            if name == "cma-offer":
                obj = {**obj, "rows": {k: [[4096, n] for _, n in spans] for k, spans in obj["rows"].items()}}
            return real_exchange(name, obj)

        comm.exchange = exchange
    elif mode == "forge":
        # Start a process outside the job holding a known pattern; publish an offer that names it,
        # with a token and row addresses inside that pattern (what a store writer could do).
        import atexit
        import subprocess
        import sys

        victim = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import ctypes, sys, time; b = ctypes.create_string_buffer(b'Z' * (8 << 20)); "
                "print(ctypes.addressof(b), flush=True); time.sleep(120)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        atexit.register(victim.kill)
        addr = int(victim.stdout.readline())
        real_exchange = comm.exchange

        def exchange(name, obj):
            if name == "cma-offer":
                ident = {**obj["id"], "pid": victim.pid, "token": [addr, ("5a" * 16)]}
                obj = {"id": ident, "rows": {k: [[addr, n] for _, n in spans] for k, spans in obj["rows"].items()}}
            return real_exchange(name, obj)

        comm.exchange = exchange
    else:
        raise SystemExit(f"unknown sabotage {mode!r}")


def main() -> None:
    from elastic_emb.state import Comm, restore
    from elastic_emb.store import worker_store

    spec = json.loads(os.environ["CMAW_SPEC"])
    topo = Topology.from_env()
    store = worker_store(topo, timeout=60)
    comm = Comm(topo, store, None, timeout=60)
    if spec.get("sabotage") and spec["sabotage"][1] == topo.rank:
        sabotage(spec["sabotage"][0], comm)
    holders = {int(k): v for k, v in spec.get("holders", {}).items()}
    live = []
    for i in range(spec["old"]):
        if holders.get(i, i) == topo.rank:
            for t, (n, _) in TABLES.items():
                rows = owned_range(n, spec["old"], i)
                if len(rows):
                    live.append(Holder(t, rows, fill=None).shard())
    ctx = Ctx(topo)
    rep = restore(ctx, comm, snapshot=None, durable=None, live=live, live_commit=(5, 0, "fp"))
    bad = []
    for t, h in ctx.holders.items():
        dim = TABLES[t][1]
        for tname, got in [("weight", h.weight), *h.slots.items()]:
            want = value(t, tname, h.rows, dim)
            if not torch.equal(got, want):
                rows = (got != want).reshape(len(h.rows), -1).any(dim=1).nonzero().flatten()
                bad.append([t, tname, [h.rows.start + int(r) for r in rows[:5]]])
    comm.close()
    print(
        json.dumps(
            {
                "rank": topo.rank,
                "transport": rep.transport,
                "bad": bad,
                "step": rep.step,
                "bytes_moved": rep.bytes_moved,
                "rows": {t: [h.rows.start, h.rows.stop] for t, h in ctx.holders.items()},
            }
        )
    )
