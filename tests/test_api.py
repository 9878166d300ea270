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
    for name in ("Lifecycle", "LifecycleConfig", "EmbContext", "TableSpec", "OptimizerSpec", "Topology", "agree",
                 "Watcher", "ElasticEmbError", "WorldSizeChanged"):
        assert name in elastic_emb.__all__, name
    assert elastic_emb.Lifecycle.__module__ == "elastic_emb.lifecycle.manager"


def test_importing_the_package_imports_no_torch():
    code = "import sys, elastic_emb; elastic_emb.TableSpec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_every_error_is_an_elastic_emb_error_and_a_builtin():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 10
    builtin_errors = {v for v in vars(builtins).values() if isinstance(v, type) and issubclass(v, BaseException)}
    for cls in classes:
        assert issubclass(cls, errors.ElasticEmbError), cls
        if cls is not errors.ElasticEmbError:
            refined = [b for b in cls.__mro__[1:] if b in builtin_errors and b not in (Exception, BaseException)]
            assert refined, f"{cls.__name__} refines no builtin error (ValueError, RuntimeError, ...)"
        assert getattr(elastic_emb, cls.__name__) is cls


def test_every_public_error_class_is_defined_in_errors_py():
    """One hierarchy in one place: an error class defined elsewhere is re-exported, not redefined.
    (Private control-flow exceptions are not API.)"""
    import ast
    from pathlib import Path

    package = Path(elastic_emb.__file__).parent
    names = {n for n in vars(errors) if isinstance(getattr(errors, n), type)}
    builtin_names = {n for n, v in vars(builtins).items() if isinstance(v, type)}
    elsewhere = []
    for path in package.rglob("*.py"):
        if path.name == "errors.py" and path.parent == package:
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
