"""No module of cleanroom imports (even lazily, under TYPE_CHECKING, or through
``importlib.import_module``) a module that imports it back: layers import only downward. A cycle
fails here with its members named."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cleanroom"


def _module(path: Path, package_dir: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic(node: ast.AST) -> list[str]:
    """The module an ``importlib.import_module("a.b")`` (or bare ``import_module``) call names."""
    if not isinstance(node, ast.Call) or not node.args:
        return []
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = node.args[0]
    if name == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return [first.value]
    return []


def _graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_module(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = _dynamic(node)
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_check_sees_a_cycle() -> None:
    """The detector itself: a two-module loop and a lazy import both count."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    assert len(_graph()) > 50  # it read the package


def test_an_import_module_call_is_an_import(tmp_path: Path) -> None:
    """``importlib.import_module("pkg.b")`` inside a function hides nothing (sessions/core once
    reached sessions/fork that way, to dodge this check)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text(
        "import importlib\n\ndef later():\n    return importlib.import_module('pkg.a')\n"
    )
    assert _cycles(_graph(package)) == [["pkg.a", "pkg.b"]]
