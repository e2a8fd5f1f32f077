"""The ledger's schema (SQLite DDL, versioned) and its rows as frozen dataclasses."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 3  # 2: runs.locked_at (the run lock); 3: the events' hash chain (chain.py)
QUEUED = "PENDING"

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY, created REAL NOT NULL, finished REAL, status TEXT NOT NULL,
        controller_id TEXT, host TEXT, pid INTEGER, baseline TEXT, driver TEXT,
        parallel INTEGER, meta TEXT NOT NULL DEFAULT '{}', locked_at REAL)""",
    """CREATE TABLE IF NOT EXISTS episodes (
        run_id TEXT NOT NULL, episode_id TEXT NOT NULL, attempt INTEGER NOT NULL,
        state TEXT NOT NULL, outcome TEXT, verdict TEXT, reward REAL, error TEXT, env_id TEXT,
        queued_at REAL NOT NULL, started_at REAL, ended_at REAL,
        PRIMARY KEY (run_id, episode_id, attempt))""",
    """CREATE TABLE IF NOT EXISTS envs (
        env_id TEXT PRIMARY KEY, run_id TEXT, episode_id TEXT, attempt INTEGER, driver TEXT,
        accelerator TEXT, owner_controller TEXT, owner_pid INTEGER, owner_host TEXT,
        intent_at REAL NOT NULL, created_at REAL, ready_at REAL, pid INTEGER, run_dir TEXT,
        destroy_started_at REAL, destroyed_at REAL, confirmed_absent_at REAL, cleanup_ms REAL,
        destroy_attempts INTEGER, state TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS envs_by_run ON envs (run_id)",
    "CREATE INDEX IF NOT EXISTS envs_live ON envs (env_id) WHERE confirmed_absent_at IS NULL",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, run_id TEXT, episode_id TEXT,
        env_id TEXT, kind TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}',
        seq INTEGER, prev TEXT, hash TEXT)""",
    "CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, kind)",
    """CREATE TABLE IF NOT EXISTS snapshots (
        snapshot_id TEXT PRIMARY KEY, run_id TEXT, group_id TEXT, driver TEXT,
        owner_controller TEXT, owner_pid INTEGER, owner_host TEXT, intent_at REAL NOT NULL,
        parent_env_id TEXT, saved_at REAL, digest TEXT, setup_digest TEXT, group_digest TEXT,
        deleted_at REAL, confirmed_absent_at REAL, state TEXT NOT NULL)""",
)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    created: float
    finished: float | None
    status: str
    controller_id: str | None
    host: str | None
    pid: int | None
    baseline: str | None
    driver: str | None
    parallel: int | None
    meta: dict[str, Any]
    locked_at: float | None = None  # when controller_id (pid on host) took the run's lock


@dataclass(frozen=True)
class EpisodeRow:
    run_id: str
    episode_id: str
    attempt: int
    state: str
    outcome: str | None
    verdict: str | None
    reward: float | None
    error: str | None
    env_id: str | None
    queued_at: float
    started_at: float | None
    ended_at: float | None


@dataclass(frozen=True)
class EnvRow:
    env_id: str
    run_id: str | None
    episode_id: str | None
    attempt: int | None
    driver: str | None
    accelerator: str | None
    owner_controller: str | None
    owner_pid: int | None
    owner_host: str | None
    intent_at: float
    created_at: float | None
    ready_at: float | None
    pid: int | None
    run_dir: str | None
    destroy_started_at: float | None
    destroyed_at: float | None
    confirmed_absent_at: float | None
    cleanup_ms: float | None
    destroy_attempts: int | None
    state: str

    @property
    def live(self) -> bool:
        """Not confirmed absent: it may still exist on the host."""
        return self.confirmed_absent_at is None


@dataclass(frozen=True)
class SnapshotRow:
    snapshot_id: str
    run_id: str | None
    group_id: str | None
    driver: str | None
    owner_controller: str | None
    owner_pid: int | None
    owner_host: str | None
    intent_at: float
    parent_env_id: str | None
    saved_at: float | None
    digest: str | None
    setup_digest: str | None
    group_digest: str | None
    deleted_at: float | None
    confirmed_absent_at: float | None
    state: str

    @property
    def live(self) -> bool:
        """Its files may still be on the host."""
        return self.confirmed_absent_at is None


@dataclass(frozen=True)
class EventRow:
    id: int
    ts: float
    run_id: str | None
    episode_id: str | None
    env_id: str | None
    kind: str
    data: dict[str, Any]
    seq: int | None = None  # the hash chain (``chain``): place in its run's chain
    prev: str | None = None
    hash: str | None = None


MIGRATIONS = {2: ("runs", "locked_at", "ALTER TABLE runs ADD COLUMN locked_at REAL")}


def run_row(row: sqlite3.Row) -> RunRow:
    return RunRow(**{**dict(row), "meta": json.loads(row["meta"])})
