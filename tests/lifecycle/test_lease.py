"""``EnvLease.close``: destroy retried inside the cleanup window, absence confirmed, the proof.

A scripted driver (each destroy attempt answers as told) and a real ledger and store: the
ledger row and ``destroy.json`` must say how many attempts it took and whether the env is
confirmed gone; an env still there after the window is ``env_leaked`` and an alert; nothing
(a failing ledger, a failing proof write, a cancellation, a second close) stops or repeats it;
a proof the store cannot take is a typed error, recorded and alerted.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers.base import DestroyReport, Env, EnvInfo, EnvRequest, Owner
from cleanroom.errors import DriverError, LedgerError, StoreError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle import lease as lease_module
from cleanroom.lifecycle.context import RunContext, RunOptions
from cleanroom.lifecycle.lease import EnvLease, release_spares
from cleanroom.store import LocalStore

RUN, EP, ENV = "run-l", "ep-l", "env-l"
PROOF = "attempts/1/destroy.json"


class ScriptedDriver:
    """Answers each ``destroy`` with the next step: a report, an exception, or "hang"."""

    name = "scripted"

    def __init__(self, *steps: Any) -> None:
        self.steps, self.calls = list(steps), 0
        self.ids: list[str] = []

    async def destroy(self, env_id: str) -> DestroyReport:
        self.calls += 1
        self.ids.append(env_id)
        step = self.steps.pop(0) if self.steps else DestroyReport(env_id, False, 1, 0.0, "still")
        if step == "hang":
            await asyncio.sleep(30)
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, DestroyReport)
        return step


def gone(detail: str = "gone") -> DestroyReport:
    return DestroyReport(ENV, True, 1, 0.0, detail)


def present(detail: str = "still there") -> DestroyReport:
    return DestroyReport(ENV, False, 1, 0.0, detail)


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.ledger = Ledger(tmp / "ledger.db")
        self.ledger.start_run(
            RUN, controller_id="c", baseline="sha256:x", driver="scripted", parallel=1, meta={}
        )
        self.store = LocalStore(tmp / "store")
        self.alerts: list[dict[str, Any]] = []

    def lease(self, driver: ScriptedDriver, window_s: float = 5.0, **kw: Any) -> EnvLease:
        def emit(kind: str, **data: Any) -> None:
            if kind == "alert":
                self.alerts.append(data)

        ctx = RunContext(
            driver,  # type: ignore[arg-type]
            self.ledger,
            kw.pop("store", self.store),
            Owner("c"),
            options=RunOptions(cleanup_window_s=window_s),
            emit=emit,
        )
        return EnvLease(ctx, ENV, run_id=RUN, episode_id=EP, attempt=1, proof=PROOF, **kw)

    def proof(self) -> dict[str, Any]:
        raw = self.store.get_bytes(RUN, EP, PROOF)
        assert raw is not None
        data: dict[str, Any] = json.loads(raw)
        return data


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.ledger.close()


async def test_destroy_is_retried_until_confirmed_and_proved(rig: Rig) -> None:
    """Protects: failed or unconfirmed destroys are retried inside the window until the env
    is confirmed absent; the ledger row and destroy.json count every attempt and say so."""
    driver = ScriptedDriver(DriverError("kill failed"), present(), gone("run folder removed"))
    report = await rig.lease(driver).close()
    assert (report.env_id, report.confirmed_absent, report.attempts) == (ENV, True, 3)
    assert report.detail == "run folder removed" and report.elapsed_ms > 0
    assert driver.ids == [ENV, ENV, ENV]  # the lease's env, every time
    row = rig.ledger.get_env(ENV)
    assert row is not None and not row.live and row.destroy_attempts == 3
    assert row.destroy_started_at is not None and row.cleanup_ms == pytest.approx(report.elapsed_ms)
    proof = rig.proof()
    assert proof == {
        "env_id": ENV,
        "confirmed_absent": True,
        "attempts": 3,
        "cleanup_ms": round(report.elapsed_ms, 3),
        "detail": "run folder removed",
        "pid": os.getpid(),
    }
    assert rig.ledger.events(RUN, kind="env_leaked") == [] and rig.alerts == []


async def test_an_env_still_there_after_the_window_is_leaked_and_alerted(rig: Rig) -> None:
    """Protects: an env never confirmed gone within the window is reported as such (the last
    failure as detail), recorded env_leaked with that detail, alerted naming the env, its
    ledger row left live for the reaper, and the proof says confirmed_absent false."""
    driver = ScriptedDriver(present(), present(), OSError(5, "I/O error"))
    report = await rig.lease(driver, window_s=0.5).close()
    assert report.confirmed_absent is False and report.attempts == driver.calls >= 3
    row = rig.ledger.get_env(ENV)
    assert row is not None and row.live
    [leak] = rig.ledger.events(RUN, kind="env_leaked")
    assert leak.env_id == ENV and leak.episode_id == EP and leak.data["detail"] == report.detail
    [alert] = rig.alerts
    assert alert["env_id"] == ENV and alert["episode_id"] == EP and ENV in alert["message"]
    assert rig.proof()["confirmed_absent"] is False


async def test_a_hanging_destroy_is_cut_at_the_window(rig: Rig) -> None:
    """Protects: a destroy that never answers is cut when the cleanup window ends (TimeoutError
    is the detail); the close returns, unconfirmed, instead of hanging the episode."""
    report = await rig.lease(ScriptedDriver("hang"), window_s=0.3).close()
    assert not report.confirmed_absent and report.detail.startswith("TimeoutError")
    assert report.attempts >= 1


async def test_a_failing_error_detail_names_the_exception(rig: Rig) -> None:
    """Protects: the report's detail for a failed attempt names the exception and its text."""
    driver = ScriptedDriver(*[DriverError("kill -9 refused")] * 100)
    report = await rig.lease(driver, window_s=0.2).close()
    assert report.confirmed_absent is False and report.detail == "DriverError: kill -9 refused"


