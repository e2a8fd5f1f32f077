"""End-to-end lifecycle on real QEMU microVMs (TCG here) from the tiny test baseline."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests import vmkit
from tests.stored import evidence, evidence_bytes
from tests.vmkit import CANARIES, Harness, assert_nothing_left, manifest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import DriftError
from cleanroom.ledger import Ledger

pytestmark = pytest.mark.vm


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver())


async def test_batch_outcomes_evidence_and_cleanup(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    ctl, ledger, store, driver = harness
    batch = [
        manifest("ok-1", 4, mode="ok"),
        manifest("fail-1", 1, mode="fail"),
        manifest("sleep-1", 2, mode="sleep", seconds=60, limits={"timeout_s": 3}),
        manifest("write-1", 3, mode="write", paths=CANARIES, probe=CANARIES),
    ]
    result = await ctl.run(batch, tiny_baseline, run_id="vm-batch")
    by_id = {e.episode_id: e for e in result.episodes}
    assert by_id["ok-1"].outcome == Outcome.COMPLETED, by_id["ok-1"].error
    assert by_id["fail-1"].outcome == Outcome.EPISODE_ERROR
    assert by_id["sleep-1"].outcome == Outcome.TIMEOUT
    assert by_id["write-1"].outcome == Outcome.COMPLETED, by_id["write-1"].error

    record = store.get_record("vm-batch", "ok-1")
    assert record is not None
    assert record["reward"] == 2.0  # tiny's "ok" mode: reward = seed * 0.5
    assert record["provenance"]["baseline"] == tiny_baseline.digest
    assert record["provenance"]["accelerator"] in ("kvm", "tcg")
    assert record["provenance"]["driver"] == "qemu"
    assert set(record["timings"]) >= {"queue_s", "provision_s", "run_s", "export_s"}
    folder = Path(store.episode_uri("vm-batch", "ok-1").removeprefix("file://"))
    names = {a["name"]: a for a in record["artifacts"]}
    assert "hello.txt" in names
    assert evidence(folder, "artifacts", "hello.txt").stat().st_size == names["hello.txt"]["size"]

    failed = store.get_record("vm-batch", "fail-1")
    assert failed is not None and failed["outcome"] == "episode_error"
    assert failed["exit"]["code"] == 3
    stderr = evidence_bytes(store, "vm-batch", "fail-1", "logs", "stderr.log")
    assert stderr, "the failing episode's stderr was not kept"

    timed_out = store.get_record("vm-batch", "sleep-1")
    assert timed_out is not None and timed_out["exit"]["timed_out"] is True

    assert_nothing_left(driver, ledger, "vm-batch")
    assert ledger.outcome_counts("vm-batch") == {"completed": 2, "episode_error": 1, "timeout": 1}


async def test_next_episode_sees_nothing_of_the_previous(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    await vmkit.writer_then_prober(harness, tiny_baseline, "vm-fresh")


async def test_modified_baseline_is_refused_by_name(
    tmp_path: Path,
    tiny_baseline: Baseline,
    harness: Harness,
) -> None:
    ctl, ledger, _, driver = harness
    copy = tmp_path / "baseline-copy"
    shutil.copytree(tiny_baseline.path, copy)
    initrd = copy / "initrd.cpio"
    data = bytearray(initrd.read_bytes())
    data[100] ^= 0xFF
    initrd.write_bytes(bytes(data))
    tampered = Baseline.from_json(copy, json.loads((copy / "baseline.json").read_text()))
    before = set(driver.list_owned())
    with pytest.raises(DriftError, match=r"initrd\.cpio"):
        await ctl.run([manifest("never", 1, mode="ok")], tampered, run_id="vm-drift")
    assert set(driver.list_owned()) == before
    assert ledger.envs(run_id="vm-drift") == []


def test_bad_manifest_lines_run_nothing(tmp_path: Path, tiny_baseline: Baseline) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"episode_id": "a", "seed": 1, "policy": {"id": "p"}})
        + "\n"
        + json.dumps({"episode_id": "b", "seed": "x", "policy": {"id": "p"}})
        + "\n"
        + "{broken\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cleanroom",
            "run",
            str(bad),
            "--baseline",
            tiny_baseline.digest,
            "--run-id",
            "vm-bad",
            "--store",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "line 2: seed" in proc.stderr and "line 3: not valid JSON" in proc.stderr
    with Ledger() as ledger:
        assert ledger.get_run("vm-bad") is None
    assert not (tmp_path / "store").exists()
