"""The package's surface: the public names at the top level (imported lazily), and one error
hierarchy in elastic_emb.errors."""

from __future__ import annotations

import builtins
import subprocess
import sys

import elastic_emb
from elastic_emb import errors


def test_every_public_name_resolves_from_the_top_level():
    for name in elastic_emb.__all__:
        assert getattr(elastic_emb, name) is not None, name
    for name in (
        "Lifecycle",
        "LifecycleConfig",
        "EmbContext",
        "TableSpec",
        "OptimizerSpec",
        "Topology",
        "agree",
        "Watcher",
        "ElasticEmbError",
        "WorldSizeChanged",
    ):
        assert name in elastic_emb.__all__, name
    assert elastic_emb.Lifecycle.__module__ == "elastic_emb.lifecycle.manager"


def test_importing_the_package_imports_no_torch():
    code = "import sys, elastic_emb; elastic_emb.TableSpec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _error_classes(module) -> dict[str, type]:
    return {
        n: v
        for n, v in vars(module).items()
        if isinstance(v, type)
        and issubclass(v, BaseException)
        and v.__module__ == module.__name__
        and not n.startswith("_")
    }


def test_the_public_errors_are_the_declared_ones_and_refine_a_builtin():
    """Every error errors.py defines for callers is declared public; each is an ElasticEmbError and
    refines the builtin a caller would catch. Internal signals are private names."""
    builtin_errors = {v for v in vars(builtins).values() if isinstance(v, type) and issubclass(v, BaseException)}
    public = {n: v for n, v in _error_classes(errors).items() if not n.startswith("_")}
    assert sorted(public) == sorted(elastic_emb._ERRORS)
    for name, cls in public.items():
        assert issubclass(cls, errors.ElasticEmbError), name
        if cls is not errors.ElasticEmbError:
            refined = [b for b in cls.__mro__[1:] if b in builtin_errors and b not in (Exception, BaseException)]
            assert refined, f"{name} refines no builtin error (ValueError, RuntimeError, ...)"
        assert getattr(elastic_emb, name) is cls


def test_tooling_errors_live_with_their_tooling_and_are_not_public():
    from elastic_emb.drill import errors as drill_errors
    from elastic_emb.testing import conformance, etcd

    tooling = {**_error_classes(drill_errors), **_error_classes(conformance), **_error_classes(etcd)}
    assert sorted(tooling) == ["ConformanceFailure", "DrillError", "EtcdUnavailable", "LossDetected"]
    for name, cls in tooling.items():
        assert issubclass(cls, errors.ElasticEmbError), name
        assert name not in elastic_emb.__all__, name


PUBLIC = {
    # what a training script imports
    "Lifecycle",
    "LifecycleConfig",
    "ResizeEvent",
    "CommitReport",
    "EmbContext",
    "TableSpec",
    "OptimizerSpec",
    "ShardData",
    "ShardedContext",
    "ContextBase",
    "RowRange",
    "Topology",
    "agree",
    "Watcher",
    "InProcessResize",
    "run_elastic",
    "LoopHooks",
    "interruptible_store",
    "worker_store",
    "generation_store",
    "Settings",
    "load_settings",
    "configure_logging",
    "get_logger",
    "bind_topology",
    "ElasticSampler",
    "__version__",
}


def test_the_declared_list_is_the_whole_surface():
    """``__all__`` is exactly the declared surface (a change to it is a change to this test), every
    entry resolves, and none repeats."""
    assert len(elastic_emb.__all__) == len(set(elastic_emb.__all__))
    assert set(elastic_emb.__all__) == PUBLIC | set(elastic_emb._ERRORS)
    for name in elastic_emb.__all__:
        assert getattr(elastic_emb, name) is not None, name


def test_every_error_class_is_defined_in_errors_py_or_its_tooling_module():
    """One hierarchy in one place: an error class defined elsewhere in the library is an error of
    errors.py imported there, or a drill's or test tool's own (elastic_emb/drill/errors.py,
    elastic_emb/testing/)."""
    import ast
    from pathlib import Path

    package = Path(elastic_emb.__file__).parent
    names = {n for n in vars(errors) if isinstance(getattr(errors, n), type)}
    builtin_names = {n for n, v in vars(builtins).items() if isinstance(v, type)}
    allowed = {
        package / "errors.py",
        package / "drill" / "errors.py",
        package / "testing" / "etcd.py",
        package / "testing" / "conformance.py",
    }
    elsewhere = []
    for path in package.rglob("*.py"):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {ast.unparse(b) for b in node.bases}
            # Allowed: a class that joins a declared error to a framework's hierarchy (e.g. torch's
            # RendezvousConnectionError), and click's display class for CLI errors.
            binds = bool(bases & names) and bool(bases - names - builtin_names)
            if node.name in names or any(b.endswith(("Error", "Exception", "Timeout")) for b in bases):
                if bases != {"click.ClickException"} and not (binds and node.name not in names):
                    elsewhere.append(f"{path.relative_to(package)}: class {node.name}({', '.join(sorted(bases))})")
    assert elsewhere == [], "define these in elastic_emb/errors.py and import them: " + "; ".join(elsewhere)


def test_examples_import_only_public_names():
    """What users copy imports what users may import: ``elastic_emb``'s declared names (and the
    examples' own modules), never a private module or name."""
    import ast
    from pathlib import Path

    root = Path(elastic_emb.__file__).resolve().parent.parent
    bad = []
    public_packages = ("elastic_emb.examples", "elastic_emb.adapters")
    for path in sorted([*(root / "examples").rglob("*.py"), *(root / "elastic_emb" / "examples").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elastic_emb"):
                names = [a.name for a in node.names]
                if node.module == "elastic_emb":
                    bad += [f"{path.name}: {n}" for n in names if n not in elastic_emb.__all__]
                elif not node.module.startswith(public_packages):
                    bad.append(f"{path.name}: from {node.module} import {', '.join(names)}")
    assert bad == [], "examples import private names: " + "; ".join(bad)
