"""A worker process for the lifecycle and state tests: one rank of a real gloo world.

Run as ``python -c "from tests.helpers import lifecycle_worker; lifecycle_worker.main()"`` with the rank's torchrun
environment plus ``LCW_SPEC`` (JSON, see :func:`main`). It starts a :class:`Lifecycle`, trains
with integer-valued data, commits every step, optionally goes through a membership change, and
dumps its shard after every phase (``<out>/<phase>-g<generation>-r<rank>.pt``) for the test to
compare bit for bit against a reference. Its last stdout line is JSON.

:class:`MiniContext` is the second, minimal context class that proves the context contract
(:class:`elastic_emb.protocol.ShardedContext`): a raw gloo process group of its own (not exposed,
so the state layer forms its own), plain tensors, and a ``reset`` that refuses other world sizes;
it records every call it gets.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.errors import ContextClosed, RestoreError, WorldSizeChanged
from elastic_emb.protocol import ContextBase, OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import owned_range
from elastic_emb.store import generation_store
from elastic_emb.topology import Topology


def int_init(num_rows_range, dim: int, dtype=torch.float32) -> torch.Tensor:
    """Integer-valued initial rows, the same for a row whatever the world size."""
    rows = torch.arange(num_rows_range.start, num_rows_range.stop, dtype=torch.int64)[:, None]
    cols = torch.arange(dim, dtype=torch.int64)[None, :]
    return ((rows * 31 + cols * 7) % 97 - 48).to(dtype)


class MiniContext(ContextBase):
    """A minimal ShardedContext in plain torch: float64 tensors, a private gloo group, strict
    reset, shard views. It passes the conformance suite (tests/test_conformance.py)."""

    def __init__(
        self, topology: Topology, store, *, tables, calls_file: str | None = None, timeout: float = 60.0
    ) -> None:
        self.topology = topology
        self.tables = {t.name: t for t in tables}
        self._store = store
        self._calls_file = calls_file
        self._timeout = timeout
        self._instance = 0
        self._closed = False
        self._healthy = True
        self._pg = self._form(topology, store)
        self._rows = {}
        for name, spec in self.tables.items():
            rr = owned_range(spec.num_rows, topology.ep_size, topology.rank)
            self._rows[name] = (rr, int_init(rr, spec.dim, torch.float64), torch.zeros(len(rr), dtype=torch.float64))
        self._record("construct", world_size=topology.world_size, rank=topology.rank)

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def _form(self, topology: Topology, store):
        self._instance += 1
        pg_store = dist.PrefixStore(f"mini{self._instance}/", generation_store(store, topology, "mini"))
        pg = dist.ProcessGroupGloo(pg_store, topology.rank, topology.world_size, timedelta(seconds=self._timeout))
        t = torch.ones(1)
        pg.allreduce([t]).wait()
        assert int(t.item()) == topology.world_size
        return pg

    def _record(self, what: str, **kw) -> None:
        if self._calls_file:
            with open(self._calls_file, "a") as f:
                f.write(json.dumps({"call": what, **kw}) + "\n")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosed(f"{what} on a closed MiniContext")

    def reset(self, rank: int, world_size: int, *, topology: Topology, store) -> None:
        self._check_open("reset")
        self._record("reset", rank=rank, world_size=world_size, built_for=self.topology.world_size)
        if world_size != self.topology.world_size:
            raise WorldSizeChanged(self.topology.world_size, world_size)
        if (topology.ep_size, topology.backend) != (self.topology.ep_size, self.topology.backend):
            raise ValueError("MiniContext.reset: ep_size and backend must stay; construct a new context")
        if rank != self.topology.rank or topology.rank != rank:
            raise ValueError("MiniContext.reset keeps ranks (the tests re-form with the same mapping)")
        self._pg = self._form(topology, store)
        self.topology, self._store, self._healthy = topology, store, True

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        if not self._closed:
            self._record("close", world_size=self.topology.world_size)
            self._closed = True
            pg, self._pg = self._pg, None
            pg.abort()  # gloo: closes this rank's connections; no peer waits on a destroy

    def export_shard(self) -> dict[str, ShardData]:
        self._check_open("export_shard")
        return {n: ShardData(n, rr, w.clone(), {"accumulator": a.clone()}) for n, (rr, w, a) in self._rows.items()}

    def shard_views(self) -> dict[str, ShardData]:
        """This rank's shards as the context's own tensors (restore fills them in place,
        skipping a copy and import_shard)."""
        self._check_open("shard_views")
        return {n: ShardData(n, rr, w, {"accumulator": a}) for n, (rr, w, a) in self._rows.items()}

    def import_shard(self, shards) -> None:
        self._check_open("import_shard")
        if set(shards) != set(self._rows):
            raise ValueError(f"import_shard: tables {sorted(shards)} != {sorted(self._rows)}")
        for n, s in shards.items():
            rr, w, a = self._rows[n]
            if s.rows != rr or s.weight.shape != w.shape or set(s.slots) != {"accumulator"}:
                raise ValueError(
                    f"import_shard: table {n!r} shard rows {s.rows} (shape {tuple(s.weight.shape)}) "
                    f"!= owned {rr} (shape {tuple(w.shape)})"
                )
        for n, s in shards.items():
            rr, w, a = self._rows[n]
            w.copy_(s.weight)
            a.copy_(s.slots["accumulator"])

    def allreduce(self) -> None:
        """One collective over the context's group; a failure marks the context unhealthy."""
        self._check_open("allreduce")
        t = torch.ones(1)
        try:
            self._pg.allreduce([t]).wait()
        except Exception:
            self._healthy = False
            raise

    def train_step(self, step: int) -> None:
        for _n, (rr, w, a) in self._rows.items():
            rows = torch.arange(rr.start, rr.stop, dtype=torch.int64)
            w += ((rows + step) % 5 - 2).to(torch.float64)[:, None]
            a += 1
        self.allreduce()  # every rank steps together


