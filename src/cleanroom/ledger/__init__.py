"""The audit ledger: runs, episode attempts, environments, snapshots and events in one file.

WAL mode, ``synchronous=NORMAL``, a 5 s busy timeout; one connection guarded by a lock, so an
asyncio controller (and its worker threads) can share a ``Ledger``. Times are unix seconds.
An environment's row is written (``env_intent``) *before* its VM exists; ``env_created`` and
``env_ready`` refuse an env with no intent (destroy steps log an ``env_unknown`` event instead of
failing the cleanup path); an env is live until its absence is confirmed. A group's warm
snapshot (``groups.py``) has a row of its own, written before its files exist, live until its
files are confirmed deleted. A run's row is its lock (``start_run``): held by one controller
(id, pid, host) while ``running``, refused to a second live one, taken over from a dead one.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from cleanroom.errors import BaselineChanged, LedgerError, RunLocked
from cleanroom.host import paths
from cleanroom.ledger import chain
from cleanroom.ledger.liveness import owner_alive
from cleanroom.ledger.rows import (
    MIGRATIONS,
    QUEUED,
    SCHEMA,
    SCHEMA_VERSION,
    EnvRow,
    EpisodeRow,
    EventRow,
    RunRow,
    SnapshotRow,
    run_row,
)

__all__ = [
    "QUEUED",
    "SCHEMA_VERSION",
    "EnvRow",
    "EpisodeRow",
    "EventRow",
    "Ledger",
    "RunRow",
    "SnapshotRow",
]

_SAME_EPISODE = "e2.run_id = episodes.run_id AND e2.episode_id = episodes.episode_id"
# an episode's row: its latest attempt that did not lose to another's record (``superseded``
# on a cluster), else its latest
_LATEST = (
    "attempt = COALESCE((SELECT MAX(attempt) FROM episodes AS e2 "
    f"WHERE {_SAME_EPISODE} AND e2.outcome IS NOT 'superseded'), "
    f"(SELECT MAX(attempt) FROM episodes AS e2 WHERE {_SAME_EPISODE}))"
)


class Ledger:
    """The audit ledger. Use as a context manager, or call ``close()`` (idempotent)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.ledger_path()
        self._lock = threading.Lock()
        self._on_finish: dict[str, Callable[[], object]] = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise LedgerError(f"cannot open the ledger at {self.path}: {exc}") from exc
        conn.row_factory = sqlite3.Row
        self._conn: sqlite3.Connection | None = conn
        try:
            self._setup(conn)
        except BaseException:
            self.close()
            raise

    def _setup(self, conn: sqlite3.Connection) -> None:
        with self._op("open"):
            conn.execute("PRAGMA busy_timeout = 5000")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"{self.path}: WAL mode refused (journal_mode={mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise LedgerError(
                        f"{self.path}: schema version {version} is newer than this cleanroom "
                        f"({SCHEMA_VERSION}); upgrade cleanroom"
                    )
                for statement in SCHEMA:
                    conn.execute(statement)
                for table, column, statement in (
                    m for v, m in sorted(MIGRATIONS.items()) if v > version
                ):
                    if column not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                        conn.execute(statement)
                if chained := chain.migrate(conn, version):
                    data = _dumps({"events": chained, "from_schema": version})
                    chain.append(conn, time.time(), None, None, None, "ledger_chained", data)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

    @contextmanager
    def _op(self, name: str) -> Iterator[sqlite3.Connection]:
        """Run one ledger operation under the lock, mapping sqlite3 errors to LedgerError."""
        with self._lock:
            if self._conn is None:
                raise LedgerError(f"ledger {name}: the ledger is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                hint = " (its filesystem is full)" if full else ""
                raise LedgerError(f"ledger {name} failed ({self.path}): {exc}{hint}") from exc

    def _write(self, name: str, sql: str, args: tuple[Any, ...], *, must_hit: str = "") -> int:
        """Execute one statement; with ``must_hit``, touching no row is a LedgerError."""
        with self._op(name) as conn:
            count = conn.execute(sql, args).rowcount
        if must_hit and count == 0:
            raise LedgerError(f"ledger {name}: {must_hit}")
        return count

    def _rows(self, name: str, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._op(name) as conn:
            return conn.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- runs -------------------------------------------------------------------------------

    def start_run(
        self,
        run_id: str,
        *,
        controller_id: str,
        baseline: str,
        driver: str,
        parallel: int,
        meta: dict[str, Any],
        allow_baseline_change: bool = False,
    ) -> None:
        """Take the run's lock: record a new run, or take over an existing one (a resume: new
        owner fields). Atomic, so two controllers cannot both take it.

        Refused (``RunLocked``, naming the holder) while another controller whose process is
        alive holds it (status ``running``); a dead holder's run is taken over (``run_taken_over``
        event). A resume with another baseline is ``BaselineChanged`` unless
        ``allow_baseline_change`` (then recorded: ``run_baseline_changed``)."""
        now, host, pid = time.time(), socket.gethostname(), os.getpid()
        events: list[tuple[str, dict[str, Any]]] = []
        with self._op("start_run") as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rows = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchall()
                previous = run_row(rows[0]) if rows else None
                if previous is not None:
                    events = _takeover(previous, controller_id, baseline, allow_baseline_change)
                conn.execute(
                    "INSERT INTO runs (run_id, created, status, controller_id, host, pid, "
                    "baseline, driver, parallel, meta, locked_at) "
                    "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id) DO UPDATE SET status = 'running', finished = NULL, "
                    "controller_id = excluded.controller_id, host = excluded.host, "
                    "pid = excluded.pid, parallel = excluded.parallel, "
                    "baseline = excluded.baseline, locked_at = excluded.locked_at",
                    (
                        run_id,
                        now,
                        controller_id,
                        host,
                        pid,
                        baseline,
                        driver,
                        parallel,
                        _dumps(meta),
                        now,
                    ),
                )
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
        for kind, data in events:
            self.event(kind, run_id=run_id, controller_id=controller_id, **data)

    def finish_run(self, run_id: str, status: str) -> None:
        """The run's end (its lock released), also the last event of its chain so far."""
        self._chained(
            "finish_run",
            "UPDATE runs SET finished = ?, status = ? WHERE run_id = ?",
            (time.time(), status, run_id),
            f"no run {run_id!r}",
            ("run_finished", run_id, None, None, {"status": status}),
        )
        hook = self._on_finish.pop(run_id, None)
        if hook is not None:
            hook()

    def on_run_finished(self, run_id: str, hook: Callable[[], object]) -> None:
        """Call ``hook()`` once, after ``finish_run(run_id)`` (the last one set wins): how a
        run's chain is sealed when it ends (``evidence.seal``), whoever ends it (a batch, the
        last holder of a session's run)."""
        self._on_finish[run_id] = hook

    def get_run(self, run_id: str) -> RunRow | None:
        rows = self._rows("get_run", "SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return run_row(rows[0]) if rows else None

    def list_runs(self) -> list[RunRow]:
        """Every run, newest first."""
        return [
            run_row(r) for r in self._rows("list_runs", "SELECT * FROM runs ORDER BY created DESC")
        ]

    # -- episodes ---------------------------------------------------------------------------

    def next_attempt(self, run_id: str, episode_id: str) -> int:
        """1 + the highest attempt recorded for this episode (1 if none)."""
        sql = (
            "SELECT COALESCE(MAX(attempt), 0) + 1 FROM episodes WHERE run_id = ? AND episode_id = ?"
        )
        return int(self._rows("next_attempt", sql, (run_id, episode_id))[0][0])

    def episode_queued(self, run_id: str, episode_id: str, attempt: int) -> None:
        self._write(
            "episode_queued",
            "INSERT INTO episodes (run_id, episode_id, attempt, state, queued_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (run_id, episode_id, attempt, QUEUED, time.time()),
        )

    def episode_state(
        self, run_id: str, episode_id: str, attempt: int, state: str, env_id: str | None = None
    ) -> None:
        """Move an attempt to ``state``; the first state after queued sets ``started_at``."""
        now = time.time()
        self._write(
            "episode_state",
            "UPDATE episodes SET state = ?, env_id = COALESCE(?, env_id), started_at = "
            "COALESCE(started_at, CASE WHEN ? != ? THEN ? END) "
            "WHERE run_id = ? AND episode_id = ? AND attempt = ?",
            (state, env_id, state, QUEUED, now, run_id, episode_id, attempt),
            must_hit=f"no queued attempt {run_id}/{episode_id}#{attempt}",
        )

    def episode_finished(
        self,
        run_id: str,
        episode_id: str,
        attempt: int,
        *,
        outcome: str,
        verdict: str | None = None,
        reward: float | None = None,
        error: str | None = None,
    ) -> None:
        fields = {"attempt": attempt, "outcome": outcome, "verdict": verdict}
        self._chained(
            "episode_finished",
            "UPDATE episodes SET state = 'CLOSED', outcome = ?, verdict = ?, reward = ?, "
            "error = ?, ended_at = ? WHERE run_id = ? AND episode_id = ? AND attempt = ?",
            (outcome, verdict, reward, error, time.time(), run_id, episode_id, attempt),
            f"no queued attempt {run_id}/{episode_id}#{attempt}",
            ("episode_finished", run_id, episode_id, None, fields),
        )

    def episodes(self, run_id: str, *, all_attempts: bool = False) -> list[EpisodeRow]:
        """Each episode's row (its latest attempt, a ``superseded`` one only if it has no
        other) or every attempt, in queue order."""
        where = "run_id = ?" if all_attempts else f"run_id = ? AND {_LATEST}"
        sql = f"SELECT * FROM episodes WHERE {where} ORDER BY queued_at, episode_id, attempt"
        return [EpisodeRow(**dict(r)) for r in self._rows("episodes", sql, (run_id,))]

    def outcome_counts(self, run_id: str) -> dict[str, int]:
        """Outcome -> count over each episode's row (as ``episodes``; "unfinished" if none yet)."""
        sql = (
            "SELECT COALESCE(outcome, 'unfinished'), COUNT(*) FROM episodes "
            f"WHERE run_id = ? AND {_LATEST} GROUP BY 1 ORDER BY 1"
        )
        return {r[0]: r[1] for r in self._rows("outcome_counts", sql, (run_id,))}

    # -- environments -----------------------------------------------------------------------

    def env_intent(
        self,
        env_id: str,
        *,
        run_id: str,
        episode_id: str | None,
        attempt: int | None,
        driver: str,
        owner_controller: str,
        owner_pid: int,
        owner_host: str,
    ) -> None:
        """Record that ``env_id`` is about to be created. Must precede the VM process.

        ``episode_id``/``attempt`` are None for a group's warm parent (it serves many)."""
        fields = {"attempt": attempt, "driver": driver}
        self._chained(
            "env_intent",
            "INSERT INTO envs (env_id, run_id, episode_id, attempt, driver, owner_controller, "
            "owner_pid, owner_host, intent_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'intent')",
            (
                env_id,
                run_id,
                episode_id,
                attempt,
                driver,
                owner_controller,
                owner_pid,
                owner_host,
                time.time(),
            ),
            "",
            ("env_intent", run_id, episode_id, env_id, fields),
        )

    def _env_update(
        self,
        name: str,
        env_id: str,
        sets: str,
        args: tuple[Any, ...],
        *,
        strict: bool = True,
        chained: dict[str, Any] | None = None,
    ) -> None:
        """Update an env's row. No row: LedgerError if ``strict``, else an ``env_unknown`` event
        (destroy steps must not fail the controller's cleanup path; an env with no intent was
        never created by a controller). ``chained``: the update is also an event of its run's
        chain, kind ``name``, with this data."""
        missing = f"no intent recorded for env {env_id!r}"
        sql = f"UPDATE envs SET {sets} WHERE env_id = ?"
        must_hit = missing if strict else ""
        if chained is not None:
            event = (name, None, None, env_id, chained)
            hit = self._chained(name, sql, (*args, env_id), must_hit, event, env_row=env_id)
        else:
            hit = self._write(name, sql, (*args, env_id), must_hit=must_hit)
        if not hit:
            self.event("env_unknown", env_id=env_id, operation=name)

    def env_created(self, env_id: str, *, pid: int, run_dir: str, accelerator: str) -> None:
        self._env_update(
            "env_created",
            env_id,
            "state = 'created', created_at = ?, pid = ?, run_dir = ?, accelerator = ?",
            (time.time(), pid, run_dir, accelerator),
            chained={"accelerator": accelerator},
        )

    def env_ready(self, env_id: str) -> None:
        self._env_update("env_ready", env_id, "state = 'ready', ready_at = ?", (time.time(),))

    def env_destroy_started(self, env_id: str) -> None:
        self._env_update(
            "env_destroy_started",
            env_id,
            "state = 'destroying', destroy_started_at = COALESCE(destroy_started_at, ?)",
            (time.time(),),
            strict=False,
        )

    def env_destroyed(
        self, env_id: str, *, confirmed_absent: bool, cleanup_ms: float, attempts: int
    ) -> None:
        """Record a destroy's end; only a confirmed absence makes the env no longer live."""
        now = time.time()
        self._env_update(
            "env_destroyed",
            env_id,
            "state = ?, destroyed_at = ?, confirmed_absent_at = COALESCE(confirmed_absent_at, ?), "
            "cleanup_ms = ?, destroy_attempts = ?",
            (
                "absent" if confirmed_absent else "leaked",
                now,
                now if confirmed_absent else None,
                cleanup_ms,
                attempts,
            ),
            strict=False,
            chained={"confirmed_absent": confirmed_absent, "attempts": attempts},
        )

    def get_env(self, env_id: str) -> EnvRow | None:
        rows = self._rows("get_env", "SELECT * FROM envs WHERE env_id = ?", (env_id,))
        return EnvRow(**dict(rows[0])) if rows else None

    def envs(self, run_id: str | None = None, live_only: bool = False) -> list[EnvRow]:
        """Environments (of one run, or all); ``live_only``: not yet confirmed absent."""
        clauses = (["run_id = ?"] if run_id is not None else []) + (
            ["confirmed_absent_at IS NULL"] if live_only else []
        )
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        args = (run_id,) if run_id is not None else ()
        sql = f"SELECT * FROM envs {where} ORDER BY intent_at, env_id"
        return [EnvRow(**dict(r)) for r in self._rows("envs", sql, args)]

    def absent_envs_of_open_episodes(self) -> list[EnvRow]:
        """Envs confirmed absent whose episode attempt has no outcome yet: a live controller
        between its destroy and its outcome, or a dead one that got no further."""
        sql = (
            "SELECT envs.* FROM envs JOIN episodes ON envs.run_id = episodes.run_id "
            "AND envs.episode_id = episodes.episode_id AND envs.attempt = episodes.attempt "
            "WHERE envs.confirmed_absent_at IS NOT NULL AND episodes.outcome IS NULL "
            "ORDER BY envs.intent_at, envs.env_id"
        )
        return [EnvRow(**dict(r)) for r in self._rows("absent_envs_of_open_episodes", sql)]

    # -- snapshots (a group's warm env, saved for its clones) --------------------------------

    def snapshot_intent(
        self,
        snapshot_id: str,
        *,
        run_id: str,
        group_id: str,
        driver: str,
        setup_digest: str,
        owner_controller: str,
        owner_pid: int,
        owner_host: str,
    ) -> None:
        """Record that ``snapshot_id``'s files are about to be made. Must precede them."""
        self._write(
            "snapshot_intent",
            "INSERT INTO snapshots (snapshot_id, run_id, group_id, driver, setup_digest, "
            "owner_controller, owner_pid, owner_host, intent_at, state) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'intent')",
            (
                snapshot_id,
                run_id,
                group_id,
                driver,
                setup_digest,
                owner_controller,
                owner_pid,
                owner_host,
                time.time(),
            ),
        )

    def snapshot_saved(
        self, snapshot_id: str, *, parent_env_id: str, digest: str, group_digest: str
    ) -> None:
        self._write(
            "snapshot_saved",
            "UPDATE snapshots SET state = 'saved', saved_at = ?, parent_env_id = ?, digest = ?, "
            "group_digest = ? WHERE snapshot_id = ?",
            (time.time(), parent_env_id, digest, group_digest, snapshot_id),
            must_hit=f"no intent recorded for snapshot {snapshot_id!r}",
        )

    def snapshot_deleted(self, snapshot_id: str, *, confirmed_absent: bool) -> None:
        """Record a delete; only a confirmed absence makes the snapshot no longer live."""
        now = time.time()
        state, absent_at = ("absent", now) if confirmed_absent else ("leaked", None)
        self._write(
            "snapshot_deleted",
            "UPDATE snapshots SET state = ?, deleted_at = ?, "
            "confirmed_absent_at = COALESCE(confirmed_absent_at, ?) WHERE snapshot_id = ?",
            (state, now, absent_at, snapshot_id),
        )

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        sql = "SELECT * FROM snapshots WHERE snapshot_id = ?"
        rows = self._rows("get_snapshot", sql, (snapshot_id,))
        return SnapshotRow(**dict(rows[0])) if rows else None

    def snapshots(self, run_id: str | None = None, live_only: bool = False) -> list[SnapshotRow]:
        """Snapshots (of one run, or all); ``live_only``: files not yet confirmed deleted."""
        clauses = (["run_id = ?"] if run_id is not None else []) + (
            ["confirmed_absent_at IS NULL"] if live_only else []
        )
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        args = (run_id,) if run_id is not None else ()
        sql = f"SELECT * FROM snapshots {where} ORDER BY intent_at, snapshot_id"
        return [SnapshotRow(**dict(r)) for r in self._rows("snapshots", sql, args)]

    # -- events -----------------------------------------------------------------------------

    def event(
        self,
        kind: str,
        *,
        run_id: str | None = None,
        episode_id: str | None = None,
        env_id: str | None = None,
        **data: Any,
    ) -> None:
        """Append an event to its run's hash chain (``chain``)."""
        self._chained("event", None, (), "", (kind, run_id, episode_id, env_id, data))

    def _chained(
        self,
        name: str,
        sql: str | None,
        args: tuple[Any, ...],
        must_hit: str,
        event: tuple[str, str | None, str | None, str | None, dict[str, Any]],
        *,
        env_row: str | None = None,
    ) -> int:
        """One statement (``sql``, may be None) and its chained event, in one transaction.
        ``env_row``: the event's run and episode are that env's (none: an ``env_unknown``)."""
        kind, run_id, episode_id, env_id, data = event
        with self._op(name) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                count = conn.execute(sql, args).rowcount if sql is not None else 1
                if env_row is not None:
                    row = conn.execute(
                        "SELECT run_id, episode_id FROM envs WHERE env_id = ?", (env_row,)
                    ).fetchone()
                    run_id, episode_id = (row[0], row[1]) if row else (None, None)
                if count:
                    chain.append(conn, time.time(), run_id, episode_id, env_id, kind, _dumps(data))
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
        if must_hit and count == 0:
            raise LedgerError(f"ledger {name}: {must_hit}")
        return count

    def chain(self, run_id: str | None) -> list[dict[str, Any]]:
        """A run's hash chain, in order: each event as ``chain.exported`` writes it."""
        rows = self._rows(
            "chain",
            "SELECT seq, prev, hash, ts, run_id, episode_id, env_id, kind, data FROM events "
            "WHERE run_id IS ? AND seq IS NOT NULL ORDER BY seq",
            (run_id,),
        )
        return [dict(r) for r in rows]

    def events(self, run_id: str | None, kind: str | None = None) -> list[EventRow]:
        """Events of a run (``None``: events with no run), optionally of one kind, in order."""
        sql = "SELECT * FROM events WHERE run_id IS ?" + (" AND kind = ?" if kind else "")
        args = (run_id, kind) if kind else (run_id,)
        rows = self._rows("events", sql + " ORDER BY id", args)
        return [EventRow(**{**dict(r), "data": json.loads(r["data"])}) for r in rows]


def _takeover(
    previous: RunRow, controller_id: str, baseline: str, allow_baseline_change: bool
) -> list[tuple[str, dict[str, Any]]]:
    """Whether ``controller_id`` may take the run ``previous`` describes; the events to log."""
    held = previous.status == "running" and previous.controller_id != controller_id
    since = previous.locked_at or previous.created
    if held and owner_alive(previous.host, previous.pid, since):
        raise RunLocked(
            f"run {previous.run_id!r} is held by controller {previous.controller_id} "
            f"(pid {previous.pid} on {previous.host}, since {time.ctime(since)}); "
            "wait for it to end, or stop that process"
        )
    events: list[tuple[str, dict[str, Any]]] = []
    if previous.baseline is not None and previous.baseline != baseline:
        if not allow_baseline_change:
            raise BaselineChanged(
                f"run {previous.run_id!r} was started with baseline {previous.baseline}, not "
                f"{baseline}; resume it with its own baseline, or allow the change explicitly"
            )
        events.append(("run_baseline_changed", {"previous": previous.baseline, "now": baseline}))
    if held:
        dead = {"previous_controller": previous.controller_id, "previous_pid": previous.pid}
        events.append(("run_taken_over", dead))
    resumed = {"previous_controller": previous.controller_id, "previous_status": previous.status}
    return [("run_resumed", resumed), *events]


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if any: a failed COMMIT (``SQLITE_FULL``) has rolled it
    back already, and a second error would hide the first (the disk is full)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, default=str)
