"""Reaping: envs whose controller is gone are destroyed; live owners' envs are left alone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.fake import FakeDriver
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import LocalStore

from ..conftest import make_fake_baseline


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "ledger.db") as ledger:
        yield ledger


async def _create(
    driver: FakeDriver, ledger: Ledger, tmp: Path, owner: Owner, eid: str, attempt: int = 1
) -> str:
    env_id = new_env_id()
    if ledger.get_run("r") is None:  # one run; its lock is not what this file tests
        ledger.start_run(
            "r", controller_id=owner.controller_id, baseline="b", driver="fake", parallel=1, meta={}
        )
    ledger.episode_queued("r", eid, attempt)
    ledger.env_intent(
        env_id,
        run_id="r",
        episode_id=eid,
        attempt=attempt,
        driver="fake",
        owner_controller=owner.controller_id,
        owner_pid=owner.pid,
        owner_host=owner.host,
    )
    request = EnvRequest(env_id, make_fake_baseline(tmp / eid), ResolvedLimits(), owner, 60)
    env = await driver.create(request)
    await env.session.aclose()
    return env_id


async def test_orphans_are_reaped_and_their_episodes_marked(tmp_path: Path, ledger: Ledger) -> None:
    driver = FakeDriver(run_root=tmp_path / "run")
    orphan = await _create(driver, ledger, tmp_path, Owner("gone", pid=dead_pid()), "lost")
    mine = await _create(driver, ledger, tmp_path, Owner("alive"), "live")
    stray = tmp_path / "run" / new_env_id()
    stray.mkdir()  # a run folder with no owner at all (crash during create)
    try:
        report = await reap(driver, ledger, LocalStore(tmp_path / "store"))
        assert sorted(report.destroyed) == sorted([orphan, stray.name])
        assert not driver.exists(orphan) and not stray.exists()
        assert driver.exists(mine)  # its controller (this process) is alive
        assert report.episodes_marked == [("r", "lost", 1)]
        rows = {r.episode_id: r for r in ledger.episodes("r")}
        assert rows["lost"].outcome == "infra_error"
        assert rows["live"].outcome is None
        row = ledger.get_env(orphan)
        assert row is not None and row.confirmed_absent_at is not None
    finally:
        await driver.destroy(mine)


async def test_reused_pid_does_not_count_as_the_owner(tmp_path: Path, ledger: Ledger) -> None:
    import os
    import time

    from cleanroom.lifecycle.reaper import owner_alive

    assert owner_alive(None, os.getpid(), time.time())
    # this process started before now, so a record claiming it was written a day ago means the
    # pid was reused by us after the real owner died
    assert not owner_alive(None, os.getpid(), time.time() - 86400 * 365)
    assert not owner_alive(None, dead_pid(), time.time())


def _durable(eid: str, attempt: int, outcome: str = "completed") -> dict[str, object]:
    return {
        "run_id": "r",
        "episode_id": eid,
        "attempt": attempt,
        "outcome": outcome,
        "reward": 2.5,
        "error": {"message": "why"} if outcome != "completed" else None,
    }


def test_reconcile_durable_gives_the_ledger_the_records_outcome(ledger: Ledger) -> None:
    """A controller killed after the record was durable but before the ledger heard: the ledger
    takes the record's outcome, reward and error once, with an event; a known outcome, another
    attempt or an unknown attempt are left as they are (issue 21 §2)."""
    from cleanroom.lifecycle.reaper import reconcile_durable

    ledger.start_run("r", controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
    for eid in ("open", "closed"):
        ledger.episode_queued("r", eid, 1)
    ledger.episode_finished("r", "closed", 1, outcome="timeout", error="slow")

    assert reconcile_durable(ledger, _durable("open", 1, "episode_error")) is True
    rows = {(r.episode_id, r.attempt): r for r in ledger.episodes("r", all_attempts=True)}
    row = rows[("open", 1)]
    assert (row.outcome, row.reward, row.error, row.state) == (
        "episode_error",
        2.5,
        "why",
        "CLOSED",
    )
    [event] = ledger.events("r", "episode_reconciled")
    assert event.episode_id == "open" and event.data["attempt"] == 1

    assert reconcile_durable(ledger, _durable("open", 1)) is False  # already has an outcome
    assert reconcile_durable(ledger, _durable("closed", 1)) is False
    assert {r.episode_id: r.outcome for r in ledger.episodes("r")}["closed"] == "timeout"
    assert reconcile_durable(ledger, _durable("nobody", 1)) is False  # no such attempt
    assert reconcile_durable(ledger, _durable("open", 2)) is False
    assert len(ledger.events("r", "episode_reconciled")) == 1


async def test_reap_takes_a_durable_records_outcome_for_a_dead_controllers_episode(
    tmp_path: Path, ledger: Ledger
) -> None:
    """reap() of a dead controller's env whose episode has a durable record: the episode gets
    the record's outcome (not 'controller lost'), and the env is destroyed."""
    driver = FakeDriver(run_root=tmp_path / "run")
    store = LocalStore(tmp_path / "store")
    owner = Owner("dead-controller", pid=dead_pid())
    env_id = await _create(driver, ledger, tmp_path, owner, "e1")
    store.put_record("r", "e1", _durable("e1", 1))
    report = await reap(driver, ledger, store)
    assert env_id in report.destroyed
    [row] = ledger.episodes("r")
    assert (row.outcome, row.reward) == ("completed", 2.5)
    assert ledger.events("r", "episode_reconciled")
    assert report.episodes_marked == []  # durable: not counted as lost