async def test_close_is_idempotent(rig: Rig) -> None:
    """Protects: a second close returns the one report and destroys nothing again."""
    driver = ScriptedDriver(gone())
    lease = rig.lease(driver)
    assert lease.report is None
    first = await lease.close()
    assert await lease.close() is first and lease.report is first and driver.calls == 1


async def test_neither_ledger_nor_store_failure_stops_the_destroy(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: a ledger that cannot record the destroy's start, and a store that cannot take
    the proof, do not stop the destroy or its confirmation."""

    def ledger_down(*args: object, **kwargs: object) -> None:
        raise LedgerError("database is locked")

    def store_down(*args: object, **kwargs: object) -> None:
        raise StoreError("bucket gone")

    monkeypatch.setattr(rig.ledger, "env_destroy_started", ledger_down)
    monkeypatch.setattr(rig.store, "put_bytes", store_down)
    report = await rig.lease(ScriptedDriver(gone())).close()
    assert report.confirmed_absent
    assert rig.ledger.get_env(ENV).live is False  # type: ignore[union-attr]


PLACE = f"the destroy proof {PROOF} of episode {EP} (run {RUN})"


@pytest.mark.parametrize(
    ("failure", "error"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            f"ENOSPC: cannot write {PLACE}: No space left on device",
        ),
        (StoreError("bucket gone"), f"cannot write {PLACE}: bucket gone"),
    ],
    ids=["disk-full", "store-error"],
)
async def test_a_proof_the_store_cannot_take_is_a_typed_error_recorded_not_a_lost_close(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, failure: Exception, error: str
) -> None:
    """Protects: an ``OSError`` while writing destroy.json (a full disk; before, it escaped
    ``close`` as a foreign exception: no report, and the episode's end never recorded)
    becomes an ``ExportError`` naming the proof, episode and run, recorded as
    ``destroy_proof_failed`` and alerted; the close returns its report and the ledger row
    keeps the confirmation. A ``StoreError`` (silently dropped before) is named the same way."""

    def store_fails(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(rig.store, "put_bytes", store_fails)
    lease = rig.lease(ScriptedDriver(gone()))
    report = await lease.close()
    assert report.confirmed_absent and lease.report is report
    assert rig.ledger.get_env(ENV).live is False  # type: ignore[union-attr]
    [event] = rig.ledger.events(RUN, kind="destroy_proof_failed")
    assert (event.env_id, event.episode_id, event.data) == (ENV, EP, {"error": error})
    assert rig.alerts == [{"message": error, "env_id": ENV, "episode_id": EP}]


async def test_no_store_means_the_ledger_row_only(rig: Rig) -> None:
    """Protects: a lease without a store (the isolation check) still destroys and confirms."""
    report = await rig.lease(ScriptedDriver(gone()), store=None).close()
    assert report.confirmed_absent and rig.store.get_bytes(RUN, EP, PROOF) is None


async def test_a_cancelled_close_still_finishes_the_destroy(rig: Rig) -> None:
    """Protects: cancelling the task that closes the lease does not cut the destroy short:
    it is confirmed and recorded, then the cancellation goes on; its cleanup time is in
    milliseconds (at least the destroy's 0.2 s, at most the close's own duration)."""
    started = asyncio.Event()

    class Slow(ScriptedDriver):
        async def destroy(self, env_id: str) -> DestroyReport:
            started.set()
            await asyncio.sleep(0.2)
            return gone()

    lease = rig.lease(Slow())
    before = time.monotonic()
    task = asyncio.ensure_future(lease.close())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    took_ms = (time.monotonic() - before) * 1000
    assert lease.report is not None and lease.report.confirmed_absent
    assert 200 <= lease.report.elapsed_ms <= took_ms  # milliseconds, of this close only
    assert rig.ledger.get_env(ENV).live is False  # type: ignore[union-attr]


async def test_a_lease_without_a_proof_path_writes_no_proof(rig: Rig) -> None:
    """Protects: an env with an episode but no proof path (the ledger row only) is destroyed
    and confirmed without writing anything into the episode's store folder."""
    lease = rig.lease(ScriptedDriver(gone()))
    lease.proof = None
    report = await lease.close()
    assert report.confirmed_absent
    assert not (rig.store.root / "runs").exists()


async def test_no_window_means_not_attempted_never_confirmed(rig: Rig) -> None:
    """Protects: with no cleanup window left (0 s) the lease claims nothing: no attempt, not
    confirmed absent, detail "not attempted", recorded env_leaked for the reaper."""
    driver = ScriptedDriver(gone())
    report = await rig.lease(driver, window_s=0.0).close()
    assert (report.env_id, report.confirmed_absent, report.attempts) == (ENV, False, 0)
    assert report.detail == "not attempted" and driver.calls == 0
    assert rig.proof()["detail"] == "not attempted"
    [leak] = rig.ledger.events(RUN, kind="env_leaked")
    assert leak.data["detail"] == "not attempted"


async def test_the_env_closes_itself_first(rig: Rig, tmp_path: Path) -> None:
    """Protects: a started env is destroyed by its own ``aclose`` first (it closes its agent
    session before the driver destroys it); the driver's bare destroy is only the retry."""
    closed: list[str] = []

    class SelfClosing:
        info = EnvInfo(ENV, "scripted", "none", "none", None, tmp_path, 0.0, 0.0)

        async def aclose(self) -> DestroyReport:
            closed.append(ENV)
            return gone("closed by its env")

    asked: list[EnvRequest] = []

    async def create(request: EnvRequest) -> Env:
        asked.append(request)
        return SelfClosing()  # type: ignore[return-value]

    driver = ScriptedDriver()
    lease = rig.lease(driver)
    request = object()  # what the episode asked for reaches the create as it is
    await lease.start(request, create)  # type: ignore[arg-type]
    assert asked == [request]
    report = await lease.close()
    assert report.confirmed_absent and report.detail == "closed by its env"
    assert closed == [ENV] and driver.calls == 0


async def test_spares_no_episode_took_are_destroyed_and_each_is_recorded(rig: Rig) -> None:
    """Protects: at a run's end every spare env is recorded by name in the run's events,
    spare_destroyed (with its cleanup time) when confirmed absent, env_leaked and an alert
    naming it when not; the ones still there are returned (the run reports them)."""

    class Spares(ScriptedDriver):
        async def release_spares(self) -> list[DestroyReport]:
            return [
                DestroyReport("spare-a", True, 1, 3.5, "gone"),
                DestroyReport("spare-b", False, 4, 9.0, "still there"),
            ]

    lease = rig.lease(Spares())
    assert await release_spares(lease.ctx, RUN) == ["spare-b"]
    [done] = rig.ledger.events(RUN, kind="spare_destroyed")
    assert (done.env_id, done.data) == ("spare-a", {"cleanup_ms": 3.5})
    [leak] = rig.ledger.events(RUN, kind="env_leaked")
    assert (leak.env_id, leak.data) == ("spare-b", {"cleanup_ms": 9.0})
    [alert] = rig.alerts
    assert alert["env_id"] == "spare-b" and "spare-b" in alert["message"]


async def test_every_try_is_bounded_by_what_is_left_of_the_window(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: each destroy try may wait only for what is left of the cleanup window (never
    more, never under the 0.1 s floor), so a destroy that hangs on a retry still ends the
    close at the window, not a full window later."""
    timeouts: list[float] = []
    real_wait_for = asyncio.wait_for

    async def spy(aw: Any, timeout: float) -> Any:
        timeouts.append(timeout)
        return await real_wait_for(aw, timeout)

    monkeypatch.setattr(lease_module.asyncio, "wait_for", spy)
    report = await rig.lease(ScriptedDriver(present(), "hang"), window_s=1.0).close()
    assert not report.confirmed_absent and report.attempts == len(timeouts) >= 2
    assert all(0.1 <= t <= 1.0 for t in timeouts), timeouts
    assert timeouts == sorted(timeouts, reverse=True) and timeouts[0] > timeouts[1]


async def test_the_retries_back_off_doubling_to_a_two_second_cap(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protects: the bounded backoff between destroy tries: 50 ms, doubling, never over 2 s
    (a struggling host is not hammered, and a retry still comes every 2 s in a long window)."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def spy(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(lease_module.asyncio, "sleep", spy)
    await rig.lease(ScriptedDriver(), window_s=0.3).close()
    assert waits[:9] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])


async def test_the_intent_row_names_its_run_episode_attempt_driver_and_owner(rig: Rig) -> None:
    """Protects: the ledger's intent (written before the env exists, what the reaper and a
    restarted controller go by) says whose env it is: run, episode, attempt, driver, owner."""
    lease = rig.lease(ScriptedDriver(gone()))
    row = rig.ledger.get_env(ENV)
    assert row is not None and row.state == "intent" and row.live
    assert (row.run_id, row.episode_id, row.attempt, row.driver) == (RUN, EP, 1, "scripted")
    assert (row.owner_controller, row.owner_pid) == ("c", os.getpid())
    await lease.close()
