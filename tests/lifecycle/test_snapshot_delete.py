"""``delete_snapshot``: a fork snapshot's files deleted with bounded retries, the ledger says which.

A scripted driver (each delete answers as told) and a real ledger: a snapshot is confirmed
absent only when the driver says so, a delete that keeps failing is tried a bounded number of
times with growing waits, then recorded ``leaked`` with a ``snapshot_leaked`` event of its run
and an alert naming it (``cleanroom reap`` tries again).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.drivers.base import Owner
from cleanroom.errors import DriverError
from cleanroom.ledger import Ledger
from cleanroom.lifecycle import snapshots
from cleanroom.lifecycle.context import RunContext
from cleanroom.lifecycle.snapshots import DELETE_TRIES, delete_snapshot

RUN, SNAP = "run-s", "snap-s"


class ScriptedDriver:
    """Answers each ``delete_snapshot`` with the next step: a bool or an exception to raise;
    after the script, False (still there)."""

    name = "scripted"

    def __init__(self, *steps: bool | BaseException) -> None:
        self.steps, self.calls = list(steps), 0

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        assert snapshot_id == SNAP
        self.calls += 1
        step = self.steps.pop(0) if self.steps else False
        if isinstance(step, BaseException):
            raise step
        return step


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.ledger = Ledger(tmp / "ledger.db")
        self.ledger.start_run(
            RUN, controller_id="c", baseline="sha256:x", driver="scripted", parallel=1, meta={}
        )
        self.ledger.snapshot_intent(
            SNAP,
            run_id=RUN,
            group_id="g",
            driver="scripted",
            setup_digest="sha256:s",
            owner_controller="c",
            owner_pid=1,
            owner_host="h",
        )
        self.alerts: list[dict[str, Any]] = []
        self.waits: list[float] = []

    def ctx(self, driver: ScriptedDriver) -> RunContext:
        def emit(kind: str, **data: Any) -> None:
            if kind == "alert":
                self.alerts.append(data)

        return RunContext(driver, self.ledger, None, Owner("c"), emit=emit)  # type: ignore[arg-type]


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    r = Rig(tmp_path)

    async def no_wait(delay: float) -> None:
        r.waits.append(delay)

    monkeypatch.setattr(snapshots.asyncio, "sleep", no_wait)
    yield r
    r.ledger.close()


async def test_failed_deletes_are_retried_until_the_driver_confirms(rig: Rig) -> None:
    """Protects: a delete that raised or answered "still there" is retried; the snapshot is
    recorded absent (not live) only once the driver confirms; no leak, no alert."""
    driver = ScriptedDriver(DriverError("busy"), OSError(16, "busy"), False, True)
    assert await delete_snapshot(rig.ctx(driver), RUN, SNAP) is True
    assert driver.calls == 4
    snap = rig.ledger.get_snapshot(SNAP)
    assert snap is not None and snap.state == "absent" and not snap.live
    assert rig.ledger.events(RUN, kind="snapshot_leaked") == [] and rig.alerts == []


async def test_a_snapshot_never_confirmed_gone_is_leaked_and_alerted(rig: Rig) -> None:
    """Protects: a delete that never succeeds is tried DELETE_TRIES times, no more; it is
    recorded leaked (still live, for the reaper), a snapshot_leaked event of its run names it,
    and an alert names it; the caller is told False."""
    driver = ScriptedDriver(*[DriverError("busy")] * DELETE_TRIES)  # the last try raised too
    assert await delete_snapshot(rig.ctx(driver), RUN, SNAP) is False
    assert driver.calls == DELETE_TRIES == 5
    snap = rig.ledger.get_snapshot(SNAP)
    assert snap is not None and snap.state == "leaked" and snap.live
    [leak] = rig.ledger.events(RUN, kind="snapshot_leaked")
    assert leak.data == {"snapshot_id": SNAP}
    [alert] = rig.alerts
    assert SNAP in alert["message"]


async def test_the_retries_back_off_and_are_bounded(rig: Rig) -> None:
    """Protects: the bounded backoff: the waits start at 50 ms and double, so all the tries
    take under 2 s and a busy host is not hammered."""
    await delete_snapshot(rig.ctx(ScriptedDriver()), RUN, SNAP)
    assert rig.waits == pytest.approx([0.05 * 2**i for i in range(DELETE_TRIES)])
    assert sum(rig.waits) < 2.0


async def test_a_first_try_that_succeeds_waits_for_nothing(rig: Rig) -> None:
    """Protects: a confirmed first delete ends at once (no wait, one call)."""
    driver = ScriptedDriver(True)
    assert await delete_snapshot(rig.ctx(driver), RUN, SNAP) is True
    assert driver.calls == 1 and rig.waits == []
