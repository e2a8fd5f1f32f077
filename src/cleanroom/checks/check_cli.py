"""``cleanroom check ...``: checks anyone can run against a driver, a baseline or a run.

- ``isolation``: canaries planted by one episode must be invisible to the next (three
  variants) and nothing may be left on the host; a canary x variant table and a JSON report.
- ``repro``: the same manifests N times in fresh envs must give the same result records.
- ``provenance``: every durable record of a run carries every provenance field.

Exit codes: 0 the check passed; 1 it failed (a leak, a difference, a missing field); 2 bad
input (baseline, manifest, driver); 130 cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cleanroom.errors import CleanroomError

check_app = typer.Typer(
    help="Checks: isolation between episodes, reproducibility, provenance.",
    no_args_is_help=True,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
STYLE = {"PASS": "green", "FAIL": "bold red", "BLIND": "bold red", "ERROR": "bold red"}
T = TypeVar("T")


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except CleanroomError as exc:
        err.print(f"[bold red]error:[/] {exc}", markup=True)
        raise typer.Exit(2) from None


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        err.print("[yellow]cancelled[/]: every env was destroyed")
        raise typer.Exit(130) from None


def _write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
        err.print(f"json report: {path}")


@check_app.command("isolation")
def isolation_cmd(
    baseline: Annotated[
        str, typer.Option(help="digest, unique prefix, name, or spec (.toml or its folder)")
    ],
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake | auto")] = "qemu",
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
    variant: Annotated[
        list[str] | None, typer.Option(help="sequential | concurrent | recovery (repeatable)")
    ] = None,
    details: Annotated[bool, typer.Option(help="show every cell's evidence")] = False,
) -> None:
    """Plant canaries in one env, look for them from the next; exit 1 on any leak."""
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.checks.isolation import VARIANTS, IsolationCheck
    from cleanroom.drivers import get_driver
    from cleanroom.ledger import Ledger

    with _errors():
        resolved = resolve_or_build(baseline)
        chosen = get_driver(driver)
        with Ledger() as ledger:
            check = IsolationCheck(chosen, resolved, ledger, variants=tuple(variant or VARIANTS))
            err.print(f"checking isolation of {resolved.short} on {chosen.name} ({check.check_id})")
            report = _run(check.run())
    print_isolation(report.to_json(), details=details)
    _write_json(json_out, report.to_json())
    if not report.ok:
        raise typer.Exit(1)


def print_isolation(report: dict[str, Any], *, details: bool = False) -> None:
    """The canary x variant table, the problems, and the host audit."""
    from cleanroom.checks.isolation import ROWS

    variants = report["variants"]
    facts = report["driver"]
    title = (
        f"isolation: driver {facts.get('driver')}, accelerator {facts.get('accelerator', '?')}, "
        f"isolation class {facts.get('isolation', '?')}"
    )
    table = Table("canary", *(v["name"] for v in variants), title=title)
    for row in ROWS:
        cells = []
        for v in variants:
            cell = v["cells"].get(row, {"status": "-", "detail": ""})
            text = cell["status"] + (f" {cell['detail']}" if details else "")
            cells.append(Text(text, style=STYLE.get(cell["status"], "yellow")))
        table.add_row(row, *cells)
    out.print(table)
    for v in variants:
        if v["error"]:
            out.print(f"[bold red]{v['name']}[/]: {v['error']}", markup=True)
        for row, cell in v["cells"].items():
            if cell["status"] in ("FAIL", "BLIND") and not details:
                out.print(f"[red]{v['name']} {row}[/]: {cell['detail']}", markup=True)
    if report["leftovers"]:
        out.print(f"[bold red]host audit: {len(report['leftovers'])} leftover(s)[/]", markup=True)
        for item in report["leftovers"]:
            action = f" ({item['action']})" if item["action"] else ""
            out.print(f"  {item['kind']}: {item['what']}{action}", markup=False)
    else:
        out.print("host audit: nothing of the check's envs is left on the host")
    verdict = "[green]PASS[/]" if report["ok"] else "[bold red]FAIL[/]"
    out.print(
        f"isolation {verdict} in {report['seconds']:.1f}s ({report['check_id']})", markup=True
    )


@check_app.command("repro")
def repro_cmd(
    manifests: Annotated[Path, typer.Argument(help="JSON Lines manifests")],
    baseline: Annotated[
        str, typer.Option(help="digest, unique prefix, name, or spec (.toml or its folder)")
    ],
    repeat: Annotated[int, typer.Option(min=2, max=1000, help="runs to compare")] = 3,
    episode: Annotated[
        list[str] | None, typer.Option(help="only these episode ids (repeatable)")
    ] = None,
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake | auto")] = "qemu",
    parallel: Annotated[int, typer.Option(min=1, max=64, help="runs at once")] = 1,
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
    ignore: Annotated[
        list[str] | None,
        typer.Option(help="also leave out this field (dotted path, glob; repeatable)"),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(help="compare only this field, e.g. reward or info.* (glob; repeatable)"),
    ] = None,
) -> None:
    """Run manifests N times, each in fresh envs; print the record fields that differ.

    Left out always: identities, durations (timings, logs, provenance.*_s) and how each env
    was started (spare, snapshot, fork, cold; the host)."""
    from cleanroom.baseline.resolve import resolve_or_build
    from cleanroom.batch.runner import Controller
    from cleanroom.checks.repro import fields, run_repro
    from cleanroom.drivers import get_driver
    from cleanroom.errors import ManifestError
    from cleanroom.evidence.manifest import load_manifests
    from cleanroom.ledger import Ledger
    from cleanroom.store import open_store

    with _errors():
        which = fields(ignore, only)
        items = load_manifests(manifests)
        if episode:
            items = [m for m in items if m.episode_id in set(episode)]
            if not items:
                raise ManifestError(f"{manifests}: none of {episode} is in the file")
        resolved = resolve_or_build(baseline)
        with Ledger() as ledger:
            controller = Controller(get_driver(driver), ledger, open_store(store))
            report = _run(
                run_repro(
                    controller, items, resolved, repeat=repeat, parallel=parallel, which=which
                )
            )
    data = report.to_json()
    print_repro(data)
    _write_json(json_out, data)
    if not report.ok:
        raise typer.Exit(1)


def print_repro(report: dict[str, Any]) -> None:
    runs = report["run_ids"]
    for ep in report["episodes"]:
        if ep["identical"]:
            out.print(
                f"[green]identical[/] {ep['episode_id']}: {ep['fields_compared']} fields, "
                f"{len(runs)} runs ({', '.join(sorted(set(ep['outcomes'])))})",
                markup=True,
            )
            continue
        out.print(f"[bold red]differs[/] {ep['episode_id']}", markup=True)
        if ep["fields_compared"] == 0 and not ep["missing"]:
            out.print(f"  no field compared: --only {report['only']} matched none", markup=False)
        for run_id in ep["missing"]:
            why = ep["errors"][runs.index(run_id)] or ep["outcomes"][runs.index(run_id)]
            out.print(f"  no durable record in {run_id}: {why}", markup=False)
        if ep["differing"]:
            table = Table("field", *(r.rsplit("-", 1)[-1] for r in runs), box=None)
            for path, values in ep["differing"].items():
                table.add_row(path, *(json.dumps(v, default=str)[:40] for v in values))
            out.print(table)
    verdict = "[green]PASS[/]" if report["ok"] else "[bold red]FAIL[/]"
    out.print(f"repro {verdict}: runs {', '.join(runs)}", markup=True)


@check_app.command("provenance")
def provenance_cmd(
    run_id: Annotated[str, typer.Argument(help="the run whose records to check")],
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """Check that every durable record of a run carries every provenance field."""
    from cleanroom.evidence import provenance
    from cleanroom.store import open_store

    with _errors():
        records = open_store(store).list_records(run_id)
    if not records:
        err.print(f"[red]error:[/] no durable records in run {run_id!r}", markup=True)
        raise typer.Exit(2)
    bad = {r["episode_id"]: provenance.missing(r) for r in records}
    bad = {eid: fields for eid, fields in bad.items() if fields}
    for eid, fields in sorted(bad.items()):
        out.print(f"[red]{eid}[/]: missing {', '.join(fields)}", markup=True)
    count = len(provenance.REQUIRED)
    out.print(f"{len(records) - len(bad)}/{len(records)} records carry all {count} fields")
    if bad:
        raise typer.Exit(1)
