"""The docs site stays true to the code it documents (issue 34).

- ``mkdocs build --strict`` passes: every page is in the nav, every link and anchor resolves.
- The CLI reference (``docs/reference/cli.md``) is what ``scripts/cli_reference.py`` generates
  from the CLI now: a new command or option without regenerated docs fails, naming the command
  that fixes it.
- Every ``cleanroom SUBCOMMAND --option`` shown in the README or the docs exists in the CLI.
- Every test the docs name (``tests/...py::test_name``, the security model's table) exists.
- The README stays short: the docs site holds the manual.

The Python blocks of the README and the docs run in ``tests/test_readme.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# Commands the docs may name before they exist, each with the page that says it is coming. Once
# the command exists, the test below says to drop it from here and finish its page.
PLANNED: dict[tuple[str, ...], str] = {}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_LANGS = {"", "sh", "bash", "console", "shell", "text"}
COMMAND = re.compile(r"(?<![\w./-])cleanroom((?: [a-z][a-z-]*){1,2})")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_with_strict_checks(tmp_path: Path) -> None:
    """A page missing from the nav, a broken link or anchor, or a bad fence fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "security" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "runnable" not in api, "a runnable marker reached the page: scripts/docs_hooks.py"
    assert '<div class="highlight">' in api


def test_the_cli_reference_is_generated_from_the_cli_now() -> None:
    module = _script()
    committed = module.TARGET.read_text(encoding="utf-8") if module.TARGET.is_file() else ""
    assert committed == module.render(), f"docs/reference/cli.md is stale: run `{module.COMMAND}`"


def test_the_cli_reference_names_every_command() -> None:
    """The generator is not blind: every command path has its heading."""
    module = _script()
    text = module.render()
    commands = module.subcommands()
    assert ("run",) in commands and ("baseline", "build") in commands
    missing = [c for c in commands if f"`cleanroom {' '.join(c)}`" not in text]
    assert missing == []


def _logical_lines(block: str) -> list[str]:
    """A shell block's lines, comments dropped, an indented ``[--opt ...]`` line joined on."""
    lines: list[str] = []
    for raw in block.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()
        if lines and re.match(r"\s+[\[-]", line):
            lines[-1] += " " + line.strip()
        elif line:
            lines.append(line)
    return lines


def _shown_commands() -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(page, words after ``cleanroom``, ``--options`` after them) for each command shown in a
    code span or a shell block of the README or the docs."""
    found = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        code = [
            line
            for m in FENCED.finditer(text)
            if m.group(1).strip() in SHELL_LANGS
            for line in _logical_lines(m.group(2))
        ]
        code += CODE_SPAN.findall(FENCED.sub("", text))
        for snippet in code:
            for m in COMMAND.finditer(snippet):
                rest = snippet[m.end() :].split("cleanroom ")[0]
                options = re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)
                found.append((str(page.relative_to(ROOT)), tuple(m.group(1).split()), options))
    return found


def test_the_scan_sees_commands_in_spans_and_shell_blocks() -> None:
    shown = _shown_commands()
    assert ("README.md", ("doctor",), []) in shown
    assert any(words[:2] == ("baseline", "build") for _, words, _ in shown)
    assert any(words[:1] == ("run",) and "--spares" in opts for _, words, opts in shown)


def test_every_cleanroom_command_the_docs_show_exists_with_its_options() -> None:
    commands = _script().commands()
    groups = {c[:1] for c in commands if len(c) == 2}
    wrong = set()
    for page, words, options in _shown_commands():
        path = words[:2] if words[:1] in groups else words[:1]
        if path in PLANNED:
            continue
        if path not in commands:
            wrong.add(f"{page}: cleanroom {' '.join(path)}")
            continue
        for option in options:
            if option not in commands[path]:
                wrong.add(f"{page}: cleanroom {' '.join(path)} {option}")
    assert sorted(wrong) == [], "not in the CLI (scripts/cli_reference.py lists what is)"


def test_a_planned_command_is_still_only_planned() -> None:
    commands = _script().subcommands()
    arrived = {c: page for c, page in PLANNED.items() if c in commands}
    assert arrived == {}, (
        f"{arrived}: the command exists now; drop it from PLANNED in tests/test_docs.py and "
        "replace its placeholder page with the real one"
    )


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_every_test_the_docs_name_exists() -> None:
    named = {(m.group(1), m.group(2)) for p in _pages() for m in TEST_REF.finditer(p.read_text())}
    assert len(named) >= 30, "the security model names the test behind each promise"
    missing = [
        f"{file}::{name}"
        for file, name in sorted(named)
        if not (ROOT / file).is_file() or name not in _functions(ROOT / file)
    ]
    assert missing == []


@pytest.mark.parametrize("promise", range(1, 10))
def test_the_security_model_names_a_test_or_a_gap_for_each_promise(promise: int) -> None:
    rows = [
        line
        for line in (DOCS / "security.md").read_text(encoding="utf-8").splitlines()
        if line.startswith(f"| {promise}. ")
    ]
    assert len(rows) == 1
    assert TEST_REF.search(rows[0]), f"promise {promise} names no test"


def test_the_readme_stays_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail to docs/"


def test_the_readmes_two_commands_are_make_targets() -> None:
    readme = README.read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test", "docs"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"no `{target}:` in the Makefile"


def test_the_demo_runs_as_many_episodes_as_the_readme_says() -> None:
    readme = README.read_text(encoding="utf-8")
    said = re.search(r"runs its (\d+) episodes", readme)
    assert said is not None
    manifests = (ROOT / "examples" / "cartpole" / "manifests.jsonl").read_text(encoding="utf-8")
    assert len([line for line in manifests.splitlines() if line.strip()]) == int(said.group(1))


def test_every_number_in_the_readmes_speed_table_is_on_the_performance_page() -> None:
    """The README quotes the performance page; it never keeps numbers of its own."""
    readme = README.read_text(encoding="utf-8")
    table = readme[readme.index("## How fast") : readme.index("## Documentation")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    numbers = {n for row in rows[1:] for n in re.findall(r"\d+(?:\.\d+)?", row.split("|")[2])}
    assert len(numbers) >= 6
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    missing = sorted(
        n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", page)
    )
    assert missing == [], f"README numbers not on docs/performance.md: {missing}"


def test_every_link_in_the_readme_leads_to_a_file() -> None:
    """The site build checks the docs' links; the README is not part of the site."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    local = [link.split("#")[0] for link in links if "://" not in link and link[0] != "#"]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).exists()] == []
