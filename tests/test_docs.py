"""The README and docs/ name only what exists.

Every repository path they name (in code or as a relative Markdown link, with its #anchor), every
``python -m`` module, every ``elastic_emb.x.y`` module, every ``elastic-emb`` command, every
``make`` target and every ``ELASTIC_EMB_*`` variable; docs/ARCHITECTURE.md's module map is the
layer order of tests/test_layers.py; the README's Python compiles and imports only the public API.
Placeholders (``<...>``, ``{...}``, ``DIR``), URLs, and paths outside the repository (``/tmp``,
``runs/``) are not checked. Pure text checks: nothing is run.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

import elastic_emb
from elastic_emb import config

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "elastic_emb"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
IDS = [str(p.relative_to(REPO)) for p in PAGES]

# Top-level folders whose paths the pages may name, anywhere in the text.
ROOTS = ("elastic_emb", "tests", "bench", "examples", "deploy", "docs", "scripts", ".ci")
ROOTED_PATH = re.compile(r"(?<![\w./~$@:-])((?:%s)/[\w.*/+-]*)" % "|".join(re.escape(r) for r in ROOTS))
# A code span that is one file name, perhaps relative to elastic_emb/ (``rdzv/handler.py``).
FILE_SPAN = re.compile(r"^([\w./-]+\.(?:py|md|ya?ml|sh|cpp|toml|txt))(?::\d[\d, -]*)?$")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PYTHON_M = re.compile(r"(?<![\w-])python3?\s+-m\s+([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"(?<![\w./-])elastic_emb(?:\.[A-Za-z_]\w*)+")
COMMAND = re.compile(r"(?<![\w./:-])elastic-emb(?:\s+--debug)?[ \t]+([a-z][a-z0-9-]*)")
MAKE = re.compile(r"(?<![\w./-])make[ \t]+([a-z][\w-]*)")
VARIABLE = re.compile(r"ELASTIC_EMB_[A-Z][A-Z_]*[A-Z]")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")


class Page:
    """A Markdown page split into fenced code, inline code spans and prose (with line numbers)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()
        self.fences = [(m.group(1), m.start(1)) for m in FENCE.finditer(self.text)]
        rest = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), self.text)  # keeps the offsets
        self.spans = [(m.group(1), m.start(1)) for m in SPAN.finditer(rest)]
        self.prose = rest

    def line(self, offset: int) -> str:
        return f"{self.path.relative_to(REPO)}:{self.text.count(chr(10), 0, offset) + 1}"

    def code(self):
        """(text, offset) of every fenced block and code span."""
        return [*self.fences, *self.spans]

    def everything(self):
        return [*self.fences, (self.prose, 0)]


@cache
def page(path: Path) -> Page:
    return Page(path)


def _placeholder(token: str) -> bool:
    return any(c in token for c in "<>{}$") or "..." in token or bool(re.search(r"(^|/)[A-Z][A-Z_]+(/|$|\.)", token))


def _exists(token: str, *bases: Path) -> bool:
    for base in bases:
        if any(c in token for c in "*?["):
            if any(base.glob(token)):
                return True
        elif (base / token).exists():
            return True
    return False


@cache
def _repo_file_names() -> frozenset[str]:
    names = set()
    for root in ("elastic_emb", "tests", "bench", "examples", "scripts", "deploy", "docs"):
        names |= {p.name for p in (REPO / root).rglob("*") if p.is_file()}
    return frozenset(names | {p.name for p in REPO.iterdir() if p.is_file()})


