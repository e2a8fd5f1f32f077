"""Shared pieces of the session tests: the parts of a session, its transcript, its ending."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import RunFolderDriver
from cleanroom.ledger import Ledger
from cleanroom.sessions import AsyncSession
from cleanroom.store import LocalStore
from tests.stored import evidence

from ..vmkit import assert_nothing_left


def folder(store: LocalStore, run_id: str, eid: str = "session") -> Path:
    return Path(store.episode_uri(run_id, eid).removeprefix("file://"))


def steps(store: LocalStore, run_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
    """The durable transcript (the record's, or attempt ``attempt``'s)."""
    base = folder(store, run_id)
    if attempt is not None:
        path = base / "attempts" / str(attempt) / "logs" / "transcript.jsonl"
    else:
        path = evidence(base, "logs", "transcript.jsonl")
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def root(driver: RunFolderDriver, sb: AsyncSession) -> str:
    """Where the env's ``/`` is seen by its commands' file paths ("" in a VM)."""
    prefix = getattr(driver, "guest_prefix", None)
    return str(prefix(sb.episode.env_id)) if prefix is not None else ""


def ended(driver: RunFolderDriver, ledger: Ledger, store: LocalStore, run_id: str) -> str:
    """The one outcome of the run's session, after checking its env is confirmed gone."""
    assert_nothing_left(driver, ledger, run_id, store)
    [row] = ledger.episodes(run_id)
    assert row.outcome is not None
    return row.outcome
