"""Repository rules that keep the code easy to pick up: layering, file sizes, one place for
environment variables, generated docs that are current."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QV = ROOT / "qv"

# data flows server -> engine -> (spec, clef) -> model -> kernels; nothing imports upward
ALLOWED = {
    "kernels": {"kernels", "errors"},
    "model": {"kernels", "model", "config", "errors"},
    "spec": {"kernels", "model", "config", "spec", "errors"},
    "clef": {"kernels", "model", "config", "clef", "errors"},
    "engine": {"kernels", "model", "config", "spec", "clef", "engine", "errors"},
    "server": {"kernels", "model", "config", "spec", "clef", "engine", "server", "llm", "errors"},
    "bench": {"kernels", "model", "config", "spec", "clef", "engine", "bench", "errors", "llm"},
}
SOFT_LINES, HARD_LINES, MAX_FUNCTION_LINES = 400, 600, 100
# files allowed past the hard limit, with the reason
SIZE_EXCEPTIONS: dict[str, str] = {}


def _py_files():
    return sorted(p for p in QV.rglob("*.py") if "__pycache__" not in p.parts)


def _qv_imports(tree: ast.AST) -> set[str]:
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qv.") and node.level == 0:
            mods.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("qv."):
                    mods.add(a.name.split(".")[1])
    return mods


def test_layering():
    bad = []
    for path in _py_files():
        rel = path.relative_to(QV)
        if len(rel.parts) < 2 or rel.parts[0] not in ALLOWED:
            continue
        used = _qv_imports(ast.parse(path.read_text()))
        for mod in sorted(used - ALLOWED[rel.parts[0]]):
            bad.append(f"{rel} imports qv.{mod}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_file_and_function_sizes():
    too_long = []
    for path in _py_files():
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().count("\n")
        if lines > HARD_LINES and rel not in SIZE_EXCEPTIONS:
            too_long.append(f"{rel}: {lines} lines > {HARD_LINES}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines > {MAX_FUNCTION_LINES}")
    assert not too_long, "\n".join(too_long)


def test_environment_read_only_in_config():
    offenders = []
    for path in _py_files():
        if path == QV / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "os.environ/getenv outside qv/config.py: " + ", ".join(offenders)


def test_levers_doc_is_current():
    from qv.config import levers_markdown

    doc = (ROOT / "docs" / "LEVERS.md").read_text()
    assert doc == levers_markdown(), "docs/LEVERS.md is stale: run `python -m qv.config > docs/LEVERS.md`"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if line.strip().startswith("pip install"))
    assert command in readme, f".ci/run's command is not the README's: {command}"
