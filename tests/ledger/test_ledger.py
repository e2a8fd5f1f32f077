"""The audit ledger: WAL, intent before create, attempts, live envs, error mapping."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cleanroom.errors import BaselineChanged, LedgerError, RunLocked
from cleanroom.host import paths
from cleanroom.ledger import SCHEMA_VERSION, Ledger

from ..lifecycle.test_reaper import dead_pid

RUN = "run-1"
BASE = "sha256:" + "0" * 64


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "ledger.db") as led:
        led.start_run(
            RUN,
            controller_id="ctl-a",
            baseline=BASE,
            driver="fake",
            parallel=2,
            meta={"episodes": 3},
        )
        yield led


def _intent(led: Ledger, env_id: str, run_id: str = RUN, episode_id: str = "e1") -> None:
    led.env_intent(
        env_id,
        run_id=run_id,
        episode_id=episode_id,
        attempt=1,
        driver="fake",
        owner_controller="ctl-a",
        owner_pid=123,
        owner_host="h",
    )


def test_wal_mode_synchronous_normal_and_schema_version(ledger: Ledger) -> None:
    ledger.event("hello", run_id=RUN)
    other = sqlite3.connect(ledger.path)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert other.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        other.close()
    assert Path(str(ledger.path) + "-wal").exists()
    # synchronous and busy_timeout are per connection: ask the ledger's own connection
    assert ledger._rows("t", "PRAGMA synchronous")[0][0] == 1  # NORMAL
    assert ledger._rows("t", "PRAGMA busy_timeout")[0][0] == 5000


def test_default_path_is_under_cleanroom_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    with Ledger() as led:
        assert led.path == paths.ledger_path()
    assert paths.ledger_path().exists()


def test_env_intent_row_exists_before_created(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="no intent"):
        ledger.env_created("env-x", pid=1, run_dir="/r", accelerator="tcg")
    assert ledger.get_env("env-x") is None

    _intent(ledger, "env-a")
    row = ledger.get_env("env-a")
    assert row is not None and row.state == "intent" and row.live
    assert row.created_at is None and row.pid is None
    ledger.env_created("env-a", pid=4242, run_dir="/run/env-a", accelerator="tcg")
    ledger.env_ready("env-a")
    row = ledger.get_env("env-a")
    assert row is not None and row.created_at is not None and row.ready_at is not None
    assert row.intent_at <= row.created_at <= row.ready_at
    assert (row.pid, row.accelerator, row.state) == (4242, "tcg", "ready")


def test_destroy_of_an_env_without_intent_is_an_event_not_a_crash(ledger: Ledger) -> None:
    ledger.env_destroy_started("env-never")
    ledger.env_destroyed("env-never", confirmed_absent=True, cleanup_ms=1.0, attempts=1)
    assert ledger.get_env("env-never") is None
    unknown = ledger.events(None, kind="env_unknown")
    assert [e.data["operation"] for e in unknown] == ["env_destroy_started", "env_destroyed"]
    assert [e.env_id for e in unknown] == ["env-never", "env-never"]  # which env it was


def test_duplicate_env_id_is_refused_with_the_operation_named(ledger: Ledger) -> None:
    _intent(ledger, "env-a")
    with pytest.raises(LedgerError, match="env_intent"):
        _intent(ledger, "env-a")


def test_live_only_means_not_confirmed_absent(ledger: Ledger) -> None:
    ledger.start_run("run-2", controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
    for env_id in ("env-gone", "env-leaked", "env-intent"):
        _intent(ledger, env_id)
    _intent(ledger, "env-other-run", run_id="run-2")
    for env_id, confirmed in (("env-gone", True), ("env-leaked", False)):
        ledger.env_destroy_started(env_id)
        ledger.env_destroyed(env_id, confirmed_absent=confirmed, cleanup_ms=4.5, attempts=2)

    live = {e.env_id for e in ledger.envs(live_only=True)}
    assert live == {"env-leaked", "env-intent", "env-other-run"}
    assert {e.env_id for e in ledger.envs(RUN, live_only=True)} == {"env-leaked", "env-intent"}
    assert len(ledger.envs(RUN)) == 3
    assert len(ledger.envs()) == 4  # no filter: every run's envs
    gone = ledger.get_env("env-gone")
    leaked = ledger.get_env("env-leaked")
    assert gone is not None and gone.state == "absent" and gone.confirmed_absent_at is not None
    assert gone.cleanup_ms == 4.5 and gone.destroy_attempts == 2
    assert leaked is not None and leaked.state == "leaked" and leaked.destroyed_at is not None


def test_next_attempt_increments(ledger: Ledger) -> None:
    assert ledger.next_attempt(RUN, "e1") == 1
    ledger.episode_queued(RUN, "e1", 1)
    assert ledger.next_attempt(RUN, "e1") == 2
    ledger.episode_queued(RUN, "e1", 2)
    assert ledger.next_attempt(RUN, "e1") == 3
    assert ledger.next_attempt(RUN, "e2") == 1
    assert ledger.next_attempt("run-other", "e1") == 1


def test_outcome_counts_and_episodes_use_the_latest_attempt(ledger: Ledger) -> None:
    ledger.episode_queued(RUN, "a", 1)
    ledger.episode_finished(RUN, "a", 1, outcome="infra_error", error="boom")
    ledger.episode_queued(RUN, "a", 2)
    ledger.episode_finished(RUN, "a", 2, outcome="completed", reward=1.0)
    ledger.episode_queued(RUN, "b", 1)
    ledger.episode_finished(RUN, "b", 1, outcome="completed", reward=0.5, verdict="pass")
    ledger.episode_queued(RUN, "c", 1)

    assert ledger.outcome_counts(RUN) == {"completed": 2, "unfinished": 1}
    latest = {(e.episode_id, e.attempt) for e in ledger.episodes(RUN)}
    assert latest == {("a", 2), ("b", 1), ("c", 1)}
    assert len(ledger.episodes(RUN, all_attempts=True)) == 4
    b = next(e for e in ledger.episodes(RUN) if e.episode_id == "b")
    assert (b.state, b.reward, b.verdict, b.ended_at is not None) == ("CLOSED", 0.5, "pass", True)


def test_episode_state_sets_started_at_once_and_needs_a_queued_attempt(ledger: Ledger) -> None:
    ledger.episode_queued(RUN, "e1", 1)
    (row,) = ledger.episodes(RUN)
    assert row.state == "PENDING" and row.started_at is None
    ledger.episode_state(RUN, "e1", 1, "PROVISIONING", env_id="env-a")
    (first,) = ledger.episodes(RUN)
    ledger.episode_state(RUN, "e1", 1, "RUNNING")
    (second,) = ledger.episodes(RUN)
    assert first.started_at is not None and second.started_at == first.started_at
    assert (second.state, second.env_id) == ("RUNNING", "env-a")
    with pytest.raises(LedgerError, match="no queued attempt"):
        ledger.episode_state(RUN, "e1", 7, "RUNNING")


def test_resumed_run_takes_new_owner_and_keeps_created(ledger: Ledger) -> None:
    before = ledger.get_run(RUN)
    assert before is not None and before.status == "running" and before.meta == {"episodes": 3}
    ledger.finish_run(RUN, "cancelled")
    ledger.start_run(RUN, controller_id="ctl-b", baseline=BASE, driver="fake", parallel=4, meta={})
    after = ledger.get_run(RUN)
    assert after is not None
    assert (after.controller_id, after.parallel, after.status) == ("ctl-b", 4, "running")
    assert after.created == before.created and after.finished is None
    (resumed,) = ledger.events(RUN, kind="run_resumed")
    assert resumed.data["previous_controller"] == "ctl-a"
    assert resumed.data["controller_id"] == "ctl-b"  # who resumed it
    assert resumed.data["previous_status"] == "cancelled"
    with pytest.raises(LedgerError, match="no run"):
        ledger.finish_run("nope", "completed")


def test_events_and_list_runs(ledger: Ledger) -> None:
    ledger.event("export_failed", run_id=RUN, episode_id="e1", error="ENOSPC", n=3)
    ledger.event("env_leaked", run_id=RUN, env_id="env-a", detail="pid 7")
    ledger.event("reaped", env_id="env-z")
    (failed,) = ledger.events(RUN, kind="export_failed")
    assert failed.data == {"error": "ENOSPC", "n": 3} and failed.episode_id == "e1"
    assert [e.kind for e in ledger.events(RUN)] == ["export_failed", "env_leaked"]
    assert [e.kind for e in ledger.events(None)] == ["reaped"]
    ledger.start_run("run-2", controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
    assert [r.run_id for r in ledger.list_runs()] == ["run-2", RUN]


def test_close_is_idempotent_and_data_persists(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.db")
    led.start_run(RUN, controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
    led.close()
    led.close()
    with pytest.raises(LedgerError, match="closed"):
        led.get_run(RUN)
    with Ledger(tmp_path / "l.db") as again:
        assert again.get_run(RUN) is not None


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    Ledger(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    # the whole message: the test's own folder (test_a_newer_...) also says "newer"
    wanted = f"schema version {SCHEMA_VERSION + 1} is newer than this cleanroom"
    with pytest.raises(LedgerError, match=wanted):
        Ledger(path)


def test_unopenable_path_is_a_ledger_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(LedgerError):
        Ledger(tmp_path / "file" / "ledger.db")


def test_concurrent_writers_from_threads(ledger: Ledger) -> None:
    def work(n: int) -> None:
        for i in range(50):
            ledger.event("tick", run_id=RUN, worker=n, i=i)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger.events(RUN, kind="tick")) == 400


def test_a_live_holder_keeps_the_run_lock(ledger: Ledger) -> None:
    """Protects: a second controller cannot take a run a live one holds (before: both ran
    every episode); the refusal names the holder; the holder's own row is untouched."""
    with pytest.raises(RunLocked, match=r"held by controller ctl-a \(pid \d+"):
        ledger.start_run(
            RUN, controller_id="ctl-b", baseline=BASE, driver="fake", parallel=1, meta={}
        )
    row = ledger.get_run(RUN)
    assert row is not None and (row.controller_id, row.status) == ("ctl-a", "running")
    assert ledger.events(RUN, kind="run_resumed") == []