async def test_reap_marks_exactly_the_attempt_whose_controller_died(
    tmp_path: Path, ledger: Ledger
) -> None:
    """The lost attempt is found by episode id *and* attempt among every attempt: another
    episode's finished attempt 1, or a later attempt of the same episode, does not hide it, and
    only it gets ``infra_error`` with the 'controller lost' error."""
    from cleanroom.lifecycle.reaper import CONTROLLER_LOST

    driver = FakeDriver(run_root=tmp_path / "run")
    dead = Owner("dead-controller", pid=dead_pid())
    ledger.start_run("r", controller_id="c", baseline="b", driver="fake", parallel=1, meta={})
    ledger.episode_queued("r", "a-done", 1)
    ledger.episode_finished("r", "a-done", 1, outcome="completed")
    await _create(driver, ledger, tmp_path, dead, "b-lost")
    await _create(driver, ledger, tmp_path, dead, "c-retried")
    ledger.episode_queued("r", "c-retried", 2)  # a later attempt, not started
    await _create(driver, ledger, tmp_path, dead, "d-finished")  # died destroying its env
    ledger.episode_finished("r", "d-finished", 1, outcome="completed")
    report = await reap(driver, ledger, LocalStore(tmp_path / "store"))
    assert sorted(report.episodes_marked) == [("r", "b-lost", 1), ("r", "c-retried", 1)]
    rows = {(r.episode_id, r.attempt): r for r in ledger.episodes("r", all_attempts=True)}
    assert (rows[("b-lost", 1)].outcome, rows[("b-lost", 1)].error) == (
        "infra_error",
        CONTROLLER_LOST,
    )
    assert rows[("c-retried", 1)].outcome == "infra_error"
    assert rows[("c-retried", 2)].outcome is None
    assert rows[("a-done", 1)].outcome == "completed"
    assert rows[("d-finished", 1)].outcome == "completed"  # its outcome stands, not lost