# ---------------------------------------------------------------------------------------------


def global_batch(step: int, num_rows: int, size: int = 64):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, num_rows, (size,), generator=g)
    return ids, ((ids + step) % 7 - 3).to(torch.float32)


def train_step(ctx, step: int) -> None:
    """One step. EmbContext: the global batch split over ranks, lookup + gradient. Mini: local."""
    if isinstance(ctx, MiniContext):
        ctx.train_step(step)
        return
    t = ctx.topology
    dev = getattr(ctx, "device", torch.device("cpu"))
    for name, spec in ctx.tables.items():
        ids, g = global_batch(step, spec.num_rows)
        mine = ids[t.rank :: t.world_size].to(dev)
        ctx.lookup(name, mine).wait(timeout=60)
        grads = g[t.rank :: t.world_size][:, None].expand(-1, spec.dim).contiguous().to(dev)
        ctx.apply_gradients(name, mine, grads)


def integer_start(ctx) -> None:
    """First start: integer-valued rows and slots, identical whatever the world size."""
    shards = ctx.export_shard()
    for _name, s in shards.items():
        s.weight.copy_(int_init(s.rows, s.weight.shape[1], s.weight.dtype))
        for _k, v in s.slots.items():
            v.copy_(
                (torch.arange(s.rows.start, s.rows.stop) % 3)
                .to(v.dtype)
                .reshape(-1, *([1] * (v.dim() - 1)))
                .expand_as(v)
            )
    ctx.import_shard(shards)


def dump(ctx, out: str, phase: str) -> None:
    t = ctx.topology
    data = {
        n: (s.rows.start, s.rows.stop, s.weight.cpu(), {k: v.cpu() for k, v in s.slots.items()})
        for n, s in ctx.export_shard().items()
    }
    torch.save(data, os.path.join(out, f"{phase}-g{t.generation}-r{t.rank}.pt"))


def make_factory(spec: dict):
    tables = [TableSpec(**t) for t in spec["tables"]]
    if spec.get("context", "emb") == "mini":
        return functools.partial(MiniContext, tables=tables, calls_file=spec.get("calls_file"))
    from elastic_emb.context import EmbContext

    kind = spec.get("optimizer", "adagrad")
    opt = OptimizerSpec(kind="adagrad", lr=0.5) if kind == "adagrad" else OptimizerSpec(kind="sgd", lr=1.0)
    return functools.partial(EmbContext, tables=tables, optimizer=opt, timeout=60.0, staging_rows_per_rank=64)


