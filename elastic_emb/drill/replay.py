"""The reference replay and the bit-for-bit verification of a drill.

- :func:`replay`: steps ``0..S`` of the training script in one process (``torch.nn.Embedding``
  tables stepped by ``torch.optim.SGD``, the script's own data, gradient functions and replicated
  state: the tower, Adam, the schedule, the sampler);
- :func:`gather_final`: the final shards of the newest complete world, checked to cover every row
  once, and its replicated state, checked to be the same on every rank;
- :func:`verify`: the two compared bit for bit, with every per-step checksum the workers wrote
  and the sample accounting;
  :class:`LossDetected` names each row that differs and the steps it is missing.

Design: ``docs/DRILLS.md`` (section "Verification").
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from elastic_emb.drill.errors import LossDetected
from elastic_emb.examples import RECSYS as EXAMPLE  # inside the package: a wheel has it too


def load_script(path: Path | str = EXAMPLE) -> ModuleType:
    """Import the training script as a module (its ``main`` is not run).

    Args:
        path: the script's file.

    Returns:
        The module, registered in ``sys.modules`` under a name of its own.

    Raises:
        FileNotFoundError: if ``path`` is not a file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"training script {path} not found; pass --script PATH, or leave it out to drill "
            f"the packaged example ({EXAMPLE})"
        )
    spec = importlib.util.spec_from_file_location(f"_drill_script_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@dataclass
class FinalTables:
    """The gathered final shards of one world: table -> full tensor, plus provenance."""

    step: int
    world_size: int
    generation: int
    config: dict
    tables: dict[str, torch.Tensor]
    files: list[str] = field(default_factory=list)
    app: dict | None = None  # the replicated state the ranks wrote (the recsys example: tower, Adam, schedule, sampler)
    data: dict | None = None  # the dataset the workers read: {"path", "crc"}


def gather_final(out: Path) -> FinalTables:
    """Assemble the newest complete world's final shards, checking coverage row by row.

    A world is complete when every one of its ranks wrote a final file; of several, the one
    that wrote last is taken.

    Args:
        out: the training run's output directory (``<drill out>/run``), holding ``final/*.pt``.

    Returns:
        The full tables, the committed step they reflect, and where they came from.

    Raises:
        LossDetected: if there are no final files, no world wrote all of its ranks, its ranks
            finished at different steps, or a row is held by no rank or by several.
    """
    files = sorted((out / "final").glob("*.pt"))
    if not files:
        raise LossDetected(f"no final tables under {out / 'final'}: the training never finished", [])
    payloads = [(f, torch.load(f, weights_only=True)) for f in files]
    worlds: dict[tuple[int, int], list] = {}
    for f, p in payloads:
        worlds.setdefault((p["generation"], p["world_size"]), []).append((f, p))
    # The newest world that wrote all of its ranks.
    complete = [
        (max(p["time"] for _, p in v), k) for k, v in worlds.items() if {p["rank"] for _, p in v} >= set(range(k[1]))
    ]
    if not complete:
        raise LossDetected(
            f"no world wrote all of its final shards under {out / 'final'} "
            f"(got {[(k, sorted(p['rank'] for _, p in v)) for k, v in worlds.items()]})",
            [],
        )
    _, key = max(complete)
    group = sorted(worlds[key], key=lambda fp: (fp[1]["rank"], fp[1]["time"]))
    # One file per rank (the newest, should a rank have written twice).
    by_rank = {p["rank"]: (f, p) for f, p in group}
    steps = {p["step"] for _, p in by_rank.values()}
    if len(steps) != 1:
        raise LossDetected(f"ranks of world {key} finished at different committed steps {sorted(steps)}", [])
    config = next(iter(by_rank.values()))[1]["config"]
    findings: list[dict] = []
    tables: dict[str, torch.Tensor] = {}
    names = sorted({n for _, p in by_rank.values() for n in p["shards"]})
    for name in names:
        parts = sorted(
            (
                (p["shards"][name]["start"], p["shards"][name]["stop"], r, p["shards"][name]["weight"])
                for r, (_, p) in by_rank.items()
                if name in p["shards"]
            ),
            key=lambda x: x[:2],
        )
        declared = {p["shards"][name].get("num_rows") for _, p in by_rank.values() if name in p["shards"]} - {None}
        if len(declared) > 1:
            findings.append({"table": name, "problem": f"ranks disagree on the table size: {sorted(declared)}"})
        # The table's size as the ranks declare it, so unowned trailing rows are not silently cut off.
        num_rows = max(declared | {max(stop for _, stop, _, _ in parts)})
        dim = parts[0][3].shape[1]
        full = torch.empty(num_rows, dim, dtype=parts[0][3].dtype)
        owners = torch.zeros(num_rows, dtype=torch.int64)
        for start, stop, _, w in parts:
            full[start:stop] = w
            owners[start:stop] += 1
        for bad, what in ((owners == 0, "no rank holds"), (owners > 1, "several ranks hold")):
            if bad.any():
                findings.append({"table": name, "problem": what, "rows": _ranges(bad.nonzero().flatten().tolist())})
        tables[name] = full
    if findings:
        raise LossDetected("rows lost or duplicated across the final shards: " + _describe(findings), findings)
    # The replicated state: every rank of the world must hold the same bits.
    apps = {r: p.get("app") for r, (_, p) in by_rank.items()}
    app = apps[min(apps)]
    for r, other in sorted(apps.items()):
        for where in _differences(app, other, "app")[:4]:
            findings.append({"table": where, "problem": f"ranks {min(apps)} and {r} hold different replicated state"})
    if findings:
        raise LossDetected("the replicated state differs between ranks: " + _describe(findings), findings)
    return FinalTables(
        step=steps.pop(),
        world_size=key[1],
        generation=key[0],
        config=config,
        tables=tables,
        files=[str(f) for f, _ in by_rank.values()],
        app=app,
        data=next(iter(by_rank.values()))[1].get("data"),
    )


def replay(script: ModuleType, cfg, last_step: int, *, data=None, keep_history: bool = True, on_step=None):
    """Apply steps ``0..last_step`` of ``script`` in one process.

    The tables are ``torch.nn.Embedding``s stepped by ``torch.optim.SGD``; the dense part is the
    script's own (:class:`~elastic_emb.examples.recsys.Dense`: the tower, Adam, the schedule and
    the sampler), fed the whole global batch of each step, which the sampler names.

    Args:
        script: the training script's module (:func:`load_script`).
        cfg: the script's ``Config``, as the workers ran it.
        last_step: the last step to apply.
        data: the dataset the workers read; None: the script's generated one.
        keep_history: record the rows each step changed.
        on_step: called as ``on_step(step, tables, dense)`` after each step (``dense`` the
            script's replicated state, its sampler at the next step), and with step -1 before the first.

    Returns:
        ``(tables, history, initial, dense)``: the tables after ``last_step``; per table, a list of
        ``(step, rows, values)`` with the rows each step changed and their new values (so a
        mismatching row can be traced to the step where it went astray); the initial tables; the
        replicated state after ``last_step``.

    Raises:
        LossDetected: the sampler read a sample twice in an epoch, or the cursor is not the sum of
            the steps' batches (the sample accounting).
    """
    from elastic_emb.context import init_rows
    from elastic_emb.sharding import RowRange

    if data is None:
        data = script.generate_dataset(cfg)
    specs = {s.name: s for s in script.table_specs(cfg)}
    tables = {}
    for name, spec in specs.items():
        emb = torch.nn.Embedding(spec.num_rows, spec.dim, dtype=spec.torch_dtype)
        with torch.no_grad():
            emb.weight.copy_(init_rows(spec, cfg.seed, RowRange(0, spec.num_rows)))
        tables[name] = emb
    opt = torch.optim.SGD([t.weight for t in tables.values()], lr=cfg.lr)
    dense = script.Dense(cfg)
    history: dict[str, list] = {name: [] for name in tables}
    initial = {name: t.weight.detach().clone() for name, t in tables.items()}
    reads: dict[int, torch.Tensor] = {}  # epoch -> how often each sample was read in it
    if on_step is not None:
        on_step(-1, {n: t.weight.detach() for n, t in tables.items()}, dense)
    for step in range(last_step + 1):
        idx = dense.step_samples()
        positions = torch.arange(dense.sampler.cursor, dense.sampler.cursor + len(idx))
        for e in torch.unique(positions // cfg.samples).tolist():
            at = positions // cfg.samples == e
            reads.setdefault(e, torch.zeros(cfg.samples, dtype=torch.int64)).index_add_(
                0, idx[at], torch.ones(int(at.sum()), dtype=torch.int64)
            )
        users, items, labels = script.batch_of(data, idx, cfg)
        with torch.no_grad():
            u, i = tables["user"].weight[users], tables["item"].weight[items]
        _, g_dense, g_u, g_i = script.sample_gradients(cfg, dense.model.flat(), u, i, labels)
        grads = {
            "user": torch.zeros_like(tables["user"].weight).index_add_(0, users, g_u),
            "item": torch.zeros_like(tables["item"].weight).index_add_(0, items, g_i),
        }
        opt.zero_grad(set_to_none=True)
        for name, g in grads.items():
            tables[name].weight.grad = g
        opt.step()
        dense.apply(g_dense.sum(0))
        if on_step is not None:
            on_step(step, {n: t.weight.detach() for n, t in tables.items()}, dense)
        if keep_history:
            for name, ids in (("user", users), ("item", items)):
                rows = torch.unique(ids)
                history[name].append((step, rows, tables[name].weight.detach()[rows].clone()))
    # The sample accounting: each step read the next `batch` positions of the global order, so
    # every sample once per epoch and the cursor at the sum of the steps' batches.
    twice = {e: (c > 1).nonzero().flatten()[:5].tolist() for e, c in reads.items() if (c > 1).any()}
    complete = [e for e, c in reads.items() if (e + 1) * cfg.samples <= dense.sampler.cursor and not (c == 1).all()]
    if twice or complete or dense.sampler.cursor != (last_step + 1) * cfg.batch:
        raise LossDetected(
            f"sample accounting of the replay broken: read twice {twice}, epochs not read whole {complete}, "
            f"cursor {dense.sampler.cursor} != {(last_step + 1) * cfg.batch}",
            [],
        )
    return {n: t.weight.detach().clone() for n, t in tables.items()}, history, initial, dense


def verify(out: Path | str, script_path: Path | str = EXAMPLE, *, max_named: int = 20) -> dict:
    """Compare a drill's final tables and replicated state with the replay, bit for bit.

    Also checks, at each step, the CRC32s of the rows each rank held and looked up, the samples
    it read and the tower's state after the step (the workers' ``--checksums`` progress lines),
    naming the first step where a rank diverged; and the sample accounting (every sample of the
    committed history read once per epoch, the sampler's cursor at the sum of the steps' batches).

    Args:
        out: the training run's output directory (``<drill out>/run``).
        script_path: the training script the workers ran; a script with ``drill_replay`` brings
            its own reference (the tables and its replicated state: the TorchRec example's tower
            optimizer).
        max_named: the most mismatching rows named per table (the rest are counted).

    Returns:
        ``ok``, the step and world size checked, rows and per-step checksums checked, samples
        accounted for, table shapes and the final files.

    Raises:
        LossDetected: on any difference (also those of :func:`gather_final`), with every finding.
        FileNotFoundError: if the script is not a file.
    """
    out = Path(out)
    final = gather_final(out)
    script = load_script(script_path)
    cfg = script.Config(**final.config)
    checks = _step_checksums(out)
    diverged: dict[str, dict] = {}

    lookups = _lookup_checksums(out)

    def check(step: int, tables: dict[str, torch.Tensor], dense=None) -> None:
        # The rows each rank looked up in step+1 must be the replay's rows after `step`, and the
        # samples it read those the global order names at step+1 (the sampler's cursor now).
        # (A script without lookup checksums, the TorchRec example, writes only ``dense_crc``.)
        looked = [c for c in lookups.get(step + 1, []) if c["crc"] is not None]
        if looked and "lookup" not in diverged and dense is not None:
            idx = dense.step_samples()
            for c in looked:
                mine = idx[script.rank_slice(cfg.batch, c["rank"], c["world"])]
                users, items, _ = script.batch_of(data, mine, cfg)
                for what, want, got in (
                    ("samples", script.samples_checksum(mine), c["samples_crc"]),
                    ("lookup", script.lookup_checksum(tables["user"][users], tables["item"][items]), c["crc"]),
                ):
                    if got is not None and want != got:
                        diverged["lookup"] = {
                            "table": "user+item" if what == "lookup" else "samples",
                            "problem": "looked-up rows differ from the replay"
                            if what == "lookup"
                            else "read samples other than the global order names",
                            "step": step + 1,
                            "rank": c["rank"],
                            "world_size": c["world"],
                            "node": c["node"],
                            "pid": c["pid"],
                        }
                        break
                if "lookup" in diverged:
                    break
        if dense is not None and step in lookups and "dense" not in diverged:
            want = dense.checksum()
            for c in lookups[step]:
                if c["dense_crc"] is not None and c["dense_crc"] != want:
                    diverged["dense"] = {
                        "table": "dense",
                        "problem": "tower or Adam state differs from the replay",
                        "step": step,
                        "rank": c["rank"],
                        "world_size": c["world"],
                        "node": c["node"],
                        "pid": c["pid"],
                    }
                    break
        for c in checks.get(step, []):
            name, start, stop, crc = c["table"], c["start"], c["stop"], c["crc"]
            if name in diverged or name not in tables:
                continue
            want = zlib.crc32(tables[name][start:stop].contiguous().view(torch.uint8).numpy())
            if want != crc:
                diverged[name] = {
                    "table": name,
                    "problem": "first divergence from the replay",
                    "step": step,
                    "rows": [[start, stop]],
                    "rank": c["rank"],
                    "world_size": c["world"],
                    "generation": c["generation"],
                    "node": c["node"],
                    "process_restored_step": c["restored_step"],
                }

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: threads only contend, and on a busy machine slow them down
    dense = None
    try:
        # A script may bring its own reference (the TorchRec example replays with TorchRec itself,
        # and its replicated state is the tower's Adam and schedule).
        own = getattr(script, "drill_replay", None)
        if own is not None:
            expected, history, initial, dense = own(cfg, final.step, on_step=check)
        else:
            data = _dataset(script, cfg, final)
            expected, history, initial, dense = replay(script, cfg, final.step, data=data, on_step=check)
    finally:
        torch.set_num_threads(threads)
    findings: list[dict] = sorted(diverged.values(), key=lambda f: f["step"])
    rows_checked = 0
    for name, want in expected.items():
        got = final.tables.get(name)
        if got is None or got.shape != want.shape:
            findings.append(
                {"table": name, "problem": f"shape {None if got is None else tuple(got.shape)} != {tuple(want.shape)}"}
            )
            continue
        rows_checked += want.shape[0]
        # Bit for bit: compare the raw bits, so -0.0 vs 0.0 and NaN payloads count too.
        bad = (got.view(torch.int32) != want.view(torch.int32)).any(1).nonzero().flatten()
        # Name the rows furthest from the replay first: a corrupted row, not the ripples its error
        # sent through the tower into every row trained after it (Adam amplifies small differences).
        far = (got[bad].double() - want[bad].double()).abs().amax(1).nan_to_num(float("inf"))
        order = sorted(range(len(bad)), key=lambda k: (-float(far[k]), int(bad[k])))
        named = [int(bad[k]) for k in order[:max_named]]
        bad = bad.tolist()
        for row in named:
            finding = _diagnose(name, row, got[row], initial[name][row], history[name], final.step)
            finding["max_abs_diff"] = float((got[row].double() - want[row].double()).abs().max())
            findings.append(finding)
        if len(bad) > max_named:
            findings.append(
                {"table": name, "problem": f"{len(bad) - max_named} more rows differ", "rows": _ranges(bad)}
            )
    samples = 0
    if dense is not None:
        # The replicated state (recsys: tower, Adam's moments, schedule, sampler cursor; TorchRec:
        # the tower's Adam and schedule, its values being the dense table), bit for bit.
        want_app = {name: obj.state_dict() for name, obj in dense.objects().items()}
        if final.app is None:
            findings.append({"table": "app", "problem": "the final files hold no replicated state"})
        else:
            for where in _differences(want_app, final.app, "app"):
                findings.append({"table": where, "problem": "replicated state differs from the replay"})
        sampler = getattr(dense, "sampler", None)
        samples = sampler.cursor if sampler is not None else 0
    if findings:
        raise LossDetected(
            f"LOSS DETECTED after step {final.step} (world {final.world_size}): " + _describe(findings), findings
        )
    return {
        "ok": True,
        "step": final.step,
        "world_size": final.world_size,
        "rows_checked": rows_checked,
        "step_checksums_checked": sum(len(v) for k, v in checks.items() if k <= final.step),
        "samples_accounted": samples,
        "tables": {n: list(t.shape) for n, t in expected.items()},
        "files": final.files,
    }


def _dataset(script: ModuleType, cfg, final: FinalTables):
    """The dataset the workers read (their final files name it and its CRC32): the file, or the
    script's generated one when the file is gone and the CRC32s agree."""
    recorded = final.data or {}
    path = Path(recorded.get("path", ""))
    data = script.load_dataset(path, cfg, create=False) if recorded.get("path") and path.is_file() else None
    if data is None:
        data = script.generate_dataset(cfg)
    if recorded.get("crc") is not None and script.dataset_crc(data) != recorded["crc"]:
        raise LossDetected(
            f"the dataset the workers read ({path}, CRC32 {recorded['crc']}) is not the replay's "
            f"(CRC32 {script.dataset_crc(data)}): it changed since the run",
            [{"table": "data", "problem": "dataset differs from the workers'"}],
        )
    return data


def _differences(a, b, where: str) -> list[str]:
    """Where two state dicts differ, bit for bit (tensors by dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [where]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [where]
        ab, bb = a.detach().cpu().reshape(-1).contiguous(), b.detach().cpu().reshape(-1).contiguous()
        return [] if torch.equal(ab.view(torch.uint8), bb.view(torch.uint8)) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} (keys {sorted(map(str, set(a) ^ set(b)))})"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [where]
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{k}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if struct.pack("<d", a) == struct.pack("<d", b) else [where]
    return [] if type(a) is type(b) and a == b else [where]


def _step_checksums(out: Path) -> dict[int, list[dict]]:
    """Per-step CRC32s the workers wrote (``--checksums``): step -> [{table, start, stop, crc, ...}].

    A step may have been run more than once (a restart after a crash before its commit): every
    run of it is checked, since each must have produced the committed rows."""
    checks: dict[int, list[dict]] = {}
    for path in sorted((out / "events").glob("*.jsonl")):
        restored = None
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "start":
                restored = e.get("restored_step")
            if e.get("event") != "step" or not e.get("crc"):
                continue
            for name, (start, stop, crc) in e["crc"].items():
                if stop > start:
                    checks.setdefault(e["step"], []).append(
                        {
                            "table": name,
                            "start": start,
                            "stop": stop,
                            "crc": crc,
                            "rank": e.get("rank"),
                            "world": e.get("world"),
                            "generation": e.get("generation"),
                            "node": e.get("node"),
                            "restored_step": restored,
                        }
                    )
    return checks


def _lookup_checksums(out: Path) -> dict[int, list[dict]]:
    """step -> [{rank, world, crc, samples_crc, dense_crc, node, pid}]: the rows each process looked up
    in that step, the samples it read, the tower's state after it."""
    found: dict[int, list[dict]] = {}
    for path in sorted((out / "events").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "step" and (e.get("lookup_crc") is not None or e.get("dense_crc") is not None):
                found.setdefault(e["step"], []).append(
                    {
                        "rank": e["rank"],
                        "world": e["world"],
                        "crc": e.get("lookup_crc"),
                        "samples_crc": e.get("samples_crc"),
                        "dense_crc": e.get("dense_crc"),
                        "node": e.get("node"),
                        "pid": e.get("pid"),
                    }
                )
    return found


def _diagnose(table: str, row: int, got: torch.Tensor, initial: torch.Tensor, history: list, last: int) -> dict:
    """Name the steps a wrong row is missing (or say it matches no state)."""
    states = [(-1, initial)]
    touched = []
    for step, rows, values in history:
        hit = (rows == row).nonzero().flatten()
        if len(hit):
            states.append((step, values[hit[0]]))
            touched.append(step)
    same = [s for s, v in states if torch.equal(v.view(torch.int32), got.view(torch.int32))]
    if same:
        k = same[-1]
        missing = [s for s in touched if s > k]
        return {
            "table": table,
            "row": row,
            "problem": "updates lost",
            "equals_replay_after_step": k,
            "missing_steps": missing,
            "last_step": last,
        }
    return {
        "table": table,
        "row": row,
        "problem": "matches no replay state (corrupted or applied twice)",
        "steps_touching_row": touched,
        "last_step": last,
    }


def _ranges(rows: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def _describe(findings: list[dict]) -> str:
    parts = []
    for f in findings[:12]:
        if f.get("problem") == "looked-up rows differ from the replay":
            parts.append(
                f"rank {f['rank']} of world {f['world_size']} (on {f['node']}, pid {f['pid']}) looked up rows "
                f"in step {f['step']} that differ from the replay's"
            )
        elif f.get("problem") in (
            "read samples other than the global order names",
            "tower or Adam state differs from the replay",
        ):
            parts.append(
                f"rank {f['rank']} of world {f['world_size']} (on {f['node']}, pid {f['pid']}) {f['problem']} "
                f"at step {f['step']}"
            )
        elif f.get("problem") == "first divergence from the replay":
            start, stop = f["rows"][0]
            parts.append(
                f"{f['table']} rows [{start}, {stop}) (rank {f['rank']} of world {f['world_size']} on "
                f"{f['node']}, a process that restored step {f['process_restored_step']}) first differ "
                f"from the replay right after step {f['step']}"
            )
        elif "row" in f:
            if f["problem"] == "updates lost":
                parts.append(
                    f"{f['table']}[{f['row']}] equals the replay after step {f['equals_replay_after_step']}: "
                    f"updates of steps {f['missing_steps']} lost"
                )
            else:
                parts.append(
                    f"{f['table']}[{f['row']}] {f['problem']}, off by up to {f.get('max_abs_diff', 0):.3g}; "
                    f"steps touching it: {f['steps_touching_row'][-8:]}"
                )
        else:
            rows = ", ".join(f"[{a}, {b})" for a, b in f.get("rows", []))
            parts.append(f"{f['table']}: {f['problem']} rows {rows}" if rows else f"{f['table']}: {f['problem']}")
    more = f" (+{len(findings) - 12} more)" if len(findings) > 12 else ""
    return "; ".join(parts) + more