async def test_a_controller_killed_between_destroy_and_outcome_leaves_no_open_episode(
    tmp_path: Path, ledger: Ledger
) -> None:
    """Found by the soak (seed 13): a server SIGKILLed after its sandbox's env was confirmed
    absent but before the outcome was written left that episode without an outcome forever
    (its env is no orphan). reap() now gives it the durable record's outcome, or
    ``infra_error`` naming why without one; a live controller's such episode is left alone."""
    from cleanroom.lifecycle.reaper import CONTROLLER_GONE

    driver = FakeDriver(run_root=tmp_path / "run")
    store = LocalStore(tmp_path / "store")
    dead, me = Owner("dead-server", pid=dead_pid()), Owner("me")
    ids = {}
    for eid, owner in (("durable", dead), ("lost", dead), ("mine", me)):
        ids[eid] = env_id = await _create(driver, ledger, tmp_path, owner, eid)
        result = await driver.destroy(env_id)
        ledger.env_destroyed(env_id, confirmed_absent=True, cleanup_ms=1.0, attempts=1)
        assert result.confirmed_absent
    store.put_record("r", "durable", _durable("durable", 1))
    report = await reap(driver, ledger, store)
    assert report.destroyed == [] and report.episodes_marked == [("r", "lost", 1)]
    rows = {r.episode_id: r for r in ledger.episodes("r")}
    assert (rows["durable"].outcome, rows["durable"].reward) == ("completed", 2.5)
    assert (rows["lost"].outcome, rows["lost"].error) == ("infra_error", CONTROLLER_GONE)
    assert rows["mine"].outcome is None
    assert ledger.absent_envs_of_open_episodes()[0].env_id == ids["mine"]


class SnapshotsOnDisk(FakeDriver):
    """A fake driver with snapshot files: ``files`` (id -> its owner record or None), and
    the ids whose delete fails."""

    def __init__(self, root: Path, files: dict[str, dict[str, object] | None], stuck: set[str]):
        super().__init__(run_root=root)
        self.files, self.stuck, self.deleted = files, stuck, []  # type: list[str]

    def list_snapshots(self) -> list[str]:
        return sorted(self.files)

    def snapshot_owner(self, snapshot_id: str) -> dict[str, object] | None:
        return self.files.get(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        self.deleted.append(snapshot_id)
        if snapshot_id in self.stuck:
            return False
        self.files.pop(snapshot_id, None)
        return True


async def test_orphaned_snapshots_are_deleted_and_recorded(tmp_path: Path, ledger: Ledger) -> None:
    """Protects: ``reap`` deletes every snapshot whose owner is gone, by its ledger row or, with
    no row, by the owner its files name (or none at all); a live owner's snapshot is kept;
    each deletion is recorded (row absent, snapshot_reaped of its run) and one that cannot be
    deleted stays live, snapshot_leaked, in the report's failures."""
    me, gone = Owner("me"), Owner("gone", pid=dead_pid())
    ledger.start_run("r", controller_id="me", baseline="b", driver="fake", parallel=1, meta={})
    for sid, owner in (("s-dead", gone), ("s-mine", me), ("s-stuck", gone)):
        ledger.snapshot_intent(
            sid,
            run_id="r",
            group_id="g",
            driver="fake",
            setup_digest="d",
            owner_controller=owner.controller_id,
            owner_pid=owner.pid,
            owner_host=owner.host,
        )
    mine = {"host": me.host, "pid": me.pid, "created_at": time.time()}
    files = {"s-dead": None, "s-stuck": None, "f-nobody": None, "f-mine": mine, "s-mine": None}
    driver = SnapshotsOnDisk(tmp_path / "run", files, {"s-stuck"})
    report = await reap(driver, ledger, staging_root=tmp_path / "staging")
    assert sorted(driver.deleted) == ["f-nobody", "s-dead", "s-stuck"]
    assert sorted(report.snapshots) == ["f-nobody", "s-dead"] and report.failed == ["s-stuck"]
    dead, stuck = ledger.get_snapshot("s-dead"), ledger.get_snapshot("s-stuck")
    assert dead is not None and not dead.live and dead.state == "absent"
    assert stuck is not None and stuck.live and stuck.state == "leaked"
    assert ledger.get_snapshot("s-mine").live  # type: ignore[union-attr]
    reaped = ledger.events("r", kind="snapshot_reaped")
    assert [e.data["snapshot_id"] for e in reaped] == ["s-dead"]
    assert [e.data["snapshot_id"] for e in ledger.events(None, kind="snapshot_reaped")] == [
        "f-nobody"
    ]
    [leak] = ledger.events("r", kind="snapshot_leaked")
    assert leak.data["snapshot_id"] == "s-stuck"
    assert [r.snapshot_id for r in ledger.snapshots(run_id="r", live_only=True)] == [
        "s-mine",
        "s-stuck",
    ]
