"""The package structure: no import cycle among the project's modules, counting the imports made inside
functions (``TYPE_CHECKING`` blocks aside), and a config that reads without loading the kernels."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from model.testing.tiny import toy_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("triton_kernels", "model", "engine", "autotune", "benchmarks", "ascend_gate")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (a ``from a import b`` names ``a.b``
    when that is a module, else ``a``); a package's ``__init__`` counts as the package."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                base = base.strip(".")
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_deferred_import(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    modules = {"a": a, "b": b}
    graph = {m: imported(m, p, modules) for m, p in modules.items()}
    assert find_cycle(graph) is None
    b.write_text("def f():\n    import a\n")
    graph = {m: imported(m, p, modules) for m, p in modules.items()}
    assert find_cycle(graph) == ["a", "b", "a"]


def test_no_import_cycle() -> None:
    modules = project_modules()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert find_cycle(graph) is None


def test_reading_a_config_loads_no_kernel() -> None:
    """``import model.config`` loads no ``triton_kernels`` module, and parsing a config no Triton."""
    script = """
import json, sys
import model.config
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton_kernels", "triton"))
assert not loaded, f"import model.config loaded {loaded}"
model.config.ModelConfig.from_dict(json.loads(sys.argv[1]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "triton")
assert not loaded, f"parsing a config loaded {loaded}"
"""
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(toy_config("v41"))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