def start_and_train(spec: dict, until: int, dump_as: str):
    """``Lifecycle.start`` from the environment with ``spec["config"]``, integer rows, steps 0 to
    ``until`` trained and committed, this rank's rows then dumped as ``dump_as``. Returns the
    lifecycle."""
    from elastic_emb import Lifecycle, LifecycleConfig

    lc = Lifecycle.start(make_factory(spec), LifecycleConfig(**spec["config"]))
    integer_start(lc.context)
    for step in range(until + 1):
        train_step(lc.context, step)
        lc.commit(step)
    dump(lc.context, spec["out"], dump_as)
    return lc


def new_env(overrides: dict) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def main() -> None:
    """LCW_SPEC keys: out, tables, context (emb|mini), config (LifecycleConfig fields),
    train_until (last step of phase 1), resize (null | {"env": overrides or null to depart}),
    then_until (last step after the resize), reform (null | env overrides for a same-size
    re-form after the resize), interrupt_after (null | seconds: after phase 1, another thread
    calls ``lc.interrupt`` then while this one waits for the commit in flight)."""
    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.testing.faults import arm_from_env

    arm_from_env()  # ELASTIC_EMB_FAULT, when a test sets it
    spec = json.loads(os.environ["LCW_SPEC"])
    out = spec["out"]
    factory = make_factory(spec)
    config = LifecycleConfig(**spec.get("config", {}))
    result: dict = {"events": []}
    joiner = bool(spec.get("joiner"))
    if spec.get("wait_file"):  # a joiner starts once the running world finished its phase
        deadline = time.monotonic() + 60
        while not os.path.exists(spec["wait_file"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        lc = Lifecycle.start(factory, config)
    except RestoreError as exc:
        print(json.dumps({"error": "RestoreError", "message": str(exc), "missing": exc.missing}), flush=True)
        sys.exit(3)
    result["events"].append(lc.events[-1].model_dump())
    result["start_step"] = lc.step
    if lc.step == -1 and not isinstance(lc.context, MiniContext) and not spec.get("seeded_start"):
        integer_start(lc.context)
    dump(lc.context, out, "resized" if joiner else "start")
    for step in range(lc.next_step, spec.get("train_until", -1) + 1):
        train_step(lc.context, step)
        lc.commit(step)
    dump(lc.context, out, "final" if joiner else "phase1")
    if spec.get("interrupt_after") is not None:  # another thread learns that a peer is gone
        timer = threading.Timer(float(spec["interrupt_after"]), lc.interrupt, ["the test's peer is gone"])
        timer.start()
        t0 = time.monotonic()
        try:
            lc.wait_commit()
            result["interrupted"] = {"error": None, "seconds": time.monotonic() - t0}
        except Exception as exc:
            result["interrupted"] = {
                "error": type(exc).__name__,
                "message": str(exc)[:300],
                "seconds": time.monotonic() - t0,
                "committed": lc.committed_step,
            }
        timer.join()
    resize = spec.get("resize")
    if resize is not None:
        if resize.get("env") is None:  # this process leaves the job
            result["departed"] = True
            lc.wait_commit()  # a leaver drains first: its last commit is complete before it goes
            print(json.dumps(result), flush=True)
            os._exit(0)  # like a node going away: no clean-up, no goodbye
        topo = Topology.from_env(new_env(resize["env"]))
        ev = lc.on_membership_change(topo, abort=bool(resize.get("abort")))
        result["events"].append(ev.model_dump())
        dump(lc.context, out, "resized")
        for step in range(lc.next_step, spec.get("then_until", -1) + 1):
            train_step(lc.context, step)
            lc.commit(step)
        if spec.get("reform"):
            ev = lc.on_membership_change(Topology.from_env(new_env(spec["reform"])))
            result["events"].append(ev.model_dump())
        dump(lc.context, out, "final")
    result["step"] = lc.step
    lc.wait_commit()  # the commit in flight completes, so committed_step is the cadence's last
    result["committed"] = lc.committed_step
    lc.close()
    print(json.dumps(result), flush=True)


CODE = "from tests.helpers import lifecycle_worker; lifecycle_worker.main()"

if __name__ == "__main__":
    main()
