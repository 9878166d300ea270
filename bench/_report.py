"""The one way a benchmark writes its JSON report: :func:`write_json`.

BENCHMARKS.md gives every figure with its command, date, machine and versions. Each bench used to
write its report with its own block (make the folder, open, ``json.dump``) and its own pick of
those facts (one recorded ``torch`` only, one ``machine`` but no date, one the date without
seconds), so two reports could not be compared without reading both scripts. Now every report
is ``{"bench": NAME, "meta": {...}, ...the bench's own fields}``, where ``meta`` is
:func:`environment`: the UTC date, the machine (architecture, platform, CPU count, load average,
GPU name when CUDA is available) and the versions (Python, torch, CUDA, NCCL, elastic_emb, plus
whatever the bench adds, e.g. etcd's). The bench's own fields are its measurements and
arguments; it records none of these facts itself.

A bench that prints its figures as a table uses :func:`table` (a Markdown table, the form
BENCHMARKS.md quotes), so the printed figures and the JSON hold the same numbers.

A bench imports it as ``_report`` after putting its own folder first on ``sys.path``, so it works
run as a script (``python bench/x.py``) and as a module (``-m bench.x``). Rank processes are
started and collected with :mod:`elastic_emb.testing.procs`, shared with the tests.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["environment", "table", "write_json"]


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except ImportError:  # a bench that needs no torch (none yet) still gets the rest
        return {"torch": None}
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "gpus": 0,
        "nccl": None,
    }
    if torch.cuda.is_available():
        facts.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return facts


def _elastic_emb_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("elastic-emb")
    except PackageNotFoundError:
        return None


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: list[Mapping[str, Any]], columns: list[tuple[str, str]], *, digits: int = 2) -> str:
    """A Markdown table of ``rows``: one line per row, one column per ``(key, heading)`` of
    ``columns`` (a missing key or None prints ``-``; floats with ``digits`` decimals; text
    left-aligned, numbers right-aligned)."""
    cells = [[_cell(r.get(key), digits) for key, _ in columns] for r in rows]
    numeric = [
        all(isinstance(r.get(key), (int, float)) or r.get(key) is None for r in rows) and bool(rows)
        for key, _ in columns
    ]
    widths = [max([3, len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if n else "-" * w for w, n in zip(widths, numeric)) + " |"
    return "\n".join([line([h for _, h in columns]), rule, *(line(c) for c in cells)])


def environment(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and with what a measurement ran: date, machine, versions (``extra`` added last)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in load] if load else None,
        "python": platform.python_version(),
        **_torch_facts(),
        "elastic_emb": _elastic_emb_version(),
    }
    meta.update(extra or {})
    return meta


def write_json(
    path: str | os.PathLike[str],
    bench: str,
    report: Mapping[str, Any],
    *,
    extra: Mapping[str, Any] | None = None,
    indent: int = 2,
) -> Path:
    """Write ``{"bench": bench, "meta": environment(extra), **report}`` to ``path`` (its folder
    made as needed) and say so on stdout; returns the path. ``report`` may not use the keys
    ``bench`` and ``meta``."""
    clash = {"bench", "meta"} & set(report)
    if clash:
        raise ValueError(f"report of bench {bench!r} uses the reserved keys {sorted(clash)}: rename them")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": bench, "meta": environment(extra), **report}
    out.write_text(json.dumps(doc, indent=indent) + "\n")
    print(f"wrote {out}", file=sys.stdout, flush=True)
    return out
