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
    assert elastic_emb.Lifecycle.__module__ == "elastic_emb.lifecycle"


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
