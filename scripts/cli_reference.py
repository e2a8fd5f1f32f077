"""Write docs/reference/cli.md from the CLI itself, so the reference is never hand-kept.

    .venv/bin/python scripts/cli_reference.py           # (re)write docs/reference/cli.md
    .venv/bin/python scripts/cli_reference.py --check   # exit 1 if the committed file is stale

Typer builds the CLI on its own copy of click, so commands and parameters are read by what they
have (``list_commands``, ``param_type_name``), not by click's classes. ``tests/test_docs.py`` runs
``render()`` and compares it with the committed file: a command, an
option or a help text changed without rerunning this script fails the suite, naming this command.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import typer.main

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "reference" / "cli.md"
COMMAND = ".venv/bin/python scripts/cli_reference.py"


def _is_group(command: Any) -> bool:
    return hasattr(command, "list_commands")


def _text(help_text: str | None) -> str:
    """A command's help as Markdown paragraphs (click's ``\\b`` no-rewrap markers dropped)."""
    lines = inspect.cleandoc(help_text or "").replace("\b\n", "").splitlines()
    return "\n".join(line.rstrip() for line in lines).strip()


def _usage(command: Any, path: str) -> str:
    pieces = [path]
    if any(p.param_type_name == "option" for p in command.params):
        pieces.append("[OPTIONS]")
    for param in command.params:
        if param.param_type_name == "argument":
            name = (param.name or "arg").upper()
            name += "..." if param.nargs == -1 else ""
            pieces.append(name if param.required else f"[{name}]")
    if _is_group(command):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def _cell(text: str) -> str:
    return " ".join(text.split())


def _command(command: Any, ctx: Any, level: int) -> list[str]:
    path = ctx.command_path
    out = [f"{'#' * level} `{path}`", ""]
    help_text = _text(command.help)
    if help_text:
        out += [help_text, ""]
    out += ["```text", _usage(command, path), "```", ""]
    records = [(p, p.get_help_record(ctx)) for p in command.params]
    rows = [(p, r) for p, r in records if r is not None]
    if rows:
        for param, (names, what) in rows:
            kind = "argument" if param.param_type_name == "argument" else "option"
            desc = _cell(what) if what else ""
            out.append(f"- `{names}` ({kind}){': ' + desc if desc else ''}")
        out.append("")
    if _is_group(command):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            out += _command(sub, sub.context_class(sub, info_name=name, parent=ctx), level + 1)
    return out


def root() -> Any:
    """The ``cleanroom`` command as click sees it."""
    from cleanroom.cli import app

    group = typer.main.get_command(app)
    return group


def render() -> str:
    """The whole reference page, as this checkout's CLI defines it now."""
    group = root()
    head = [
        "# CLI reference",
        "",
        "<!-- Generated from src/cleanroom/cli.py by scripts/cli_reference.py: do not edit;",
        f"     rerun `{COMMAND}` after changing a command. -->",
        "",
        "Every `cleanroom` command, its arguments and options, with the help the CLI itself prints",
        "(`cleanroom COMMAND --help`). Generated from the CLI, checked by the suite.",
        "",
    ]
    body = _command(group, group.context_class(group, info_name="cleanroom"), 2)
    return "\n".join(head + body).rstrip() + "\n"


def commands() -> dict[tuple[str, ...], set[str]]:
    """Every command path below ``cleanroom`` (``("run",)``, ``("baseline", "build")``, ...) with
    the option names it takes (``--parallel``, ``--no-allow-baseline-change``, ``--help``)."""
    found: dict[tuple[str, ...], set[str]] = {}

    def walk(command: Any, ctx: Any, path: tuple[str, ...]) -> None:
        if not _is_group(command):
            return
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
                found[(*path, name)] = {
                    opt
                    for param in sub.get_params(sub_ctx)
                    for opt in (*param.opts, *param.secondary_opts)
                    if opt.startswith("-")
                }
                walk(sub, sub_ctx, (*path, name))

    group = root()
    walk(group, group.context_class(group, info_name="cleanroom"), ())
    return found


def subcommands() -> set[tuple[str, ...]]:
    """Every command path below ``cleanroom``: ``("run",)``, ``("baseline", "build")``, ..."""
    return set(commands())


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.is_file() or TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
