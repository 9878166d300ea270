"""One rank of the EmbContext multi-process tests (tests/test_context.py, tests/test_context_nccl.py).

Started once per rank with torchrun's environment (elastic_emb/testing/procs.py) and a JSON config in
``CTX_TEST_CFG``: ``{"dir": shared tmp dir, "load_from": world size whose DCP checkpoint to load
or null, "shrink_to": world size to re-construct at or null, "tag": name of this run}``.

Every rank computes the single-process reference itself: batches are drawn from a generator
seeded by (step, rank), so each rank knows every rank's ids and gradients, replays them on a whole
``torch.nn.Embedding`` (SGD) or a dense row-wise Adagrad, and compares with what the sharded
context returns. Data are small integers and learning rates powers of two, so every comparison
is exact (``torch.equal``). The last stdout line is a JSON dict ``check -> {"ok": bool, ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_emb.context import EmbContext, InvalidIds, PeerLookupError
from elastic_emb.context.exchange import OP_LOOKUP, call_tag
from elastic_emb.errors import ContextClosed, WorldSizeChanged
from elastic_emb.protocol import OptimizerSpec, ShardData, TableSpec
from elastic_emb.sharding import RowRange, owned_range, reshard_plan
from elastic_emb.store import generation_store, worker_store
from elastic_emb.topology import Topology

CFG = json.loads(os.environ.get("CTX_TEST_CFG", "{}"))
TABLES = [TableSpec(name="big", num_rows=37, dim=4), TableSpec(name="tiny", num_rows=5, dim=2)]
SGD = OptimizerSpec(kind="sgd", lr=1.0)
ADAGRAD = OptimizerSpec(kind="adagrad", lr=0.5, eps=1e-10, initial_accumulator=1.0)
STEPS = 3
TIMEOUT = 20.0

results: dict[str, dict] = {}


def check(name):
    def deco(fn):
        def run(*a, **kw):
            t0 = time.monotonic()
            try:
                detail = fn(*a, **kw) or {}
                results[name] = {"ok": True, **detail}
            except Exception as exc:  # recorded, and reported by the test with the traceback
                results[name] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "tb": traceback.format_exc()[-2500:],
                }
            results[name]["seconds"] = round(time.monotonic() - t0, 3)

        return run

    return deco


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def initial_table(spec: TableSpec) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + spec.num_rows)
    return torch.randint(-8, 9, (spec.num_rows, spec.dim), generator=g).to(spec.torch_dtype)


def batch(spec: TableSpec, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven sizes per rank (0 included), many duplicates."""
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + spec.num_rows)
    size = [0, 1, 9, 23, 4][(rank + step) % 5]
    high = spec.num_rows if step % 2 == 0 else min(spec.num_rows, 6)
    ids = torch.randint(0, high, (size,), generator=g)
    grads = torch.randint(-3, 4, (size, spec.dim), generator=g).to(spec.torch_dtype)
    return ids, grads


