"""What the dense state adds to a commit every step, through the public API.

One process, one rank (a TCPStore on loopback), as a user's loop runs it: ``Lifecycle.start`` with
the default ``LifecycleConfig`` over an ``EmbContext`` (one fp32 table, row-wise Adagrad), and a
dense part of ``--dense-mb`` MB of fp32 parameters (square ``nn.Linear`` layers) trained with Adam
(its gradients set directly: the dense compute is not what is measured). A step: ``--ids`` random
ids looked up and their gradients applied, the dense Adam step, then ``lc.commit(step)``. Three
loops of ``--steps`` steps each, in the same process, each with a fresh state directory, every row
looked up once and two steps run without a commit before its clock starts (bench/_run_loop.py,
the loop the commit benches share):

* ``none``: the step, no commit (the baseline);
* ``tables``: the step, then ``lc.commit(step)`` without app state;
* ``tables+dense``: the same with ``app_state={"model", "optim"}``: Adam's state is twice the
  parameters, so each commit writes three times ``--dense-mb``.

Reported per loop: mean, median, p99 and max step (ms), and the ratios of the means and medians
against ``none`` and ``tables``; then the restore (``Lifecycle.start`` of a new process's worth of
objects from the last commit) with and without app state. JSON to ``--json``.

  python bench/app_state.py --dense-mb 10 --steps 200
  python bench/app_state.py --dense-mb 1024 --steps 40
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _report import write_json  # noqa: E402
from _run_loop import (  # noqa: E402
    EmbStep,
    OneRank,
    emb_factory,
    exit_on_sigterm,
    look_up_every_row,
    loop_report,
    restore,
    run_loop,
)


def dense_part(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Square layers of width 1024 (4 MiB each) or 8192 (256 MiB each) making about ``mb`` MB."""
    width = 1024 if mb < 256 else 8192
    per_layer = width * width * 4 / 1e6
    layers = max(1, round(mb / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    return model, optim


def measure(args, kind: str, world: OneRank, root: Path) -> dict:
    state_dir = root / kind.replace("+", "_")
    factory = emb_factory(args.rows, args.dim)
    model, optim = dense_part(args.dense_mb)
    app = {"model": model, "optim": optim} if kind == "tables+dense" else None
    emb = EmbStep(args.rows, args.ids, args.dim)

    def step(lc, s):
        emb(lc, s)
        optim.step()

    loop = run_loop(
        world,
        state_dir,
        kind,
        factory,
        step,
        steps=args.steps,
        commit=kind != "none",
        warm=look_up_every_row(args.ids),
        app_state=app,
    )
    out = loop_report(loop)
    if kind != "none":
        model2, optim2 = dense_part(args.dense_mb)
        app2 = {"model": model2, "optim": optim2} if app is not None else None
        out.update(restore(world, state_dir, factory, loop, app_state=app2))
        if app2 is not None:
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    shutil.rmtree(state_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense-mb", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=16384)
    ap.add_argument("--dir", default=None, help="where the state directories go (default: a temporary one)")
    ap.add_argument("--json", default="bench/app_state.json")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.steps < 1 or args.dense_mb < 1:
        ap.error("--steps and --dense-mb must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="app-bench-", dir=args.dir))
    world = OneRank("appbench")
    out = {}
    try:
        for kind in ("none", "tables", "tables+dense"):
            out[kind] = measure(args, kind, world, root)
            print(kind, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[kind].items()}, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for base in ("none", "tables"):
        out[f"tables+dense_over_{base}"] = {
            "mean": round(out["tables+dense"]["mean_ms"] / out[base]["mean_ms"], 3),
            "median": round(out["tables+dense"]["median_ms"] / out[base]["median_ms"], 3),
        }
    out["dense_added_mean_ms"] = round(out["tables+dense"]["mean_ms"] - out["tables"]["mean_ms"], 2)
    print({k: v for k, v in out.items() if "over" in k or "added" in k}, flush=True)
    write_json(args.json, "app_state", {"args": vars(args), "pid": os.getpid(), **out})


if __name__ == "__main__":
    main()
