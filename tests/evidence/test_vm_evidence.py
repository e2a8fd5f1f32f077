"""The evidence on real QEMU microVMs (TCG here): a batch run audits clean and a flipped
byte is named; a session replayed in a fresh VM diverges exactly where it read /dev/urandom."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.checks.audit import verify_run
from cleanroom.checks.replay import replay
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence import keys
from cleanroom.lifecycle.context import RunOptions
from cleanroom.sessions import session
from cleanroom.store import LocalStore
from tests import vmkit
from tests.vmkit import Harness, assert_nothing_left, manifest

pytestmark = pytest.mark.vm


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver())


async def test_a_vm_run_audits_clean_and_a_flipped_byte_is_named(
    harness: Harness, tiny_baseline: Baseline, tmp_path: Path
) -> None:
    ctl, ledger, store, driver = harness
    batch = [manifest("ok-1", 4, mode="ok"), manifest("fail-1", 1, mode="fail")]
    await ctl.run(batch, tiny_baseline, run_id="vm-audit")
    assert_nothing_left(driver, ledger, "vm-audit")
    trusted = [keys.signing_key().public_key()]
    report = verify_run(store, "vm-audit", trusted)
    assert report.ok, report.problems
    assert report.records == 2 and report.envs == 2
    copy = tmp_path / "copy"
    shutil.copytree(store.root, copy)
    hello = copy / "runs/vm-audit/episodes/ok-1/attempts/1/artifacts/hello.txt"
    hello.write_bytes(hello.read_bytes().replace(b"h", b"H", 1))
    broken = verify_run(LocalStore(copy), "vm-audit", trusted)
    assert broken.problems[0] == (
        "episode ok-1: attempts/1/artifacts/hello.txt does not match its signed digest"
    )


async def test_a_vm_session_replays_and_diverges_at_its_random_step(
    tiny_baseline: Baseline, tmp_path: Path
) -> None:
    from cleanroom.ledger import Ledger

    driver = QemuDriver()
    store = LocalStore(tmp_path / "store")
    options = RunOptions(cleanup_window_s=30)
    with Ledger(tmp_path / "ledger.db") as ledger:
        async with session(
            tiny_baseline, driver=driver, ledger=ledger, store=store, run_id="vs", options=options
        ) as sb:
            await sb.exec(["sh", "-c", "echo steady; uname -s"])
            await sb.exec(["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"])
            await sb.exec(["echo", "after"])
            sb.finish(reward=1.0)
        report = await replay(
            "vs", "session", store=store, driver=driver, ledger=ledger, replay_run_id="vs-again"
        )
        assert_nothing_left(driver, ledger, "vs-again")
    assert [(s.step, s.same) for s in report.steps[:3]] == [(1, True), (2, False), (3, True)]
    assert report.diverged_at is not None and report.diverged_at.step == 2