def test_a_dead_holders_run_is_taken_over(ledger: Ledger) -> None:
    """Protects: a run whose controller died while running can be resumed by another."""
    gone = dead_pid()
    with ledger._op("test") as conn:  # the holder's process is gone
        conn.execute("UPDATE runs SET pid = ? WHERE run_id = ?", (gone, RUN))
    ledger.start_run(RUN, controller_id="ctl-b", baseline=BASE, driver="fake", parallel=1, meta={})
    row = ledger.get_run(RUN)
    assert row is not None and row.controller_id == "ctl-b" and row.locked_at is not None
    (taken,) = ledger.events(RUN, kind="run_taken_over")
    assert taken.data == {
        "previous_controller": "ctl-a",
        "previous_pid": gone,
        "controller_id": "ctl-b",
    }


def test_a_resume_with_another_baseline_is_refused_unless_asked(ledger: Ledger) -> None:
    """Protects: resuming a run on another baseline would mix two baselines in one run."""
    ledger.finish_run(RUN, "completed")
    other = "sha256:" + "1" * 64
    with pytest.raises(BaselineChanged, match="1111"):
        ledger.start_run(
            RUN, controller_id="c2", baseline=other, driver="fake", parallel=1, meta={}
        )
    assert ledger.get_run(RUN).status == "completed"  # type: ignore[union-attr]
    ledger.start_run(
        RUN,
        controller_id="c2",
        baseline=other,
        driver="fake",
        parallel=1,
        meta={},
        allow_baseline_change=True,
    )
    assert ledger.get_run(RUN).baseline == other  # type: ignore[union-attr]
    (changed,) = ledger.events(RUN, kind="run_baseline_changed")
    assert changed.data == {"previous": BASE, "now": other, "controller_id": "c2"}
    assert ledger.get_snapshot("never-made") is None


