"""``cleanroom baseline ...``: build, list, inspect, verify, export and import baselines.

Progress and messages go to stderr; stdout carries only the result (a digest, a table, JSON), so
``digest=$(cleanroom baseline build spec.toml | tail -1)`` works. Any ``CleanroomError`` becomes
one line ``error: ...`` on stderr and exit code 2; ``verify`` exits 1 when a baseline drifted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cleanroom.baseline import store
from cleanroom.errors import CleanroomError, ConfigError, DriftError

baseline_app = typer.Typer(
    help="Build, list, inspect and verify baselines (content-addressed VM images).",
    no_args_is_help=True,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def _errors() -> Iterator[None]:
    """Turn a CleanroomError into one clean line on stderr and exit code 2."""
    try:
        yield
    except CleanroomError as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        err.print(f"[red]error:[/red] {lines[0]}", markup=True)
        for line in lines[1:]:
            err.print(line, markup=False)
        raise typer.Exit(2) from None


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _progress() -> Callable[[str, str], None]:
    started = time.monotonic()

    def progress(step: str, detail: str) -> None:
        elapsed = time.monotonic() - started
        err.print(f"[dim]{elapsed:6.1f}s[/dim] [cyan]{step:<9}[/cyan] {detail}", markup=True)

    return progress


@baseline_app.command("build")
def build_cmd(
    spec: Annotated[
        Path | None, typer.Argument(help="path to a baseline.toml (or give --image)")
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            "--image",
            help="build from a container image alone: oci-archive:PATH, docker-archive:PATH, "
            "oci:DIR[:TAG] or docker://REF (its Entrypoint+Cmd is the entrypoint)",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild even if cached")] = False,
    locked: Annotated[
        bool, typer.Option("--locked", help="install exactly what baseline.lock says")
    ] = False,
) -> None:
    """Build a baseline from its spec (cached by spec digest); print its digest last."""
    from cleanroom.baseline.builder import build
    from cleanroom.baseline.image_spec import spec_for_image

    started = time.monotonic()
    with _errors():
        if (spec is None) == (image is None):
            raise ConfigError("give a spec path or --image REF (one of them)")
        path = spec if spec is not None else spec_for_image(str(image))
        baseline = build(path, progress=_progress(), force=force, locked=locked)
    err.print(f"[green]built[/green] {baseline.name} in {time.monotonic() - started:.1f}s")
    out.print(baseline.digest, markup=False)


@baseline_app.command("lock")
def lock_cmd(spec: Annotated[Path, typer.Argument(help="path to a baseline.toml")]) -> None:
    """Build afresh and write what it resolved to baseline.lock beside the spec."""
    from cleanroom.baseline.builder import relock

    with _errors():
        path = relock(spec, progress=_progress())
    out.print(str(path), markup=False)


@baseline_app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(help="digest, prefix or spec path")],
    b: Annotated[str, typer.Argument(help="digest, prefix or spec path")],
) -> None:
    """What changed between two baselines: packages, wheels, kernel, image, files."""
    from cleanroom.baseline.compare import compare

    with _errors():
        changes = compare(store.resolve(a), store.resolve(b))
    for line in changes:
        out.print(line, markup=False)
    if not changes:
        err.print("no differences")


@baseline_app.command("ls")
def ls_cmd() -> None:
    """List the baselines in the local store."""
    with _errors():
        baselines = store.list_baselines()
        table = Table("digest", "name", "kernel", "size", "created", box=None)
        for b in baselines:
            built = store.metadata(b).get("built", {})
            size = sum(c.size for c in b.components)
            table.add_row(b.short, b.name, b.kernel_version, _size(size), built.get("at", "?"))
    if not baselines:
        err.print("no baselines; build one with: cleanroom baseline build SPEC")
        return
    out.print(table)


@baseline_app.command("inspect")
def inspect_cmd(
    ref: Annotated[str, typer.Argument(help="digest, digest prefix (6+) or spec path")],
) -> None:
    """Print a baseline's metadata (baseline.json) as JSON."""
    with _errors():
        baseline = store.resolve(ref)
        data = store.metadata(baseline)
    data["path"] = str(baseline.path)
    out.print(json.dumps(data, indent=2, sort_keys=True), markup=False)


@baseline_app.command("verify")
def verify_cmd(
    ref: Annotated[str, typer.Argument(help="digest, digest prefix (6+) or spec path")],
) -> None:
    """Re-hash every component; exit 0 if intact, 1 (listing the files) if drifted."""
    with _errors():
        try:
            baseline = store.resolve(ref)
            digest, drifted = baseline.digest, store.verify(baseline)
        except DriftError as exc:  # its metadata is unreadable or does not match its name
            digest, drifted = exc.digest, exc.drifted
    if drifted:
        err.print(f"[red]drifted[/red] {digest}", markup=True)
        for name in drifted:
            out.print(name, markup=False)
        raise typer.Exit(1)
    out.print(f"intact {digest}", markup=False)


@baseline_app.command("export")
def export_cmd(
    ref: Annotated[str, typer.Argument(help="digest, digest prefix (6+) or spec path")],
    file: Annotated[Path, typer.Argument(help="the tar file to write")],
) -> None:
    """Write a baseline (re-hashed first) to one tar file: baseline.json + its components."""
    from cleanroom.baseline.transfer import export_baseline

    with _errors():
        baseline = export_baseline(ref, file)
    err.print(f"exported {baseline.name} ({_size(file.stat().st_size)}) to {file}")
    out.print(baseline.digest, markup=False)


@baseline_app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(help="a tar file written by `baseline export`")],
) -> None:
    """Verify every sha256 and the digest, then install (idempotent); print the digest."""
    from cleanroom.baseline.transfer import import_baseline

    with _errors():
        result = import_baseline(file)
    state = "already present" if result.already_present else "imported"
    err.print(f"{state}: {result.baseline.name} {result.baseline.short}")
    out.print(result.baseline.digest, markup=False)