def _offsets(text: str, start: int, pattern: re.Pattern):
    for m in pattern.finditer(text):
        yield m, start + m.start()


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_repository_path_named_exists(path):
    p = page(path)
    missing = []
    seen = set()
    for text, start in p.everything():
        for m, at in _offsets(text, start, ROOTED_PATH):
            token = m.group(1).split("::")[0].rstrip(".,;:")
            if _placeholder(token) or (token, at) in seen:
                continue
            seen.add((token, at))
            if not _exists(token, REPO):
                missing.append(f"{p.line(at)}: {token}")
    for text, start in p.spans:
        m = FILE_SPAN.match(text.strip())
        if not m or m.group(1).startswith((*ROOTS, "/", "~")) or _placeholder(m.group(1)):
            continue
        token = m.group(1)
        if "/" in token:
            found = _exists(token, REPO, PACKAGE, path.parent)
        else:
            found = _exists(token, REPO, path.parent, REPO / "docs") or (
                token.endswith((".py", ".cpp", ".sh")) and token in _repo_file_names()
            )
        if not found:
            missing.append(f"{p.line(start)}: {token}")
    assert missing == [], "paths that do not exist:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    found: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), re.M):
        slug = _slug(m.group(1))
        n = found.get(slug)
        found[slug] = 0 if n is None else n + 1
        if n is not None:
            found[f"{slug}-{n + 1}"] = 0
    return frozenset(found)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_relative_link_resolves(path):
    p = page(path)
    bad = []
    for m, at in _offsets(p.prose, 0, LINK):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{p.line(at)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{p.line(at)}: {target} (no heading #{anchor} in {dest.name})")
    assert bad == [], "broken links:\n" + "\n".join(bad)


def _module_exists(name: str) -> bool:
    rel = Path(*name.split("."))
    return (REPO / rel).with_suffix(".py").is_file() or (REPO / rel / "__init__.py").is_file()


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_python_m_module_exists(path):
    p = page(path)
    bad = []
    for text, start in p.everything():
        for m, at in _offsets(text, start, PYTHON_M):
            name = m.group(1).rstrip(".")
            if name.split(".")[0] == "elastic_emb":
                rel = Path(*name.split("."))
                ok = (REPO / rel).with_suffix(".py").is_file() or (REPO / rel / "__main__.py").is_file()
            else:
                ok = importlib.util.find_spec(name.split(".")[0]) is not None
            if not ok:
                bad.append(f"{p.line(at)}: python -m {name}")
    assert bad == [], "`python -m` of modules that do not exist (or cannot run):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_elastic_emb_module_named_exists(path):
    """``elastic_emb.a.b.Name``: the longest prefix that is a module exists, and the next name is
    defined there (for the package itself: a name of ``__all__``)."""
    p = page(path)
    bad = []
    for text, start in p.code():
        for m, at in _offsets(text, start, DOTTED):
            parts = m.group(0).split(".")
            depth = max(i for i in range(1, len(parts) + 1) if _module_exists(".".join(parts[:i])))
            if depth == len(parts):
                continue
            attr = parts[depth]
            if depth == 1:
                ok = attr in elastic_emb.__all__ or attr.startswith("__")
            else:
                rel = Path(*parts[:depth])
                source = (REPO / rel).with_suffix(".py")
                source = source if source.is_file() else REPO / rel / "__init__.py"
                ok = re.search(rf"\b{re.escape(attr)}\b", source.read_text()) is not None
            if not ok:
                bad.append(f"{p.line(at)}: {m.group(0)} ({attr} is not in {'.'.join(parts[:depth])})")
    assert bad == [], "names of modules or attributes that do not exist:\n" + "\n".join(bad)


@cache
def _cli_commands() -> frozenset[str]:
    from elastic_emb.cli.main import main

    return frozenset(main.commands)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_cli_command_named_exists(path):
    p = page(path)
    bad = []
    for text, start in p.code():
        for m, at in _offsets(text, start, COMMAND):
            if m.group(1) not in _cli_commands():
                bad.append(f"{p.line(at)}: elastic-emb {m.group(1)}")
    known = ", ".join(sorted(_cli_commands()))
    assert bad == [], f"commands the CLI does not have (it has {known}):\n" + "\n".join(bad)


@cache
def _make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.%/ -]+?)\s*::?(?!=)", text, re.M):
        targets |= set(m.group(1).split())
    return frozenset(targets)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_make_target_named_exists(path):
    p = page(path)
    bad = []
    for text, start in p.code():
        for m, at in _offsets(text, start, MAKE):
            if m.group(1) not in _make_targets():
                bad.append(f"{p.line(at)}: make {m.group(1)}")
    assert bad == [], "make targets the Makefile does not have:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_every_variable_named_is_declared(path):
    p = page(path)
    known = set(config.VARIABLES) | {"ELASTIC_EMB_STATEDIR"}  # the typo the troubleshooting page cites
    bad = sorted({f"{p.line(m.start())}: {m.group(0)}" for m in VARIABLE.finditer(p.text) if m.group(0) not in known})
    assert bad == [], "variables elastic_emb/config.py does not declare:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_no_history(path):
    """The pages say what is, not how it came to be."""
    p = page(path)
    bad = [f"{p.line(m.start())}: {m.group(0)}" for m in re.finditer(r"\b[Ii]ssues? #?\d+", p.text)]
    assert bad == [], "history in the docs (say what holds now):\n" + "\n".join(bad)


def _layers() -> list[tuple[str, ...]]:
    spec = importlib.util.spec_from_file_location("_layers_for_docs", REPO / "tests" / "test_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def test_architecture_module_map_is_the_layer_order():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            rows[int(m.group(1))] = {f"elastic_emb.{n}" for n in re.findall(r"`([\w.]+)`", m.group(2))}
    declared = {i: set(names) for i, names in enumerate(_layers())}
    assert rows == declared, "docs/ARCHITECTURE.md's module map differs from LAYERS in tests/test_layers.py"


def test_readme_python_compiles_and_imports_only_the_public_api():
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)]
    assert blocks, "the README has no Python example"
    bad = []
    for block in blocks:
        tree = ast.parse(block)
        compile(tree, "README.md", "exec")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "elastic_emb":
                if node.module != "elastic_emb":
                    bad.append(f"from {node.module} import ...: import from elastic_emb itself")
                public = elastic_emb.__all__
                bad += [f"{a.name} is not in elastic_emb.__all__" for a in node.names if a.name not in public]
            elif isinstance(node, ast.Import):
                bad += [f"import {a.name}" for a in node.names if a.name.startswith("elastic_emb.")]
    assert bad == [], "the README's Python reaches past the public API: " + "; ".join(bad)
    script = next((b for b in blocks if "Lifecycle.start" in b and "__main__" in b), None)
    assert script is not None, "the README's complete training script is gone"