def test_a_version_1_ledger_gains_the_lock_column(tmp_path: Path) -> None:
    """Protects: a ledger written by the previous version opens and keeps its runs."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, created REAL NOT NULL, finished REAL, "
        "status TEXT NOT NULL, controller_id TEXT, host TEXT, pid INTEGER, baseline TEXT, "
        "driver TEXT, parallel INTEGER, meta TEXT NOT NULL DEFAULT '{}')"
    )
    conn.execute("INSERT INTO runs (run_id, created, status) VALUES ('old', 1.0, 'completed')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with Ledger(path) as led:
        old = led.get_run("old")
        assert old is not None and old.locked_at is None
        led.start_run("old", controller_id="c", baseline=BASE, driver="fake", parallel=1, meta={})
        assert led.get_run("old").locked_at is not None  # type: ignore[union-attr]


OWNER = {"owner_controller": "c", "owner_pid": 1, "owner_host": "h"}
OPERATIONS: dict[str, Callable[[Ledger], object]] = {
    "get_run": lambda led: led.get_run("r"),
    "list_runs": lambda led: led.list_runs(),
    "finish_run": lambda led: led.finish_run("r", "completed"),
    "episode_queued": lambda led: led.episode_queued("r", "e", 1),
    "episode_state": lambda led: led.episode_state("r", "e", 1, "RUNNING"),
    "episode_finished": lambda led: led.episode_finished("r", "e", 1, outcome="completed"),
    "episodes": lambda led: led.episodes("r"),
    "outcome_counts": lambda led: led.outcome_counts("r"),
    "env_intent": lambda led: led.env_intent(
        "x", run_id="r", episode_id="e", attempt=1, driver="fake", **OWNER
    ),
    "env_created": lambda led: led.env_created("x", pid=1, run_dir="/d", accelerator="tcg"),
    "env_ready": lambda led: led.env_ready("x"),
    "env_destroy_started": lambda led: led.env_destroy_started("x"),
    "env_destroyed": lambda led: led.env_destroyed(
        "x", confirmed_absent=True, cleanup_ms=1.0, attempts=1
    ),
    "get_env": lambda led: led.get_env("x"),
    "envs": lambda led: led.envs(),
    "snapshot_intent": lambda led: led.snapshot_intent(
        "s", run_id="r", group_id="g", driver="fake", setup_digest="d", **OWNER
    ),
    "snapshot_saved": lambda led: led.snapshot_saved(
        "s", parent_env_id="x", digest="d", group_digest="g"
    ),
    "snapshot_deleted": lambda led: led.snapshot_deleted("s", confirmed_absent=True),
    "get_snapshot": lambda led: led.get_snapshot("s"),
    "snapshots": lambda led: led.snapshots(),
    "event": lambda led: led.event("k", run_id="r"),
    "events": lambda led: led.events("r"),
}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_a_ledger_error_names_its_operation(tmp_path: Path, name: str) -> None:
    """Every operation's LedgerError says which one failed (an operator reading a stack of
    them needs it): on a closed ledger each raises ``ledger <operation>: ...``."""
    led = Ledger(tmp_path / "ledger.db")
    led.close()
    with pytest.raises(LedgerError, match=f"^ledger {name}: the ledger is closed$"):
        OPERATIONS[name](led)


def test_updates_of_unknown_rows_name_the_row(tmp_path: Path) -> None:
    """An update that touches no row is refused with the id it looked for."""
    with Ledger(tmp_path / "ledger.db") as led:
        with pytest.raises(LedgerError, match=r"^ledger snapshot_saved: no intent .*'s-9'"):
            led.snapshot_saved("s-9", parent_env_id="x", digest="d", group_digest="g")
        with pytest.raises(LedgerError, match=r"^ledger env_created: no intent .*'env-9'"):
            led.env_created("env-9", pid=1, run_dir="/d", accelerator="tcg")


def test_an_episodes_row_is_not_an_attempt_that_lost_to_another_record(ledger: Ledger) -> None:
    """Protects one outcome per episode on a cluster: an attempt that lost to another
    attempt's durable record (``superseded``) is not the episode's row while another exists,
    even when it is the latest; alone, it still is."""
    ledger.episode_queued(RUN, "a", 1)
    ledger.episode_finished(RUN, "a", 1, outcome="completed", reward=1.0)
    ledger.episode_queued(RUN, "a", 2)
    ledger.episode_finished(RUN, "a", 2, outcome="superseded", error="lost")
    ledger.episode_queued(RUN, "b", 1)
    ledger.episode_finished(RUN, "b", 1, outcome="superseded")

    assert ledger.outcome_counts(RUN) == {"completed": 1, "superseded": 1}
    assert {(e.episode_id, e.attempt) for e in ledger.episodes(RUN)} == {("a", 1), ("b", 1)}


def test_each_state_of_an_env_and_a_snapshot_is_recorded(ledger: Ledger) -> None:
    """Protects the audit trail's states (what ``cleanroom reap`` and an operator read): an env
    goes intent -> created -> destroying -> absent, a snapshot intent -> saved; a state written
    in another case (``'CREATED'``) is a state nothing else reads."""
    _intent(ledger, "env-a")
    states = [ledger.get_env("env-a").state]  # type: ignore[union-attr]
    ledger.env_created("env-a", pid=1, run_dir="/r", accelerator="tcg")
    states.append(ledger.get_env("env-a").state)  # type: ignore[union-attr]
    ledger.env_destroy_started("env-a")
    states.append(ledger.get_env("env-a").state)  # type: ignore[union-attr]
    ledger.env_destroyed("env-a", confirmed_absent=True, cleanup_ms=1.0, attempts=1)
    states.append(ledger.get_env("env-a").state)  # type: ignore[union-attr]
    assert states == ["intent", "created", "destroying", "absent"]
    ledger.snapshot_intent(
        "s-1", run_id=RUN, group_id="g", driver="fake", setup_digest="d", **OWNER
    )
    assert ledger.get_snapshot("s-1").state == "intent"  # type: ignore[union-attr]
    ledger.snapshot_saved("s-1", parent_env_id="env-a", digest="d", group_digest="g")
    assert ledger.get_snapshot("s-1").state == "saved"  # type: ignore[union-attr]


def test_finishing_an_attempt_never_queued_is_refused(ledger: Ledger) -> None:
    """Protects one row per attempt: an outcome for an attempt the ledger never queued is a
    LedgerError naming it, not an update of nothing."""
    with pytest.raises(LedgerError, match=r"no queued attempt run-1/e9#2"):
        ledger.episode_finished(RUN, "e9", 2, outcome="completed")
    assert ledger.episodes(RUN) == []


def test_queuing_an_attempt_again_and_restarting_ones_own_run_are_no_ops(ledger: Ledger) -> None:
    """Protects resume: queuing an attempt already queued keeps its one row, and the controller
    that holds a run may start it again (only *another* live controller is refused)."""
    ledger.episode_queued(RUN, "e1", 1)
    ledger.episode_queued(RUN, "e1", 1)
    assert len(ledger.episodes(RUN)) == 1
    ledger.start_run(RUN, controller_id="ctl-a", baseline=BASE, driver="fake", parallel=2, meta={})
    assert [e.kind for e in ledger.events(RUN, kind="run_taken_over")] == []
    row = ledger.get_run(RUN)
    assert row is not None and (row.controller_id, row.status) == ("ctl-a", "running")


def test_a_ledger_in_folders_not_made_yet_and_event_data_that_is_not_json(tmp_path: Path) -> None:
    """Protects a first run in a new home (the ledger's folders are made, however deep) and the
    controller's events: a value JSON cannot hold (a path, an exception) is kept as its text,
    never an error on the path that records a failure."""
    with Ledger(tmp_path / "new" / "home" / "ledger.db") as led:
        led.event("export_failed", run_id="r", where=Path("/s/x"), error=OSError(28, "full"))
        (event,) = led.events("r")
        assert event.data == {"where": "/s/x", "error": "[Errno 28] full"}
