"""The ledger's hash chain: every event carries the hash of the one before it, per run.

One chain per ``run_id`` (events with no run form the home's own chain, ``run_id`` NULL), so a
run's chain can be exported with its records and checked on its own, on another machine:
``seq`` counts from 1, ``prev`` is the previous event's ``hash`` (``GENESIS`` for the first),
and ``hash`` is the sha256 of the canonical JSON list ``[seq, prev, ts, run_id, episode_id,
env_id, kind, data]`` (``data`` as the exact JSON text the ledger stores). Deleting, editing,
reordering or inserting an event breaks a link; removing the last ones is caught against the
chain head, which is written signed to the store when the run ends (``seal``).

An append runs inside the caller's ``BEGIN IMMEDIATE``, so two writers (threads, processes)
never fork a chain. A ledger made before the chain (schema < 3) is migrated in place: its events
keep their ids and data, are chained in id order, and a ``ledger_chained`` event in the home's
chain records how many were hashed by the migration rather than when they were written.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Iterator
from typing import Any

GENESIS = "0" * 64
CHAIN_VERSION = 3  # the ledger's schema version that added the chain
COLUMNS = (("seq", "INTEGER"), ("prev", "TEXT"), ("hash", "TEXT"))
INDEX = "CREATE INDEX IF NOT EXISTS events_chain ON events (run_id, seq)"


def link(
    seq: int,
    prev: str,
    ts: float,
    run_id: str | None,
    episode_id: str | None,
    env_id: str | None,
    kind: str,
    data: str,
) -> str:
    """The hash of one event, given the hash of the one before it."""
    body = [seq, prev, ts, run_id, episode_id, env_id, kind, data]
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _tip(conn: sqlite3.Connection, run_id: str | None) -> tuple[int, str]:
    row = conn.execute(
        "SELECT seq, hash FROM events WHERE run_id IS ? AND seq IS NOT NULL "
        "ORDER BY seq DESC LIMIT 1",
        (run_id,),
    ).fetchone()
    return (int(row[0]), str(row[1])) if row else (0, GENESIS)


def append(
    conn: sqlite3.Connection,
    ts: float,
    run_id: str | None,
    episode_id: str | None,
    env_id: str | None,
    kind: str,
    data: str,
) -> str:
    """Insert one event at the end of its run's chain (inside a write transaction); its hash."""
    seq, prev = _tip(conn, run_id)
    seq += 1
    digest = link(seq, prev, ts, run_id, episode_id, env_id, kind, data)
    conn.execute(
        "INSERT INTO events (ts, run_id, episode_id, env_id, kind, data, seq, prev, hash) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (ts, run_id, episode_id, env_id, kind, data, seq, prev, digest),
    )
    return digest


def migrate(conn: sqlite3.Connection, version: int) -> int:
    """Add the chain's columns to an older ledger and chain its events (in a transaction the
    caller holds); how many events were hashed now."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    for column, kind in COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE events ADD COLUMN {column} {kind}")
    conn.execute(INDEX)
    if version >= CHAIN_VERSION:
        return 0
    rows = conn.execute(
        "SELECT id, ts, run_id, episode_id, env_id, kind, data FROM events "
        "WHERE hash IS NULL ORDER BY id"
    ).fetchall()
    tips: dict[str | None, tuple[int, str]] = {}  # a ledger before the chain has no links yet
    for row in rows:
        run_id = row[2]
        seq, prev = tips.get(run_id, (0, GENESIS))
        digest = link(seq + 1, prev, row[1], run_id, row[3], row[4], row[5], row[6])
        conn.execute(
            "UPDATE events SET seq = ?, prev = ?, hash = ? WHERE id = ?",
            (seq + 1, prev, digest, row[0]),
        )
        tips[run_id] = (seq + 1, digest)
    return len(rows)


def exported(events: Iterable[dict[str, Any]]) -> bytes:
    """A run's chain as JSON Lines (the form ``ledger/events.jsonl`` has in the store)."""
    keys = ("seq", "prev", "hash", "ts", "run_id", "episode_id", "env_id", "kind", "data")
    lines = (json.dumps({k: e[k] for k in keys}, ensure_ascii=False) for e in events)
    return "".join(f"{line}\n" for line in lines).encode("utf-8", "surrogatepass")


def parse(raw: bytes) -> Iterator[dict[str, Any]]:
    """The events of an exported chain (ValueError on a line that is not an event)."""
    for n, line in enumerate(raw.decode("utf-8", "surrogatepass").splitlines(), 1):
        event = json.loads(line)
        if not isinstance(event, dict):
            raise ValueError(f"line {n} is not an event")
        yield event


def broken_link(events: Iterable[dict[str, Any]]) -> tuple[int, str] | None:
    """Where an exported chain breaks: (seq or line, why), or None if every link holds."""
    prev = GENESIS
    for seq, event in enumerate(events, 1):
        if event.get("seq") != seq:
            return seq, f"event {seq} is missing (found seq {event.get('seq')})"
        if event.get("prev") != prev:
            return seq, f"event {seq} does not follow event {seq - 1} (prev hash differs)"
        try:
            digest = link(
                seq,
                prev,
                event["ts"],
                event["run_id"],
                event["episode_id"],
                event["env_id"],
                event["kind"],
                event["data"],
            )
        except (KeyError, TypeError) as exc:
            return seq, f"event {seq} is malformed ({exc})"
        if digest != event.get("hash"):
            return seq, f"event {seq} ({event.get('kind')}) was altered: its hash does not match"
        prev = digest
    return None
