"""``cleanroom keys export-public``, ``cleanroom audit verify|seal`` and ``cleanroom replay``.

Exit codes of ``audit verify``: 0 every link holds; 1 a link is broken (the first is named);
2 bad input (no such run, an unreadable key). Of ``replay``: 0 identical, 1 diverged, 2 bad
input.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cleanroom.checks.audit import verify_run
from cleanroom.checks.replay import replay
from cleanroom.errors import CleanroomError, EvidenceError
from cleanroom.evidence import keys
from cleanroom.evidence.seal import seal_run
from cleanroom.ledger import Ledger
from cleanroom.store import open_store

keys_app = typer.Typer(help="The ed25519 key that signs this home's attestations.")


def _fail(exc: CleanroomError) -> typer.Exit:
    print(f"error: {exc}", file=sys.stderr)
    return typer.Exit(2)


@keys_app.command("export-public")
def export_public(
    key: Annotated[
        Path | None,
        typer.Option(help="the signing key (default: $CLEANROOM_SIGNING_KEY, else the home's)"),
    ] = None,
) -> None:
    """Print the public key (PEM) that verifies this home's attestations (made on first use)."""
    try:
        public = keys.signing_key(key).public_key()
    except CleanroomError as exc:
        raise _fail(exc) from exc
    sys.stdout.write(keys.public_pem(public).decode())
    print(f"# keyid {keys.key_id(public)}", file=sys.stderr)


audit_app = typer.Typer(
    help="Verify a run's evidence: signatures, digests, the ledger chain, destroyed envs.",
    no_args_is_help=True,
)


def _trusted(public_keys: list[Path] | None) -> list[Ed25519PublicKey]:
    """The keys to trust: those given, else this home's own (never made here)."""
    if public_keys:
        return [keys.load_public(p) for p in public_keys]
    path = keys.signing_key_path()
    if not path.exists():
        raise EvidenceError(
            f"no key at {path}: pass --public-key FILE (cleanroom keys export-public)"
        )
    return [keys.load_private(path).public_key()]


@audit_app.command("verify")
def verify(
    run_id: Annotated[str, typer.Argument(help="the run to verify")],
    store: Annotated[
        str | None, typer.Option(help="store folder or fsspec URL (a copy will do)")
    ] = None,
    public_key: Annotated[
        list[Path] | None,
        typer.Option(help="trusted public key, PEM (repeat for several; default: this home's)"),
    ] = None,
) -> None:
    """Check every signature, every digest, the chain, every env's absence; exit 0, or 1
    naming the first broken link."""
    try:
        trusted = _trusted(public_key)
        report = verify_run(open_store(store), run_id, trusted)
    except CleanroomError as exc:
        raise _fail(exc) from exc
    if report.ok:
        print(
            f"ok: run {run_id}: {report.records} records, {report.envs} envs, "
            f"{report.events} chained events; every link holds"
        )
        return
    print(f"BROKEN: run {run_id}: {report.problems[0]}")
    for more in report.problems[1:]:
        print(f"  also: {more}")
    raise typer.Exit(1)


@audit_app.command("seal")
def seal(
    run_id: Annotated[str, typer.Argument(help="the run whose ledger chain to seal")],
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
) -> None:
    """Write the run's ledger chain and its signed head to the store now (a run's end and
    ``reap`` do it; a session's run, or one whose seal failed, can be sealed by hand)."""
    try:
        with Ledger() as ledger:
            if ledger.get_run(run_id) is None:
                raise EvidenceError(f"no run {run_id!r} in this home's ledger")
            count, head = seal_run(ledger, open_store(store), run_id)
    except CleanroomError as exc:
        raise _fail(exc) from exc
    print(f"sealed run {run_id}: {count} events, head {head}")


def replay_command(
    episode_id: Annotated[str, typer.Argument(help="the episode to replay")],
    run_id: Annotated[str, typer.Option(help="the run it belongs to")],
    store: Annotated[str | None, typer.Option(help="store folder or fsspec URL")] = None,
    driver: Annotated[
        str | None, typer.Option(help="qemu | gvisor | fake (default: the one it ran on)")
    ] = None,
) -> None:
    """Run an episode again in a fresh env from the same baseline: a session's transcript step
    by step (exit codes, output digests), a batch episode's manifest (its deterministic
    record fields). Exit 0 identical, 1 diverged (the first step that differs is named)."""
    try:
        report = asyncio.run(replay(run_id, episode_id, store=store, driver=driver))
    except CleanroomError as exc:
        raise _fail(exc) from exc
    for step in report.steps:
        mark = {True: "same", False: "DIFFERS", None: "-"}[step.same]
        print(f"{step.step:>4} {step.op:<16} {mark:<8} {step.detail}")
    where = report.diverged_at
    if where is None:
        print(f"identical: {report.kind} {episode_id} replayed as run {report.replay_run_id}")
        return
    print(f"diverged at step {where.step} ({where.op}): {where.detail}")
    raise typer.Exit(1)
