"""The import graph of elastic_emb follows a declared layer order: a module imports only from
lower layers (or, inside one package, from its siblings), so the low parts can be read, tested
and reused without the high ones. Checked statically with ``ast`` (imports inside functions
count too: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_emb"

# Bottom up. A name covers the module and everything below it, unless a longer name is declared.
LAYERS: list[tuple[str, ...]] = [
    ("elastic_emb.errors",),
    ("elastic_emb.config",),
    (
        "elastic_emb.events",
        "elastic_emb.sharding",
        "elastic_emb.native_calls",
        "elastic_emb.data",
        "elastic_emb.state.points",
    ),
    ("elastic_emb.metrics", "elastic_emb.topology", "elastic_emb.progress"),
    ("elastic_emb.protocol", "elastic_emb.store", "elastic_emb.work_wait", "elastic_emb.context.changes"),
    # the wire contract between the agent and the workers, and what both sides share
    ("elastic_emb.rdzv.keys", "elastic_emb.rdzv.localfile", "elastic_emb.rdzv.counters"),
    (
        "elastic_emb.rdzv.signing",
        "elastic_emb.rdzv.decode",
        "elastic_emb.rdzv.outage",
        "elastic_emb.rdzv.conf",
        "elastic_emb.rdzv.torch_compat",
        "elastic_emb.rdzv.etcd_v3",
        "elastic_emb.rdzv.etcd_v3_client",
        "elastic_emb.rdzv.etcd_v2",
        "elastic_emb.rdzv.reader",
        "elastic_emb.rdzv.drain_acks",
        "elastic_emb.rdzv.signed_cas",
    ),
    (
        "elastic_emb.context",
        "elastic_emb.state",
        "elastic_emb.adapters",
        "elastic_emb.watch.membership",
        "elastic_emb.watch.selfstop",
    ),
    ("elastic_emb.watch", "elastic_emb.inprocess.rollcall"),
    (
        "elastic_emb.cli.drain",
        "elastic_emb.rdzv.guarded",
        "elastic_emb.rdzv.liveness",
        "elastic_emb.inprocess.interruptible",
        "elastic_emb.inprocess.joiners",
    ),
    ("elastic_emb.lifecycle.records", "elastic_emb.lifecycle.first_base", "elastic_emb.lifecycle.default_group"),
    ("elastic_emb.lifecycle.committer",),
    ("elastic_emb.lifecycle", "elastic_emb.rdzv"),
    ("elastic_emb.inprocess",),
    ("elastic_emb.lifecycle.loop", "elastic_emb.testing"),
    ("elastic_emb.examples",),
    ("elastic_emb.cli.console",),
    ("elastic_emb.drill",),
    ("elastic_emb.cli", "elastic_emb.__main__"),
]
FACADE = "elastic_emb"  # the package's __init__: re-exports (lazily) from any layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every elastic_emb module ``path`` imports (``from a import b`` counts ``a.b`` when that is a
    module, else ``a``)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "elastic_emb"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] != "elastic_emb":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if _is_module(sub) else base)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _subpackage(name: str) -> str:
    return ".".join(name.split(".")[:2]) if name.count(".") >= 2 else "elastic_emb"


def layer_of(name: str) -> tuple[int, str] | None:
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (name == n or name.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    return best


def test_every_module_has_a_layer():
    missing = [
        module_name(p) for p in PACKAGE.rglob("*.py") if module_name(p) != FACADE and layer_of(module_name(p)) is None
    ]
    assert missing == [], f"declare the layer of {missing} in tests/test_layers.py"


def test_no_import_runs_upward():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        if here == FACADE:
            continue
        mine = layer_of(here)
        if mine is None:
            continue
        for dep in sorted(imports(path)):
            theirs = layer_of(dep)
            if dep == FACADE or theirs is None or dep == here:
                continue
            # siblings inside one sub-package (context/*, rdzv/*) may import each other
            same_unit = mine[1] == theirs[1] or _subpackage(here) == _subpackage(dep) != "elastic_emb"
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and not same_unit):
                bad.append(f"{here} (layer {mine[0]}: {mine[1]}) imports {dep} (layer {theirs[0]}: {theirs[1]})")
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)
