"""The house rules, checked from the source alone (ast and tokens, nothing executed).

* Imports flow one way, `experiments -> train -> models -> {kda, moe} -> core`: no package imports
  one above it, and `kda` and `moe` import nothing of each other.
* Code never narrates its history: no ISO date, commit hash or `../shared` citation in a comment
  or docstring of a library file (tests may name dates as data).
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# The packages each package may import, besides itself.
ALLOWED_IMPORTS = {
    "core": set(),
    "kda": {"core"},
    "moe": {"core"},
    "models": {"core", "kda", "moe"},
    "train": {"core", "kda", "moe", "models"},
    "experiments": {"core", "kda", "moe", "models", "train"},
}
PROJECT = set(ALLOWED_IMPORTS) | {"tests"}

ISO_DATE = re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")
# A commit reference: 7 to 40 hex digits with at least one letter and one digit, as a word.
COMMIT = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/.-])")
SHARED = re.compile(r"\.\./shared\b|shared/reference")


def library_files():
    return sorted(p for package in ALLOWED_IMPORTS for p in (REPO / package).rglob("*.py"))


def imported_packages(path: pathlib.Path, root: pathlib.Path):
    """(line, top-level package) of every project import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [package] if node.level else [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in PROJECT:
                yield node.lineno, top


def comments_and_docstrings(path: pathlib.Path):
    """(line, text) of every comment and docstring in `path`."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)


def upward_imports(paths, root=REPO):
    found = []
    for path in paths:
        package = path.relative_to(root).parts[0]
        for line, top in imported_packages(path, root):
            if top != package and top not in ALLOWED_IMPORTS[package]:
                found.append(f"{path.relative_to(root)}:{line} imports {top}")
    return found


def history_references(paths, root=REPO):
    found = []
    for path in paths:
        for line, text in comments_and_docstrings(path):
            for pattern in (ISO_DATE, COMMIT, SHARED):
                for match in pattern.finditer(text):
                    found.append(f"{path.relative_to(root)}:{line}: {match.group(0)!r}")
    return found


def test_imports_flow_one_way():
    assert upward_imports(library_files()) == []


def test_no_dates_commit_hashes_or_shared_citations_in_library_comments():
    assert history_references(library_files()) == []


@pytest.mark.parametrize("source, package, expected", [
    ("from models.sharding import constrain\n", "kda", ["kda/bad.py:1 imports models"]),
    ("import train.step\n", "models", ["models/bad.py:1 imports train"]),
    ("from kda import chunked\n", "moe", ["moe/bad.py:1 imports kda"]),
    ("def f():\n    from experiments import profiling\n", "train",
     ["train/bad.py:2 imports experiments"]),
    ("from core.sharding import constrain\nimport jax\n", "kda", []),
])
def test_the_import_check_catches_an_upward_import(tmp_path, source, package, expected):
    (tmp_path / package).mkdir()
    (tmp_path / package / "bad.py").write_text(source)
    assert upward_imports([tmp_path / package / "bad.py"], tmp_path) == expected


@pytest.mark.parametrize("source, flagged", [
    ('"""Measured on 2026-11-30."""\n', True),
    ("x = 1  # since c6b6cd5 the loop is fused\n", True),
    ('"""See ../shared/reference/kda.md."""\n', True),
    ('"""Chunks of 64 tokens; 0x7f masks; deadline 20 min."""\n', False),
    ("x = 1  # the 128-byte TMA alignment\n", False),
    ('x = "2026-11-30"\n', False),  # data, not a comment
])
def test_the_history_check_catches_dates_hashes_and_shared(tmp_path, source, flagged):
    (tmp_path / "kda").mkdir()
    (tmp_path / "kda" / "bad.py").write_text(source)
    assert bool(history_references([tmp_path / "kda" / "bad.py"], tmp_path)) == flagged
