"""Console bytes are charged to the episode's output quota (issue 15 §8). Before, a guest that
flooded its serial console was bounded in rate only: it ran until its deadline (``timeout``,
not final, run again on every resume) and its console output was counted nowhere but
provenance. Now what the console printed during the RUN counts with every frame of output, and
a console alone past the quota ends the episode ``episode_error``, durable and final."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import QuotaExceeded
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc

from ..agent import test_hostile_vm
from ..vmkit import Harness, assert_nothing_left, harness, manifest

hostile_baseline = test_hostile_vm.hostile_baseline  # the fixture: built once, shared


async def test_a_console_alone_past_the_quota_ends_the_run() -> None:
    """A run that sends nothing while its console fills: QuotaExceeded naming the console,
    as soon as the quota is passed, and the run itself is cancelled (not left waiting)."""
    ring = hostproc.Ring(1024)
    ring.write(b"x" * 5000)  # printed before the RUN: not charged
    cancelled = asyncio.Event()

    async def run(charged: Callable[[], int]) -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def flood() -> None:
        for _ in range(10):
            await asyncio.sleep(0)
            ring.write(b"y" * 300)

    flooder = asyncio.ensure_future(flood())
    with pytest.raises(QuotaExceeded, match=r"quota of 2000 bytes \(console: \d+ bytes\)"):
        await asyncio.wait_for(hostproc.charged_to_console(ring, 2000, run), 10)
    await flooder
    assert cancelled.is_set()


async def test_console_bytes_since_the_run_began_are_what_is_charged() -> None:
    """``charged()`` is what the console printed since the RUN began; a run that finishes
    under the quota returns its result, and the ring's alarm is cleared after it."""
    ring = hostproc.Ring(64)
    ring.write(b"boot messages")
    seen = []

    async def run(charged: Callable[[], int]) -> str:
        seen.append(charged())
        ring.write(b"z" * 100)
        seen.append(charged())
        return "done"

    assert await hostproc.charged_to_console(ring, 1000, run) == "done"
    assert seen == [0, 100]
    ring.write(b"q" * 5000)  # no alarm left behind to fire
    assert ring._alarm is None


async def test_frames_and_console_share_one_quota() -> None:
    """The collector's quota counts the console too: 600 bytes of stdout after 500 of console
    pass a 1000-byte quota, though neither alone would."""
    from cleanroom.agent.results import Quota

    quota = Quota(1000, lambda: 500)
    quota.take(400)
    with pytest.raises(QuotaExceeded, match="console: 500 bytes"):
        quota.take(200)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    yield from harness(tmp_path, QemuDriver())


@pytest.mark.vm
async def test_a_guest_flooding_its_console_ends_episode_error_with_a_durable_record(
    h: Harness, hostile_baseline: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guest writing to its serial console without end (and nothing else) with a 1 MiB
    quota: ``episode_error``, final, with a durable record whose error names the console;
    the other episode of the batch completes and every env is confirmed absent. (The read
    rate cap is lifted so the guest fills its quota in seconds, not half a minute.)"""
    monkeypatch.setattr(hostproc, "CONSOLE_RATE", 64 << 20)
    monkeypatch.setattr(hostproc, "CONSOLE_BURST", 64 << 20)
    ctl, ledger, store, driver = h
    flood = Manifest.model_validate(
        {
            **manifest("flood", 1, mode="flood-console", seconds=120).model_dump(),
            "limits": {"output_quota_mib": 1, "timeout_s": 100},
        }
    )
    fine = manifest("fine", 2, mode="big-result", bytes=1000)
    result = await ctl.run([flood, fine], hostile_baseline, run_id="console-quota")
    by_id = {e.episode_id: e for e in result.episodes}
    assert by_id["flood"].outcome is Outcome.EPISODE_ERROR, by_id["flood"].error
    assert "console" in (by_id["flood"].error or "")
    assert by_id["fine"].outcome is Outcome.COMPLETED, by_id["fine"].error
    record = store.get_record("console-quota", "flood")
    assert record is not None and record["outcome"] == "episode_error"
    assert record["provenance"]["console_bytes"] > 1 << 20
    assert_nothing_left(driver, ledger, "console-quota", store)
