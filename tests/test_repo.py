"""Repository rules that keep the code easy to pick up: layering, file sizes, one place for
environment variables, generated docs that are current."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QV = ROOT / "qv"

# data flows server -> engine -> (spec, clef) -> model -> kernels; nothing imports upward. Top-level
# modules are units too: version and errors import nothing, config reads the levers, llm (the server's
# offline twin) may import what the server may, cli and doctor sit on top; the package root ("qv": `import qv`, `from qv import LLM`) re-exports
# LLM, so only the top (cli) may import it.
BASE = {"errors", "version"}
ALLOWED = {
    "kernels": BASE | {"kernels"},
    "model": BASE | {"kernels", "model", "model_config"},  # config.json's names, not the engine's levers
    "spec": BASE | {"kernels", "model", "model_config", "spec"},
    "clef": BASE | {"kernels", "model", "model_config", "clef"},
    "engine": BASE | {"kernels", "model", "config", "model_config", "spec", "clef", "engine"},
    "server": BASE | {"config", "model_config", "engine", "server"},  # the engine offers what it needs
    "bench": BASE | {"kernels", "model", "config", "model_config", "spec", "clef", "engine", "bench", "llm"},
    "version": set(),
    "errors": set(),
    "model_config": {"errors"},
    "config": {"errors", "model_config"},
    "llm": BASE | {"kernels", "model", "config", "model_config", "spec", "clef", "engine"},  # the server's, offline
    "doctor": BASE | {"config", "model_config", "kernels", "engine"},
    "cli": BASE | {"kernels", "model", "config", "model_config", "spec", "clef", "engine", "bench", "llm", "server",
                   "doctor", "qv", "cli_vllm"},
    "cli_vllm": set(),  # vLLM's flag spellings: argparse only
    "qv": BASE | {"llm", "engine"},
}
# the server parses Clef decisions and formats their answers with qv.clef itself; the rest of qv.clef (head,
# adapters, the record encoder's internals) is the engine's
SERVER_CLEF_MODULES = {"qv.clef.request", "qv.clef.answers", "qv.clef.limits"}
# the engine reaches kernels only to sample, to choose kernels at start-up and to see them compile after it
ENGINE_KERNEL_USERS = {"sampler.py", "build.py", "compile_watch.py"}
SOFT_LINES, HARD_LINES, MAX_FUNCTION_LINES = 400, 600, 100
# files allowed past the hard limit, with the reason
SIZE_EXCEPTIONS: dict[str, str] = {}


def _py_files():
    return sorted(p for p in QV.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in _py_files()}


def _known(name: str) -> str:
    """The module (file) that `import name` runs last: name itself, or the nearest package above it."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set[str]:
    """The qv modules `module` imports anywhere in its file (function bodies too: a lazy import is still
    a dependency); `from qv.pkg import name` is the submodule qv.pkg.name where one exists, else qv.pkg."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_known(a.name) for a in node.names if a.name == "qv" or a.name.startswith("qv.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base == "qv" or base.startswith("qv."):
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _known(base) for a in node.names}
    return out - {module}


def _unit(module: str) -> str:
    """The layer a module belongs to: its subpackage, or itself for a top-level module ("qv": the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qv"


def test_layering():
    bad = []
    for module in sorted(MODULES):
        unit = _unit(module)
        assert unit in ALLOWED, f"{module}: add its unit {unit!r} to ALLOWED (which layers it may import)"
        for used in sorted(_imports(module)):
            if _unit(used) not in ALLOWED[unit] and not (unit == "server" and used in SERVER_CLEF_MODULES):
                bad.append(f"{MODULES[module].relative_to(ROOT)} imports {used}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circle():
    """No module reaches itself through imports (Tarjan's strongly connected components)."""
    graph = {m: _imports(m) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(" <-> ".join(sorted(component)))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


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
    assert "python3 -m venv" in ci and "/bin/activate" in ci, ".ci/run must run it in a fresh virtualenv"


def test_engine_reaches_kernels_only_to_sample_and_to_start():
    users = sorted(MODULES[m].name for m in MODULES if _unit(m) == "engine"
                   and any(_unit(i) == "kernels" for i in _imports(m)))
    assert set(users) <= ENGINE_KERNEL_USERS, f"engine modules importing qv.kernels: {users}"


def test_slow_tests_name_existing_tests():
    """Every entry of tests/conftest.py's SLOW_TESTS names a folder, file or test that exists (a renamed test
    would silently join the quick subset)."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())  # by path: each test folder has a conftest
    SLOW_TESTS = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                      and getattr(n.targets[0], "id", "") == "SLOW_TESTS")
    stale = []
    for entry in SLOW_TESTS:
        path, _, name = entry.partition("::")
        target = ROOT / path
        if not target.exists() or (name and f"def {name.split('[')[0]}" not in target.read_text()):
            stale.append(entry)
    assert not stale, f"SLOW_TESTS entries that match no test: {stale}"
