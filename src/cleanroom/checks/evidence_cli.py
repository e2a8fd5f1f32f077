"""``cleanroom keys export-public``, ``cleanroom audit verify`` and ``cleanroom replay``.

Exit codes of ``audit verify``: 0 every link holds; 1 a link is broken (the first is named);
2 bad input (no such run, an unreadable key).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cleanroom.errors import CleanroomError
from cleanroom.evidence import keys

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
