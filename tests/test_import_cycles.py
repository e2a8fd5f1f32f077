"""No module of cleanroom imports (even lazily, under TYPE_CHECKING, or through
``importlib.import_module``) a module that imports it back, and imports go down DESIGN §5's
layers but for a named few (docs/architecture.md). A cycle or a new climb fails here with its
members named."""

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


# DESIGN §5's layers, bottom first: a module imports only from its own layer or below.
LAYERS = (
    ("host",),
    ("core",),
    ("agent",),
    ("drivers",),
    ("baseline",),
    ("store", "ledger", "network", "evidence"),
    ("lifecycle",),
    ("batch",),
    ("sessions", "gym"),
    ("server",),
    ("checks", "observe"),
    ("integrations",),
    ("api", "cli"),
)
# The imports that still climb (module -> package above it), each with its reason. The list is
# exact: a new climb fails, and so does one that is gone but still listed (it could come back).
KNOWN_CLIMBS = {
    ("cleanroom.baseline.builder", "evidence"): "a RUN header's size budget (header_budget)",
    ("cleanroom.baseline.spec", "network"): "a spec's allowlist parsed by the network policy",
    ("cleanroom.checks.replay", "api"): "replay runs a recorded episode again through arun",
    ("cleanroom.drivers.base", "network"): "an env's NIC attachment (qemu_args.Attachment)",
    ("cleanroom.drivers.qemu.cmdline", "network"): "the NIC's QEMU arguments",
    ("cleanroom.drivers.gvisor_bundle", "baseline"): "where the agent sits in the image",
    ("cleanroom.server.serving", "integrations"): "serve --ray places sandboxes on Ray nodes",
}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    for rank, names in enumerate(LAYERS):
        if len(parts) > 1 and parts[1] in names:
            return rank
    return None  # the package itself, errors, __main__: outside the order


def _climbs(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for source, targets in graph.items():
        for target in targets:
            below, above = _layer(source), _layer(target)
            if below is not None and above is not None and above > below:
                out.add((source, target.split(".")[1]))
    return out


def test_imports_go_down_the_layers_but_for_the_known_few() -> None:
    """Walking the package from the CLI to the drivers goes down DESIGN §5's layers; the few
    imports that still climb are named here with their reason (docs/architecture.md)."""
    assert _climbs(_graph()) == set(KNOWN_CLIMBS)


def test_the_layer_check_sees_a_climb() -> None:
    """The check itself: a driver importing the batch layer climbs; the reverse does not."""
    graph = {"cleanroom.drivers.x": {"cleanroom.batch.runner"}, "cleanroom.batch.y": set()}
    graph["cleanroom.batch.y"].add("cleanroom.drivers.x")
    assert _climbs(graph) == {("cleanroom.drivers.x", "batch")}
