"""The suite drives the checkout's own cleanroom, never one found on ``PATH`` (issue 14 §1).

On a bare machine only ``.venv/bin`` has a ``cleanroom`` script; a test that spawns ``cleanroom``
by name passes wherever another install happens to be on ``PATH`` and fails everywhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cleanroom

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench", "examples")
SPAWNERS = {"run", "Popen", "check_output", "check_call", "call", "create_subprocess_exec"}


def test_the_imported_cleanroom_is_this_checkout() -> None:
    """Protects against a test run that imports an installed cleanroom instead of ``src/``."""
    assert Path(cleanroom.__file__).resolve().is_relative_to(ROOT / "src" / "cleanroom")


def _argv0(call: ast.Call) -> str | None:
    """The program name when a spawn call's argv starts with a string literal."""
    if not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.List | ast.Tuple) and first.elts:
        head = first.elts[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def spawned_by_name(source: str) -> list[tuple[int, str]]:
    """(line, program) for each subprocess call in ``source`` whose argv starts with a literal."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else None
            program = _argv0(node) if name in SPAWNERS else None
            if program is not None:
                out.append((node.lineno, program))
    return out


def test_the_scan_sees_a_cli_spawned_by_name() -> None:
    """The guard below is not blind: it finds the shape of the bug it forbids."""
    source = 'import subprocess\nsubprocess.run(["cleanroom", "run", "m.jsonl"])\n'
    assert spawned_by_name(source) == [(2, "cleanroom")]


def test_no_test_bench_or_example_runs_cleanroom_from_path() -> None:
    """Every CLI call uses ``sys.executable -m cleanroom``: fails on the old
    ``tests/vm/test_lifecycle.py::test_bad_manifest_lines_run_nothing``."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, program in spawned_by_name(path.read_text(encoding="utf-8"))
        if Path(program).name == "cleanroom"
    ]
    assert found == [], f"run the CLI as [sys.executable, '-m', 'cleanroom', ...]: {found}"
