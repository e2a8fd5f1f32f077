"""The ledger's own disk full (a real size-limited tmpfs under the ledger; CI runs as root).

Intent first: once the ledger cannot be written, the controller starts no further episode and
the run ends with a ``LedgerError`` naming the ledger; nothing durable is lost, no env is left
on the host; once space is freed a resume completes the run.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.states import Outcome
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import LedgerError
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from ..batch.test_controller import manifest
from ..conftest import make_fake_baseline
from ..vmkit import assert_nothing_left


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "ledger-fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1 << 9):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def test_a_write_on_a_full_disk_says_so_and_names_the_ledger(small_fs: Path) -> None:
    with Ledger(small_fs / "ledger.db") as ledger:
        ledger.event("before", run_id="r")
        fill(small_fs / "filler")
        with pytest.raises(LedgerError) as caught:
            for i in range(200):  # the WAL grows a page per event at most
                ledger.event("filling", run_id="r", i=i, pad="x" * 2000)
        assert "full" in str(caught.value) and str(small_fs / "ledger.db") in str(caught.value)
        assert "rollback" not in str(caught.value)  # the cause, not a second error over it
        (small_fs / "filler").unlink()
        ledger.event("after", run_id="r")  # the same connection works again
        kinds = [e.kind for e in ledger.events("r")]
    assert kinds[0] == "before" and kinds[-1] == "after"


async def test_a_full_ledger_stops_the_run_then_a_resume_completes_it(
    tmp_path: Path, small_fs: Path
) -> None:
    ledger = Ledger(small_fs / "ledger.db")
    store = LocalStore(tmp_path / "store")
    driver = FakeDriver(run_root=tmp_path / "run")
    started: list[str] = []
    filled: list[bool] = []

    def on_event(kind: str, data: dict[str, Any]) -> None:
        if kind == "episode_started":
            started.append(data["episode_id"])
        if kind == "episode_finished" and not filled:
            fill(small_fs / "filler")  # the disk fills up after the first episode
            filled.append(True)

    ctl = Controller(
        driver,
        ledger,
        store,
        options=RunOptions(parallel=1, cleanup_window_s=5, staging_dir=tmp_path / "staging"),
        on_event=on_event,
    )
    baseline = make_fake_baseline(tmp_path)
    batch = [manifest(f"e{i}", seed=i) for i in range(6)]
    try:
        with pytest.raises(LedgerError) as caught:
            await ctl.run(batch, baseline, run_id="full")
        text = str(caught.value)
        assert str(small_fs / "ledger.db") in text and "not started" in text, text
        assert started[:1] == ["e0"] and len(started) <= 2, started  # no intent, no start
        assert driver.list_owned() == []  # no env left on the host
        first = store.get_record("full", "e0")
        assert first is not None and first["outcome"] == Outcome.COMPLETED.value

        (small_fs / "filler").unlink()  # space freed: the resume completes the run
        result = await ctl.run(batch, baseline, run_id="full")
        assert sorted(result.skipped + [e.episode_id for e in result.episodes]) == sorted(
            m.episode_id for m in batch
        )
        assert store.get_record("full", "e0") == first  # nothing durable lost or redone
        for row in ledger.episodes("full"):
            assert row.outcome == Outcome.COMPLETED.value, row
        assert_nothing_left(driver, ledger, "full", store)
    finally:
        ledger.close()