class Reference:
    """The whole tables in one process: nn.Embedding + torch.optim.SGD, or dense row-wise Adagrad."""

    def __init__(self, opt: OptimizerSpec):
        self.opt = opt
        self.emb = {
            s.name: torch.nn.Embedding.from_pretrained(initial_table(s), freeze=False, sparse=True) for s in TABLES
        }
        self.acc = {s.name: torch.full((s.num_rows,), opt.initial_accumulator) for s in TABLES}
        if opt.kind == "sgd":
            self.sgd = torch.optim.SGD([e.weight for e in self.emb.values()], lr=opt.lr)

    def weight(self, table: str) -> torch.Tensor:
        return self.emb[table].weight.detach()

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[table](ids).detach()

    def step(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        if self.opt.kind == "sgd":
            self.sgd.zero_grad()
            (self.emb[table](ids) * grads).sum().backward()
            self.sgd.step()
            return
        w, acc = self.emb[table].weight.data, self.acc[table]
        g = torch.zeros_like(w).index_add_(0, ids, grads)
        rows = torch.unique(ids)
        acc[rows] += g[rows].pow(2).mean(dim=1)
        w[rows] -= self.opt.lr * g[rows] / (acc[rows].sqrt() + self.opt.eps).unsqueeze(1)


def import_full(ctx: EmbContext, full: dict[str, torch.Tensor], acc: dict[str, torch.Tensor] | None = None) -> None:
    shards = {}
    for name in ctx.tables:
        r = ctx.owned(name)
        slots = {}
        if ctx.optimizer.kind == "adagrad":
            slots["accumulator"] = (
                acc[name] if acc else torch.full((ctx.tables[name].num_rows,), ctx.optimizer.initial_accumulator)
            )[r.start : r.stop].to(ctx.device)
        shards[name] = ShardData(name, r, full[name][r.start : r.stop].to(ctx.device), slots)
    ctx.import_shard(shards)


def all_rows(ctx: EmbContext, table: str) -> torch.Tensor:
    n = ctx.tables[table].num_rows
    return ctx.lookup(table, torch.arange(n)).wait().cpu()


def train_and_compare(ctx: EmbContext, ref: Reference, t: Topology, label: str) -> dict:
    world, rank = t.world_size, t.rank
    mismatches = []
    for step in range(STEPS):
        # Two lookups in flight at once, waited in reverse order (the second gets its own staging).
        handles = {}
        for spec in TABLES:
            ids, _ = batch(spec, step, rank, world)
            handles[spec.name] = (ids, ctx.lookup(spec.name, ids))
        for spec in reversed(TABLES):
            ids, h = handles[spec.name]
            got = h.wait().cpu()
            if got.shape != (len(ids), spec.dim) or not torch.equal(got, ref.lookup(spec.name, ids)):
                mismatches.append(f"{label} step {step} lookup {spec.name}")
        for spec in TABLES:
            ids, grads = batch(spec, step, rank, world)
            ctx.apply_gradients(spec.name, ids.to(ctx.device), grads.to(ctx.device))
            every = [batch(spec, step, r, world) for r in range(world)]
            ref.step(spec.name, torch.cat([e[0] for e in every]), torch.cat([e[1] for e in every]))
    for spec in TABLES:
        if not torch.equal(all_rows(ctx, spec.name), ref.weight(spec.name)):
            mismatches.append(f"{label} final table {spec.name}")
        shard = ctx.export_shard()[spec.name]
        r = owned_range(spec.num_rows, t.ep_size, t.rank)
        if shard.rows != r or not torch.equal(shard.weight.cpu(), ref.weight(spec.name)[r.start : r.stop]):
            mismatches.append(f"{label} exported shard {spec.name}")
        if ctx.optimizer.kind == "adagrad" and not torch.equal(
            shard.slots["accumulator"].cpu(), ref.acc[spec.name][r.start : r.stop]
        ):
            mismatches.append(f"{label} accumulator {spec.name}")
    expect(not mismatches, f"mismatches: {mismatches}")
    return {}


def main() -> None:
    t = Topology.from_env()
    store = worker_store(t, timeout=60)
    device = None
    if t.backend == "nccl":
        torch.cuda.set_device(t.local_rank)
    world, rank = t.world_size, t.rank

    def make(opt, topo=t, **kw):
        return EmbContext(topo, store, tables=TABLES, optimizer=opt, device=device, timeout=TIMEOUT, **kw)

    # Staging for 2 rows per peer: the lookups below must grow it (and stay exact). Lookups in 3
    # pipelined pieces (the NCCL default is 2; gloo's is 1, which the Adagrad context uses).
    ctx = make(SGD, staging_rows_per_rank=2, pipeline_chunks=3)
    results["arena"] = {"ok": ctx.arena_bytes > 0, **ctx.arena_report()}

    @check("sgd_matches_reference")
    def _sgd():
        import_full(ctx, {s.name: initial_table(s) for s in TABLES})
        return train_and_compare(ctx, ref_sgd, t, "sgd")

    ref_sgd = Reference(SGD)
    _sgd()

    @check("large_batches")
    def _large():
        # Batches long enough for the CUDA path to replay its dedup kernels from a graph (>= 16384
        # ids): several lookups of one size with different ids (replays must not mix them up),
        # two in flight at once, gradients, and an invalid id inside a long batch.
        # 64 columns: wide enough rows that the ids ride in the count exchange (Deduper.fusable)
        wide = TableSpec(name="wide", num_rows=100_003, dim=64)
        big = EmbContext(
            t, store, tables=[wide], optimizer=SGD, device=device, timeout=TIMEOUT, seed=None, pipeline_chunks=3
        )
        full = torch.arange(wide.num_rows * wide.dim, dtype=torch.float32).reshape(wide.num_rows, wide.dim) % 1021
        r = big.owned("wide")
        big.import_shard({"wide": ShardData("wide", r, full[r.start : r.stop].to(big.device))})
        n = 40_000

        def ids_of(seed: int, who: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * seed + who)
            hot = torch.randint(0, 50, (n // 4,), generator=g)  # heavy duplicates
            return torch.cat([torch.randint(0, wide.num_rows, (n - n // 4,), generator=g), hot])[
                torch.randperm(n, generator=g)
            ]

        for seed in range(3):
            ids = ids_of(seed, rank)
            got = big.lookup("wide", ids.to(big.device)).wait().cpu()
            expect(torch.equal(got, full[ids]), f"lookup {seed} of {n} ids differs from the table")
        a, b = ids_of(7, rank), ids_of(8, rank)
        ha, hb = big.lookup("wide", a.to(big.device)), big.lookup("wide", b.to(big.device))
        expect(
            torch.equal(hb.wait().cpu(), full[b]) and torch.equal(ha.wait().cpu(), full[a]),
            "two lookups in flight, waited in reverse order, differ from the table",
        )
        # A prefetching loop: lookup k+1 (same length, so the same dedup graph) starts before
        # lookup k is waited on; the device-side result is kept and compared at the end.
        batches = [ids_of(40 + i, rank) for i in range(6)]
        h, kept = big.lookup("wide", batches[0].to(big.device)), []
        for i in range(1, 6):
            nxt = big.lookup("wide", batches[i].to(big.device))
            kept.append(h.wait())
            h = nxt
        kept.append(h.wait())
        expect(
            all(torch.equal(r.cpu(), full[x]) for r, x in zip(kept, batches)),
            "a lookup started while another was in flight returned other rows",
        )
        for seed in (20, 21):
            ids = ids_of(seed, rank)
            big.apply_gradients("wide", ids.to(big.device), torch.ones(n, wide.dim, device=big.device))
            for who in range(world):
                full.index_add_(0, ids_of(seed, who), -torch.ones(n, wide.dim))  # SGD, lr 1: exact
        every = torch.arange(wide.num_rows)
        expect(torch.equal(big.lookup("wide", every.to(big.device)).wait().cpu(), full), "rows after gradients differ")
        # A lookup in flight returns the rows as they were at lookup(), even when gradients are
        # applied before it is waited on (its own rank's rows are read when the result is assembled).
        ids = ids_of(22, rank)
        then = full.clone()
        h = big.lookup("wide", ids.to(big.device))
        big.apply_gradients("wide", ids.to(big.device), torch.ones(n, wide.dim, device=big.device))
        for who in range(world):
            full.index_add_(0, ids_of(22, who), -torch.ones(n, wide.dim))
        expect(torch.equal(h.wait().cpu(), then[ids]), "a lookup in flight saw gradients applied after it")
        bad = ids_of(30, rank)
        culprit = world - 1
        if rank == culprit:
            bad[n // 3] = wide.num_rows + 5
        try:
            big.lookup("wide", bad.to(big.device)).wait()
            raise AssertionError("a long batch with an invalid id was accepted")
        except InvalidIds as exc:
            expect(rank == culprit and str(wide.num_rows + 5) in str(exc), str(exc))
        except PeerLookupError as exc:
            expect(rank != culprit and exc.ranks == [culprit], str(exc))
        ids = ids_of(31, rank)
        expect(
            torch.equal(big.lookup("wide", ids.to(big.device)).wait().cpu(), full[ids]),
            "unusable after an invalid batch",
        )
        # Per-rank batches of different lengths, in the large regime: every rank must still pick the
        # same exchange layout (a size mismatch aborts gloo and hangs NCCL). Lengths change from call
        # to call, grow past what earlier calls sized the layout for, and one rank passes none.
        for step, lengths in enumerate(
            [
                [40_000 - 997 * p for p in range(world)],
                [20_000 + 5_000 * p for p in range(world)],
                [60_000 if p == 0 else 17_000 for p in range(world)],
                [0 if p == world - 1 else 30_000 for p in range(world)],
                [45_000] * world,
            ]
        ):
            g = torch.Generator().manual_seed(500 + 10 * step + rank)
            ids = torch.randint(0, wide.num_rows, (lengths[rank],), generator=g)
            got = big.lookup("wide", ids.to(big.device)).wait().cpu()
            expect(torch.equal(got, full[ids]), f"lookup with per-rank lengths {lengths} differs from the table")
        # A rank that fails its host-side checks in a call the others make with a large batch:
        # its cancellation must use the layout they use.
        bad = torch.zeros(45_000, dtype=torch.float32) if rank == culprit else ids_of(32, rank)
        try:
            big.lookup("wide", bad.to(big.device)).wait()
            raise AssertionError("a float ids tensor was accepted")
        except InvalidIds as exc:
            expect(rank == culprit and "dtype" in str(exc), str(exc))
        except PeerLookupError as exc:
            expect(rank != culprit and exc.ranks == [culprit], str(exc))
        ids = ids_of(33, rank)
        expect(
            torch.equal(big.lookup("wide", ids.to(big.device)).wait().cpu(), full[ids]),
            "unusable after a cancelled batch",
        )
        if world > 1:
            # Ranks in different calls while the block carries ids: a clear error on every rank, no abort.
            from elastic_emb.context import CollectiveMismatch

            try:
                if rank == 0:
                    big.apply_gradients("wide", ids.to(big.device), torch.zeros(n, wide.dim, device=big.device))
                else:
                    big.lookup("wide", ids.to(big.device)).wait()
                raise AssertionError("ranks in different calls were not told so")
            except CollectiveMismatch as exc:
                expect("apply_gradients('wide')" in str(exc) and "lookup('wide')" in str(exc), str(exc))
            expect(
                torch.equal(big.lookup("wide", ids.to(big.device)).wait().cpu(), full[ids]), "unusable after a mismatch"
            )
        dd, block = big._dedup, big._exchange.block_bytes
        captured = len(dd.graphs)
        # the ids travelled with the counts (one exchange) in these lookups
        tag = call_tag(["wide"], OP_LOOKUP, "wide", 3)
        fused = dd.key_capacity(wide, 3, tag, block) >= 60_000 and dd.fused_lookups >= 5
        expect(fused or world == 1, f"the count exchange block ({block} bytes) cannot carry a 60000-id lookup")
        narrow = TableSpec(name="wide", num_rows=100_003, dim=4)  # 16-byte rows: padding would cost more than rows
        expect(
            not dd.want_bytes(narrow, n, 3, tag) and not dd.key_capacity(narrow, 3, tag, block),
            "narrow rows must not take the fused exchange",
        )
        big.close()
        return {"graphs": captured, "capture_failed": dd.capture_failed, "fused": fused, "block_bytes": block}

    _large()
    grown = ctx.arena_report()["staging_bytes"]
    results["staging_grown"] = {
        "ok": grown > results["arena"]["staging_bytes"],
        "before": results["arena"]["staging_bytes"],
        "after": grown,
    }

    @check("invalid_ids")
    def _invalid():
        bad_rank = world - 1
        seen = []
        t0 = time.monotonic()
        for what, culprit, ids in (
            ("lookup", bad_rank, torch.tensor([1, TABLES[0].num_rows])),
            ("apply_gradients", 0, torch.tensor([-2, 3])),
            ("lookup", 0, torch.tensor([[1, 2]])),
        ):
            mine = ids if rank == culprit else torch.tensor([0, 1])
            try:
                if what == "lookup":
                    ctx.lookup("big", mine).wait()
                else:
                    ctx.apply_gradients("big", mine, torch.zeros(mine.shape[0], 4, device=ctx.device))
                seen.append(("no error", what))
            except InvalidIds as exc:
                expect(rank == culprit, f"InvalidIds on rank {rank}, culprit {culprit}: {exc}")
                msg = str(exc)
                if ids.dim() == 1:
                    bad = int(ids[-1]) if int(ids[-1]) >= TABLES[0].num_rows else int(ids.min())
                    expect(str(bad) in msg and "out of range" in msg, f"message lacks the id {bad}: {msg}")
                else:
                    expect("1-D" in msg, msg)
                expect(isinstance(exc, IndexError), "InvalidIds must be an IndexError")
                seen.append(("invalid", what))
            except PeerLookupError as exc:
                expect(rank != culprit and exc.ranks == [culprit], f"PeerLookupError {exc.ranks} on rank {rank}")
                expect(str(culprit) in str(exc), str(exc))
                seen.append(("peer", what))
        elapsed = time.monotonic() - t0
        expect(elapsed < TIMEOUT / 2, f"invalid-id rounds took {elapsed:.1f}s: someone waited for a timeout")
        expect(all(k != "no error" for k, _ in seen), f"{seen}")
        # The context stays usable.
        expect(torch.equal(all_rows(ctx, "big"), ref_sgd.weight("big")), "table changed by cancelled calls")
        return {"seen": seen, "elapsed": elapsed}

    _invalid()

    @check("mismatched_calls")
    def _mismatch():
        from elastic_emb.context import CollectiveMismatch

        if world == 1:
            return {"skipped": "one rank cannot disagree with itself"}
        seen = []
        t0 = time.monotonic()
        # rank 0 names a table that does not exist: KeyError there, the others are told
        try:
            ctx.lookup("nope" if rank == 0 else "big", torch.tensor([0]))
            seen.append("no error")
        except KeyError as exc:
            expect(rank == 0 and "nope" in str(exc), f"KeyError on rank {rank}: {exc}")
            seen.append("keyerror")
        except PeerLookupError as exc:
            expect(rank != 0 and exc.ranks == [0], f"{exc.ranks}")
            seen.append("peer")
        # rank 0 looks up 'tiny' while the others look up 'big'; then rank 0 applies gradients
        for mine, other in ((("lookup", "tiny"), ("lookup", "big")), (("apply_gradients", "big"), ("lookup", "big"))):
            op, table = mine if rank == 0 else other
            try:
                if op == "lookup":
                    ctx.lookup(table, torch.tensor([0, 1])).wait()
                else:
                    ctx.apply_gradients(table, torch.tensor([0, 1]), torch.zeros(2, 4, device=ctx.device))
                seen.append("no error")
            except CollectiveMismatch as exc:
                expect(f"{mine[0]}({mine[1]!r})" in str(exc) or rank == 0, str(exc))
                seen.append("mismatch")
        expect(seen[1:] == ["mismatch", "mismatch"], f"{seen}")
        expect(seen[0] == ("keyerror" if rank == 0 else "peer"), f"{seen}")
        expect(time.monotonic() - t0 < TIMEOUT / 2, "mismatched calls waited for a timeout")
        expect(torch.equal(all_rows(ctx, "big"), ref_sgd.weight("big")), "table changed by refused calls")
        return {"seen": seen}

    _mismatch()

    @check("reset_rules")
    def _reset_rules():
        errs = {}
        for args in ((0, world + 1), (0, world - 1 if world > 1 else 2)):
            try:
                ctx.reset(*args)
                raise AssertionError(f"reset{args} did not raise")
            except WorldSizeChanged as exc:
                expect(isinstance(exc, ValueError), "WorldSizeChanged must be a ValueError")
                expect(f"world size changed from {world} to {args[1]}" in str(exc), str(exc))
                expect("construct a new context" in str(exc), str(exc))
                errs[str(args)] = str(exc)
        for args in ((-1, world), (world, world), (0, 0), (True, world)):
            try:
                ctx.reset(*args)
                raise AssertionError(f"reset{args} did not raise")
            except WorldSizeChanged:
                if args != (0, 0):
                    raise
            except ValueError as exc:
                errs[str(args)] = str(exc)
        if world >= 3:
            odd = Topology.model_construct(**{**t.model_dump(), "ep_size": 3})
            try:
                ctx.reset(rank, world, topology=odd)
                raise AssertionError("non-power-of-two ep_size accepted by reset")
            except ValueError as exc:
                expect("power of two" in str(exc), str(exc))
                errs["ep3"] = str(exc)
            try:
                make(SGD, topo=odd)
                raise AssertionError("non-power-of-two ep_size accepted by the constructor")
            except ValueError as exc:
                expect("power of two" in str(exc), str(exc))
        if t.ep_size > 1:
            other = t.with_changes(ep_size=t.ep_size // 2)
            try:
                ctx.reset(rank, world, topology=other)
                raise AssertionError("changed ep_size accepted by reset")
            except ValueError as exc:
                expect("ep_size changed" in str(exc), str(exc))
        expect(not ctx.closed and ctx.healthy, "a refused reset must leave the context as it was")
        return {"errors": errs}

    _reset_rules()

    @check("reset_same_world")
    def _reset_same():
        before = ctx.process_group
        ctx.reset(rank, world)
        expect(ctx.process_group is not before, "reset did not re-form the communicator")
        for s in TABLES:
            expect(torch.equal(all_rows(ctx, s.name), ref_sgd.weight(s.name)), f"rows changed by reset ({s.name})")
        return {}

    _reset_same()

    @check("reset_new_rank_mapping")
    def _reset_remap():
        new_rank = (rank + 1) % world
        ctx.reset(new_rank, world)
        expect(ctx.topology.rank == new_rank, "topology not updated")
        for s in TABLES:
            expect(torch.equal(all_rows(ctx, s.name), ref_sgd.weight(s.name)), f"rows lost by remap ({s.name})")
            shard = ctx.export_shard()[s.name]
            r = owned_range(s.num_rows, t.ep_size, new_rank)
            expect(
                shard.rows == r and torch.equal(shard.weight.cpu(), ref_sgd.weight(s.name)[r.start : r.stop]),
                f"shard of new rank {new_rank} wrong ({s.name})",
            )
        ctx.reset(rank, world)  # back, so the rest of the run keeps the launch ranks
        expect(torch.equal(all_rows(ctx, "big"), ref_sgd.weight("big")), "rows lost by remap back")
        return {}

    _reset_remap()

    @check("close_and_use_after_close")
    def _close():
        pending = ctx.lookup("big", torch.tensor([0, 1]))
        ctx.close()
        ctx.close()  # idempotent
        expect(ctx.closed and not ctx.healthy and ctx.arena_bytes == 0, "close did not release")
        refused = []
        for name, call in (
            ("lookup", lambda: ctx.lookup("big", torch.tensor([0]))),
            ("apply_gradients", lambda: ctx.apply_gradients("big", torch.tensor([0]), torch.zeros(1, 4))),
            ("reset", lambda: ctx.reset(rank, world)),
            ("export_shard", lambda: ctx.export_shard()),
            ("import_shard", lambda: ctx.import_shard({})),
            ("handle.wait", lambda: pending.wait()),
            ("barrier", lambda: ctx.barrier()),
        ):
            try:
                call()
                raise AssertionError(f"{name} after close did not raise")
            except ContextClosed:
                refused.append(name)
        with make(SGD) as c2:
            expect(not c2.closed, "context manager closed early")
            c2.barrier()
        expect(c2.closed, "context manager did not close")
        return {"refused": refused}

    _close()

    ref_ada = Reference(ADAGRAD)
    ada = make(ADAGRAD)

    @check("adagrad_matches_reference")
    def _ada():
        import_full(ada, {s.name: initial_table(s) for s in TABLES})
        return train_and_compare(ada, ref_ada, t, "adagrad")

    _ada()

    @check("nonfinite_and_changes")
    def _nonfinite_and_changes():
        from elastic_emb.errors import NonFiniteGradients

        spec = TABLES[0]
        mine = owned_range(spec.num_rows, t.ep_size, rank)
        for mode in ("raise", "skip"):
            c = make(SGD, nonfinite_gradients=mode)
            try:
                full = {s.name: initial_table(s) for s in TABLES}
                import_full(c, full)
                expect(c.take_changes()[spec.name].all(), "import_shard must mark every row")
                # Change tracking: the rows marked are exactly the owned rows some rank updated.
                for step in range(3):
                    every = [batch(spec, step, r, world) for r in range(world)]
                    c.apply_gradients(spec.name, every[rank][0], every[rank][1])
                    full[spec.name].index_add_(0, torch.cat([e[0] for e in every]), -torch.cat([e[1] for e in every]))
                    marked = set((c.take_changes()[spec.name].nonzero().squeeze(1) + mine.start).tolist())
                    written = {int(i) for e in every for i in e[0] if mine.start <= int(i) < mine.stop}
                    expect(marked == written, f"step {step}: marked rows {sorted(marked)} != written {sorted(written)}")
                    expect(not c.take_changes()[spec.name].any(), "take_changes did not start afresh")
                # Non-finite gradients: the last rank sends NaN for row 5 and inf for row 9.
                ids = torch.tensor([5, 9, 11, 5]) if rank == world - 1 else torch.tensor([11, 2])
                grads = torch.ones(len(ids), spec.dim)
                if rank == world - 1:
                    grads[0, 1], grads[1, 0] = float("nan"), float("inf")
                before = all_rows(c, spec.name)
                if mode == "raise":
                    try:
                        c.apply_gradients(spec.name, ids, grads)
                        raise AssertionError("NaN gradients were accepted")
                    except NonFiniteGradients as exc:
                        expect(exc.table == spec.name and exc.rows == 2 and "2 row(s)" in str(exc), str(exc))
                    expect(torch.equal(all_rows(c, spec.name), before), "a refused call changed rows")
                    expect(not c.take_changes()[spec.name].any(), "a refused call marked rows")
                else:
                    c.apply_gradients(spec.name, ids, grads)
                    for who in range(world):
                        if who == world - 1:
                            full[spec.name][11] -= 1  # rows 5 and 9 skipped on their owners, on every rank
                        else:
                            full[spec.name][torch.tensor([11, 2])] -= 1
                    expect(torch.equal(all_rows(c, spec.name), full[spec.name]), "skip mode updated the wrong rows")
                    marked = set((c.take_changes()[spec.name].nonzero().squeeze(1) + mine.start).tolist())
                    want = {i for i in ([11, 2] if world > 1 else [11]) if mine.start <= i < mine.stop}
                    expect(marked == want, f"skip mode marked {sorted(marked)}, wrote {sorted(want)}")
            finally:
                c.close()
        return {}

    _nonfinite_and_changes()

    if world >= 3:

        @check("non_power_of_two_ep_when_allowed")
        def _odd():
            odd = Topology.model_construct(**{**t.model_dump(), "ep_size": 3})
            c = make(SGD, topo=odd, require_power_of_two=False)
            try:
                import_full(c, {s.name: initial_table(s) for s in TABLES})
                return train_and_compare(c, Reference(SGD), odd, "ep3")
            finally:
                c.close()

        _odd()

    @check("init_rows_independent_of_world")
    def _init():
        c = make(SGD, seed=7)
        try:
            from elastic_emb.context import init_rows

            for s in TABLES:
                expect(
                    torch.equal(all_rows(c, s.name), init_rows(s, 7, RowRange(0, s.num_rows))),
                    f"initial rows of {s.name} differ from init_rows over the whole table",
                )
        finally:
            c.close()
        return {}

    _init()

    # -- DCP: save this world's final Adagrad state; load the previous run's at this world size --
    @check("dcp")
    def _dcp():
        import torch.distributed.checkpoint as dcp

        gstore = generation_store(store, t, "dcp_world")
        if t.backend == "nccl":
            dist.init_process_group(
                "cpu:gloo,cuda:nccl",
                store=gstore,
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=TIMEOUT),
                device_id=torch.device("cuda", t.local_rank),
            )
        else:
            dist.init_process_group(
                "gloo", store=gstore, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
            )
        try:
            out = {}
            path = os.path.join(CFG["dir"], f"dcp_{CFG['tag']}")
            dcp.save(ada.state_dict(), checkpoint_id=path)
            if rank == 0:
                torch.save(
                    {s.name: (ref_ada.weight(s.name).clone(), ref_ada.acc[s.name].clone()) for s in TABLES},
                    os.path.join(CFG["dir"], f"ref_{CFG['tag']}.pt"),
                )
            if CFG.get("load_from"):
                src = CFG["load_from"]
                expected = torch.load(os.path.join(CFG["dir"], f"ref_{src}.pt"))
                fresh = make(ADAGRAD, seed=None)
                try:
                    sd = fresh.state_dict()
                    dcp.load(sd, checkpoint_id=os.path.join(CFG["dir"], f"dcp_{src}"))
                    fresh.load_state_dict(sd)
                    for s in TABLES:
                        w, acc = expected[s.name]
                        expect(torch.equal(all_rows(fresh, s.name), w), f"DCP-loaded {s.name} differs from run {src}")
                        r = fresh.owned(s.name)
                        got_acc = fresh.export_shard()[s.name].slots["accumulator"].cpu()
                        expect(torch.equal(got_acc, acc[r.start : r.stop]), f"DCP-loaded accumulator of {s.name}")
                finally:
                    fresh.close()
                out["loaded_from"] = src
                # Plain DCP, no elastic_emb and no sharding: one process reads whole tensors.
                if rank == 0:
                    plain = {
                        f"{s.name}.{k}": torch.empty(shape)
                        for s in TABLES
                        for k, shape in (("weight", (s.num_rows, s.dim)), ("accumulator", (s.num_rows,)))
                    }
                    dcp.load(plain, checkpoint_id=os.path.join(CFG["dir"], f"dcp_{src}"), no_dist=True)
                    for s in TABLES:
                        w, acc = expected[s.name]
                        expect(
                            torch.equal(plain[f"{s.name}.weight"], w)
                            and torch.equal(plain[f"{s.name}.accumulator"], acc),
                            f"plain DCP load of {s.name} from run {src} differs",
                        )
                    out["plain_load"] = True
            return out
        finally:
            dist.destroy_process_group()

    _dcp()

    # -- a context closed and constructed anew at another world size holds exactly the old rows --
    shrink = CFG.get("shrink_to")
    if shrink:

        @check("reconstruct_at_other_world_size")
        def _reconstruct():
            final = {s.name: (ref_ada.weight(s.name).clone(), ref_ada.acc[s.name].clone()) for s in TABLES}
            shards = ada.export_shard()
            torch.save(
                {
                    k: (v.rows.start, v.rows.stop, v.weight.cpu(), {n: x.cpu() for n, x in v.slots.items()})
                    for k, v in shards.items()
                },
                os.path.join(CFG["dir"], f"shard_{CFG['tag']}_{rank}.pt"),
            )
            ada.close()
            store.add(f"test/{CFG['tag']}/exported", 1)
            if rank >= shrink:
                return {"role": "left"}
            deadline = time.monotonic() + TIMEOUT
            while int(store.add(f"test/{CFG['tag']}/exported", 0)) < world:
                expect(time.monotonic() < deadline, "not every rank exported its shard")
                time.sleep(0.01)
            new_t = t.with_changes(
                world_size=shrink,
                generation=t.generation + 1,
                ep_size=1 << (shrink.bit_length() - 1),
                local_world_size=shrink,
                num_nodes=1,
                node_rank=0,
                local_rank=rank,
            )
            old = {r: torch.load(os.path.join(CFG["dir"], f"shard_{CFG['tag']}_{r}.pt")) for r in range(world)}
            c = make(ADAGRAD, topo=new_t, seed=None)
            try:
                imported = {}
                for s in TABLES:
                    mine = c.owned(s.name)
                    w = torch.empty(len(mine), s.dim, dtype=s.torch_dtype)
                    acc = torch.empty(len(mine))
                    for tr in reshard_plan(s.num_rows, t.ep_size, new_t.ep_size):
                        if tr.dst != new_t.rank:
                            continue
                        start, _, ow, oslots = old[tr.src][s.name]
                        a, b = tr.rows.start - start, tr.rows.stop - start
                        w[tr.rows.start - mine.start : tr.rows.stop - mine.start] = ow[a:b]
                        acc[tr.rows.start - mine.start : tr.rows.stop - mine.start] = oslots["accumulator"][a:b]
                    imported[s.name] = ShardData(s.name, mine, w.to(c.device), {"accumulator": acc.to(c.device)})
                c.import_shard(imported)
                for s in TABLES:
                    expect(
                        torch.equal(all_rows(c, s.name), final[s.name][0]),
                        f"rows of {s.name} differ after re-construction",
                    )
                    r = c.owned(s.name)
                    expect(
                        torch.equal(
                            c.export_shard()[s.name].slots["accumulator"].cpu(), final[s.name][1][r.start : r.stop]
                        ),
                        f"accumulator of {s.name} differs after re-construction",
                    )
                # and it still trains like the reference
                train_and_compare(c, ref_ada, new_t, "after-reconstruct")
            finally:
                c.close()
            return {"new_world": shrink}

        _reconstruct()
    else:
        ada.close()

    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
