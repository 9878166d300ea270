"""Docstrings are API reference: a short module docstring, and ``Args:``, ``Returns:`` and
``Raises:`` sections on every public function and method that takes arguments, returns a value
or raises. Checked statically with ``ast``; history (issue numbers, who found what) stays in git."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_emb"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 12  # "about ten": a summary line, a blank line, a short paragraph or a list
EXEMPT_DECORATORS = {
    "property",
    "overload",
    "field_validator",
    "model_validator",
    "cached_property",
    "setter",
    "abstractmethod",
}
HISTORY = re.compile(r"\bissue \d+|\bfound by\b|see the module docstring|H200 run", re.IGNORECASE)


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _own_nodes(node: ast.AST):
    """The statements of a function, not those of functions or classes nested in it."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        stack.extend(ast.iter_child_nodes(child))


def _public_functions(tree: ast.Module):
    """(qualified name, node) of every public function and method of public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def missing_sections(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The reference sections ``node``'s docstring lacks."""
    if _decorators(node) & EXEMPT_DECORATORS:
        return []
    doc = ast.get_docstring(node) or ""
    if not doc:
        return ["docstring"]
    args = [
        a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs] if a.arg not in ("self", "cls")
    ]
    if node.args.vararg:
        args.append(node.args.vararg.arg)
    if node.args.kwarg:
        args.append(node.args.kwarg.arg)
    own = list(_own_nodes(node))
    returns = any(
        isinstance(n, ast.Return)
        and n.value is not None
        and not (isinstance(n.value, ast.Constant) and n.value.value is None)
        for n in own
    )
    yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in own)
    raises = any(isinstance(n, ast.Raise) and n.exc is not None for n in own)
    missing = []
    if args and "Args:" not in doc:
        missing.append("Args:")
    if returns and not yields and "Returns:" not in doc:
        missing.append("Returns:")
    if yields and "Yields:" not in doc and "Returns:" not in doc:
        missing.append("Yields:")
    if raises and "Raises:" not in doc:
        missing.append("Raises:")
    return missing


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_docstring_is_a_summary(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert doc, f"{_rel(path)}: no module docstring"
    lines = len(doc.splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{_rel(path)}: module docstring of {lines} lines (at most {MAX_MODULE_LINES}): move the design to docs/"
    )


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_public_functions_document_args_returns_and_raises(path: Path):
    tree = ast.parse(path.read_text())
    bad = [f"{name} lacks {', '.join(m)}" for name, node in _public_functions(tree) if (m := missing_sections(node))]
    assert bad == [], f"{_rel(path)}:\n" + "\n".join(bad)


def test_no_history_in_code():
    bad = [
        f"{_rel(p)}:{i}: {line.strip()}"
        for p in MODULES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert bad == [], "history belongs in git, the design in docs/:\n" + "\n".join(bad)


def test_the_checker_sees_a_missing_section():
    """The rule itself: a function that takes an argument, returns and raises needs all three."""
    tree = ast.parse('def f(x):\n    """Do it."""\n    if x:\n        raise ValueError(x)\n    return x\n')
    assert missing_sections(tree.body[0]) == ["Args:", "Returns:", "Raises:"]
    tree = ast.parse(
        'def f(x):\n    """Do it.\n\n    Args:\n        x: it.\n\n    Returns:\n        x.\n\n'
        '    Raises:\n        ValueError: when x.\n    """\n    if x:\n        raise ValueError(x)\n'
        "    return x\n"
    )
    assert missing_sections(tree.body[0]) == []
