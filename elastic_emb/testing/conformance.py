"""Conformance suite for :class:`elastic_emb.protocol.ShardedContext` implementations.

Describe a context class as a :class:`Target` and call :func:`run` with its import path: it starts
``world_size`` real processes, runs the :data:`CHECKS` on every rank in order, and raises
:class:`ConformanceFailure` naming each failed check and rank. Each rank is a process of
``python -m elastic_emb.testing.conformance --target pkg.module:NAME --rank R --world-size W
--ep-size E --port P --run-id ID``.

Design: ``docs/DRILLS.md`` (section "The conformance suite": what each check asserts).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elastic_emb.errors import ContextClosed, ElasticEmbError, WorldSizeChanged
from elastic_emb.protocol import ShardData, ShardedContext, TableSpec, missing_abilities, row_owners
from elastic_emb.sharding import RowRange, owned_range
from elastic_emb.topology import Topology, largest_power_of_two_at_most

CHECKS = (
    "members",
    "state",
    "export",
    "round_trip",
    "shard_views",
    "changes",
    "reset_refuses",
    "reset",
    "close",
    "failed_collective",
)


class ConformanceFailure(ElasticEmbError, AssertionError):
    """A context failed checks of the conformance suite.

    Args:
        message: the failed checks, in one line.
        failures: ``(check, rank)`` -> the reason.
    """

    def __init__(self, message: str, failures: dict[tuple[str, int], str]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass(frozen=True)
class Target:
    """A context implementation under test.

    Args:
        factory: ``factory(topology, store)`` builds a context; build it with a collective timeout
            of a few seconds, since the last check waits for a collective to fail.
        collective: ``collective(context)`` runs one collective operation of the context (every
            rank calls it at the same point), e.g. a barrier or a lookup; it must mark the context
            unhealthy when it fails.
        write: optional, for contexts that track changes: ``write(context, table, ids)`` writes
            rows of ``table``; every rank calls it at once with its own int64 global row ids, and
            the union is what was written (e.g. ``apply_gradients`` with non-zero gradients).
        backend: the topology's backend (``gloo`` on the CPU).
    """

    factory: Callable[[Topology, object], ShardedContext]
    collective: Callable[[ShardedContext], None]
    write: Callable[[ShardedContext, str, object], None] | None = None
    backend: str = "gloo"


@dataclass(frozen=True)
class Report:
    """What every rank reported: ``passed[check]`` lists the ranks that passed it, ``notes``
    what each rank saw (``notes[check][rank]``)."""

    passed: dict[str, list[int]]
    notes: dict[str, dict[int, str]]
    seconds: float


# -- the parent: start one process per rank ---------------------------------------------------


def run(
    target: str,
    *,
    world_size: int = 2,
    ep_size: int | None = None,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> Report:
    """Run the suite on ``world_size`` processes, one per rank, around a TCPStore this process holds.

    Args:
        target: ``"pkg.module:NAME"``, NAME a :class:`Target` or a function returning one; the
            children import it with this process's ``sys.path``.
        world_size: ranks, at least 2 (one collective must fail).
        ep_size: the topology's EP size; default the largest power of two at most ``world_size``.
        timeout: seconds for the whole suite; ranks still running then are killed.
        env: the children's environment; default this process's.

    Returns:
        Which ranks passed each check, what each saw, and the seconds taken.

    Raises:
        ValueError: if ``world_size`` is below 2 or ``timeout`` is not positive.
        ConformanceFailure: listing every failed check and rank (a rank that crashed or timed out too).
    """
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"world_size={world_size}: the suite needs at least 2 ranks (one collective must fail)")
    ep = largest_power_of_two_at_most(world_size) if ep_size is None else ep_size
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=_td(timeout))
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (*sys.path, child_env.get("PYTHONPATH", "")) if p)
    run_id = f"conformance-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elastic_emb.testing.conformance",
                "--target",
                target,
                "--rank",
                str(r),
                "--world-size",
                str(world_size),
                "--ep-size",
                str(ep),
                "--port",
                str(store.port),
                "--run-id",
                run_id,
            ],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    outputs = _collect(procs, started + timeout)
    del store
    passed: dict[str, list[int]] = {c: [] for c in CHECKS}
    notes: dict[str, dict[int, str]] = {c: {} for c in CHECKS}
    failures: dict[tuple[str, int], str] = {}
    for rank, (rc, out, err) in enumerate(outputs):
        last = None
        for line in out.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("check") not in passed:
                continue
            last = rec["check"]
            if rec["ok"]:
                passed[last].append(rank)
                notes[last][rank] = rec["note"]
            else:
                failures[(last, rank)] = rec["reason"]
        if rc != 0 and not any(r == rank for _, r in failures):
            what = "timed out" if rc is None else f"exited with {rc}"
            tail = err.strip().splitlines()[-1:] or [""]
            failures[(f"after {last or 'start'}", rank)] = f"rank {rank} {what}: {tail[0][:300]}"
    if failures:
        lines = [f"{check} (rank {rank}): {reason}" for (check, rank), reason in sorted(failures.items(), key=str)]
        raise ConformanceFailure(f"{target} fails the context contract: " + "; ".join(lines), failures)
    return Report(passed=passed, notes=notes, seconds=time.monotonic() - started)


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _collect(procs, deadline: float) -> list[tuple[int | None, str, str]]:
    """Wait for every rank until ``deadline``; a rank that failed gives the others a short
    grace (they may wait in a collective for it), then the rest are killed."""
    results: list[tuple[int | None, str, str] | None] = [None] * len(procs)
    grace_until = None
    while any(r is None for r in results):
        now = time.monotonic()
        for i, p in enumerate(procs):
            if results[i] is None and p.poll() is not None:
                out, err = p.communicate()
                results[i] = (p.returncode, out, err)
                if p.returncode != 0 and grace_until is None:
                    grace_until = now + 30.0
        if now > deadline or (grace_until is not None and now > grace_until):
            for i, p in enumerate(procs):
                if results[i] is None:
                    p.kill()
                    out, err = p.communicate()
                    results[i] = (None, out, err)
            break
        time.sleep(0.05)
    return results  # type: ignore[return-value]


# -- a child: one rank -------------------------------------------------------------------------


class _CheckFailed(Exception):
    pass


def _require(cond: bool, reason: str) -> None:
    if not cond:
        raise _CheckFailed(reason)


def _expect(exc_type, fn: Callable[[], object], what: str) -> BaseException:
    try:
        fn()
    except exc_type as exc:
        return exc
    except Exception as exc:
        raise _CheckFailed(f"{what} raised {type(exc).__name__}: {exc}, expected {exc_type.__name__}") from None
    raise _CheckFailed(f"{what} returned; expected {exc_type.__name__}")


class _Rank:
    """The state of one rank's run: the target, the store, the topologies and the context."""

    def __init__(self, target: Target, rank: int, world_size: int, ep_size: int, port: int, run_id: str) -> None:
        import torch.distributed as dist

        self.target = target
        self.store = dist.TCPStore("127.0.0.1", port, None, False, timeout=_td(60))
        self.topology = Topology.build(
            run_id=run_id,
            generation=0,
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            node_rank=0,
            num_nodes=1,
            ep_size=ep_size,
            backend=target.backend,
            master_addr="127.0.0.1",
            master_port=port,
        )
        self.ctx = target.factory(self.topology, self.store)
        self.expected: dict[str, ShardData] = {}

    # Each check returns a short note (what it saw) or raises _CheckFailed.

    def members(self) -> str:
        missing = missing_abilities(self.ctx)
        _require(not missing, f"{type(self.ctx).__name__} lacks {', '.join(missing)}")
        _require(isinstance(self.ctx, ShardedContext), "isinstance(context, ShardedContext) is False")
        try:
            inspect.signature(self.ctx.reset).bind(0, 1, topology=self.topology, store=self.store)
        except TypeError as exc:
            raise _CheckFailed(
                f"reset(rank, world_size, *, topology, store) does not fit its signature: {exc}"
            ) from None
        try:
            inspect.signature(self.ctx.close).bind(abort=True, wait=False)
        except TypeError as exc:
            raise _CheckFailed(f"close(*, abort, wait) does not fit its signature: {exc}") from None
        return "all members"

    def state(self) -> str:
        ctx = self.ctx
        _require(ctx.topology == self.topology, f"topology {ctx.topology!r} is not the one given")
        _require(isinstance(ctx.tables, Mapping) and len(ctx.tables) > 0, "tables must be a non-empty mapping")
        for name, spec in ctx.tables.items():
            _require(
                isinstance(spec, TableSpec) and spec.name == name, f"tables[{name!r}] = {spec!r} is not its TableSpec"
            )
        _require(
            ctx.healthy is True and ctx.closed is False,
            f"a new context has healthy={ctx.healthy!r} closed={ctx.closed!r}; expected True, False",
        )
        _require(isinstance(ctx.tracks_changes, bool), f"tracks_changes={ctx.tracks_changes!r} is not a bool")
        return f"{len(ctx.tables)} tables"

    def _check_layout(self, shards, what: str) -> None:
        t = self.topology
        _require(set(shards) == set(self.ctx.tables), f"{what} tables {sorted(shards)} != {sorted(self.ctx.tables)}")
        for name, spec in self.ctx.tables.items():
            s = shards[name]
            want = owned_range(spec.num_rows, row_owners(self.ctx), t.rank)
            _require(isinstance(s, ShardData) and s.table == name, f"{what}[{name!r}] is not a ShardData of that table")
            _require(s.rows == want, f"{what}[{name!r}] covers {s.rows}, rank {t.rank} owns {want}")
            _require(
                tuple(s.weight.shape) == (len(want), spec.dim) and s.weight.dtype == spec.torch_dtype,
                f"{what}[{name!r}] weight {tuple(s.weight.shape)} {s.weight.dtype}, expected "
                f"{(len(want), spec.dim)} {spec.torch_dtype}",
            )

    def export(self) -> str:
        first = self.ctx.export_shard()
        self._check_layout(first, "export_shard()")
        before = {n: s.weight.clone() for n, s in first.items()}
        for s in first.values():
            s.weight.add_(1)
        again = self.ctx.export_shard()
        for n, w in before.items():
            _require(
                _equal(again[n].weight, w),
                f"changing an exported tensor of {n!r} changed the context: export_shard must return copies",
            )
        return f"rows {[len(s.rows) for s in again.values()]}"

    def _values(self, offset: int) -> dict[str, ShardData]:
        """Integer-valued shards (exact in every dtype) that differ with ``offset``."""
        import torch

        out = {}
        for name, s in self.ctx.export_shard().items():
            rows = torch.arange(s.rows.start, s.rows.stop, dtype=torch.int64)
            w = (rows[:, None] * 7 + torch.arange(s.weight.shape[1])[None, :] * 3 + offset) % 61 - 30
            slots = {
                k: ((rows + offset) % 5 + 1).reshape(-1, *([1] * (v.dim() - 1))).expand_as(v).to(v.dtype).clone()
                for k, v in s.slots.items()
            }
            out[name] = ShardData(name, s.rows, w.to(s.weight.dtype).to(s.weight.device), slots)
        return out

    def _matches_expected(self, what: str) -> None:
        got = self.ctx.export_shard()
        for n, want in self.expected.items():
            _require(_equal(got[n].weight, want.weight), f"{what}: table {n!r} rows differ from those imported")
            _require(
                set(got[n].slots) == set(want.slots),
                f"{what}: table {n!r} slots {sorted(got[n].slots)} != {sorted(want.slots)}",
            )
            for k in want.slots:
                _require(_equal(got[n].slots[k], want.slots[k]), f"{what}: table {n!r} slot {k!r} differs")

    def round_trip(self) -> str:
        self.expected = self._values(0)
        self.ctx.import_shard(self.expected)
        self._matches_expected("export after import")
        name = next(iter(self.expected))
        s = self.expected[name]
        shifted = RowRange(s.rows.start + 1, s.rows.stop + 1)
        bad = dict(self.expected)
        bad[name] = ShardData(name, shifted, s.weight, dict(s.slots))
        _expect(ValueError, lambda: self.ctx.import_shard(bad), f"import_shard of rows {shifted} (owned {s.rows})")
        partial = {n: v for n, v in self.expected.items() if n != name}
        _expect(ValueError, lambda: self.ctx.import_shard(partial), f"import_shard without table {name!r}")
        self._matches_expected("export after refused imports")
        return "bit for bit"

    def shard_views(self) -> str:
        views = self.ctx.shard_views()
        if views is None:
            return "not offered"
        self._check_layout(views, "shard_views()")
        written = self._values(11)
        for n, v in views.items():
            v.weight.copy_(written[n].weight)
            for k, t in v.slots.items():
                t.copy_(written[n].slots[k])
        self.ctx.mark_restored()
        self.expected = written
        self._matches_expected("export after writing through shard_views")
        return "written in place"

    def changes(self) -> str:
        if not self.ctx.tracks_changes:
            _expect(NotImplementedError, self.ctx.take_changes, "take_changes() with tracks_changes False")
            return "not tracked"
        import torch

        self.ctx.take_changes()
        self.ctx.import_shard(self.expected)
        imported, quiet = self.ctx.take_changes(), self.ctx.take_changes()
        _require(set(imported) == set(self.ctx.tables) == set(quiet), f"take_changes tables {sorted(imported)}")
        for n, spec in self.ctx.tables.items():
            rows = len(owned_range(spec.num_rows, row_owners(self.ctx), self.topology.rank))
            for m in (imported[n], quiet[n]):
                _require(
                    isinstance(m, torch.Tensor) and m.dtype == torch.bool and tuple(m.shape) == (rows,),
                    f"take_changes()[{n!r}] must be a bool tensor of shape ({rows},)",
                )
            _require(imported[n] is not quiet[n], f"take_changes() returned the same mask of {n!r} twice")
            _require(bool(imported[n].all()), f"import_shard wrote every row of {n!r}, take_changes() misses some")
            _require(not bool(quiet[n].any()), f"take_changes() marks rows of {n!r} that nothing wrote")
        if self.target.write is None:
            return "masks (no write hook)"
        for n, spec in self.ctx.tables.items():
            written = sorted({0, 1, spec.num_rows // 2, spec.num_rows - 1})
            mine = torch.tensor(written[self.topology.rank :: self.topology.world_size], dtype=torch.int64)
            self.target.write(self.ctx, n, mine)
            got = self.ctx.take_changes()[n].cpu()
            own = owned_range(spec.num_rows, row_owners(self.ctx), self.topology.rank)
            want = torch.zeros(len(own), dtype=torch.bool)
            for r in written:
                if own.start <= r < own.stop:
                    want[r - own.start] = True
            _require(
                torch.equal(got, want),
                f"after writing rows {written} of {n!r}, take_changes() marks local rows "
                f"{got.nonzero().flatten().tolist()}, expected {want.nonzero().flatten().tolist()}",
            )
        self.expected = {n: s for n, s in self.ctx.export_shard().items()}
        return "exact"

    def reset_refuses(self) -> str:
        t = self.topology
        bigger = t.with_changes(world_size=t.world_size + 1, generation=t.generation + 1)
        t0 = time.monotonic()
        _expect(
            WorldSizeChanged,
            lambda: self.ctx.reset(t.rank, t.world_size + 1, topology=bigger, store=self.store),
            f"reset to world size {t.world_size + 1} (built for {t.world_size})",
        )
        other_ep = t.ep_size // 2 if t.ep_size > 1 else 2
        if other_ep <= t.world_size:
            changed = t.with_changes(ep_size=other_ep, generation=t.generation + 1)
            _expect(
                ValueError,
                lambda: self.ctx.reset(t.rank, t.world_size, topology=changed, store=self.store),
                f"reset to ep_size {other_ep} (built for {t.ep_size})",
            )
        seconds = time.monotonic() - t0
        _require(self.ctx.healthy and not self.ctx.closed, "a refused reset left the context unhealthy or closed")
        self._matches_expected("export after refused resets")
        return f"refused in {seconds:.3f}s"

    def reset(self) -> str:
        new = self.topology.with_changes(generation=self.topology.generation + 1)
        self.ctx.reset(new.rank, new.world_size, topology=new, store=self.store)
        _require(self.ctx.topology == new, f"after reset, topology is {self.ctx.topology!r}, not the one given")
        _require(self.ctx.healthy and not self.ctx.closed, "unhealthy or closed after a same-size reset")
        self._matches_expected("export after reset")
        self.target.collective(self.ctx)
        self.topology = new
        return "re-formed"

    def close(self) -> str:
        ctx = self.ctx
        ctx.close(wait=False)
        _require(
            ctx.closed is True and ctx.healthy is False,
            f"after close: closed={ctx.closed!r} healthy={ctx.healthy!r}; expected True, False",
        )
        ctx.close()
        ctx.close(abort=True)
        _expect(ContextClosed, ctx.export_shard, "export_shard after close")
        _expect(ContextClosed, lambda: ctx.import_shard(self.expected), "import_shard after close")
        return "idempotent"

    def failed_collective(self) -> str:
        new = self.topology.with_changes(generation=self.topology.generation + 1)
        ctx = self.target.factory(new, self.store)
        self.ctx = ctx
        self.target.collective(ctx)  # both ranks formed the communicator
        if new.rank != 0:
            ctx.close(abort=True)
            _require(ctx.closed, "close(abort=True) did not close")
            return "aborted its end"
        t0 = time.monotonic()
        _expect(Exception, lambda: self.target.collective(ctx), "a collective whose peers aborted")
        failed = time.monotonic() - t0
        _require(
            ctx.healthy is False and ctx.closed is False,
            f"after a failed collective: healthy={ctx.healthy!r} closed={ctx.closed!r}; expected False, False",
        )
        t1 = time.monotonic()
        ctx.close()
        _require(ctx.closed, "close() after a failed collective did not close")
        return f"failed in {failed:.2f}s, closed in {time.monotonic() - t1:.2f}s"


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def load_target(ref: str) -> Target:
    """Import the target ``ref`` names.

    Args:
        ref: ``"pkg.module:NAME"``, NAME a :class:`Target` or a function returning one.

    Returns:
        The target.

    Raises:
        ValueError: if ``ref`` is not of the form ``module:NAME``.
        TypeError: if NAME is, or returns, something other than a :class:`Target`.
    """
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"target={ref!r}: use 'pkg.module:NAME'")
    obj = getattr(importlib.import_module(module), name)
    target = obj if isinstance(obj, Target) else obj()
    if not isinstance(target, Target):
        raise TypeError(f"target={ref!r} is a {type(target).__name__}, not an elastic_emb.testing.conformance.Target")
    return target


def _emit(check: str, ok: bool, note: str, since: float) -> None:
    note = f"{note} ({time.monotonic() - since:.2f}s)" if ok else note
    print(json.dumps({"check": check, "ok": ok, "reason" if not ok else "note": note}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """One rank of the suite: build the context, run every check in order, print one JSON line per check.

    Args:
        argv: the command line (``--target``, ``--rank``, ``--world-size``, ``--ep-size``,
            ``--port``, ``--run-id``); default ``sys.argv``.

    Returns:
        0 when every check passed, 1 at the first that failed.
    """
    p = argparse.ArgumentParser(prog="python -m elastic_emb.testing.conformance", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ep-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-id", required=True)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        state = _Rank(load_target(a.target), a.rank, a.world_size, a.ep_size, a.port, a.run_id)
    except Exception as exc:
        _emit("members", False, f"could not build the context: {type(exc).__name__}: {exc}", t0)
        return 1
    checks = {
        "members": state.members,
        "state": state.state,
        "export": state.export,
        "round_trip": state.round_trip,
        "shard_views": state.shard_views,
        "changes": state.changes,
        "reset_refuses": state.reset_refuses,
        "reset": state.reset,
        "close": state.close,
        "failed_collective": state.failed_collective,
    }
    assert tuple(checks) == CHECKS
    for check, method in checks.items():
        t0 = time.monotonic()
        try:
            note = method()
        except _CheckFailed as exc:
            _emit(check, False, str(exc), t0)
            return 1
        except Exception as exc:
            _emit(check, False, f"raised {type(exc).__name__}: {str(exc)[:500]}", t0)
            return 1
        _emit(check, True, note, t0)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, so that targets see the same Target class as this code.
    from elastic_emb.testing import conformance

    code = conformance.main()
    # The verdicts are written; leave without the interpreter's native teardown. After the
    # failed-collective check a communicator was aborted, and the threads some backends leave
    # behind then (TorchRec on gloo, for one) can abort the process at exit with
    # "terminate called without an active exception", which is not part of the contract.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
