"""``cleanroom check isolation`` without VMs: it must be able to fail.

The fake driver is no isolation at all (a host process): its files live in per-env folders that
die with the env, but a background process outlives it and every env shares the host's boot id.
The reusing driver shares one guest root between envs: files, config, caches and sysctls leak.
The same check passes on real VMs (tests/vm/test_checks.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cleanroom.checks.isolation import CLEANUP, IsolationCheck, IsolationReport, evaluate
from cleanroom.checks.isolation import canary as guest
from cleanroom.checks.isolation.audit import token_processes
from cleanroom.drivers.fake import FakeDriver
from cleanroom.host import cgroups, hostproc
from cleanroom.ledger import Ledger

from ...conftest import make_fake_baseline
from .reusing_driver import ReusingDriver

FILES = [*guest.FILES, *guest.APPENDS]


def statuses(report: IsolationReport, variant: str) -> dict[str, str]:
    [v] = [v for v in report.variants if v.name == variant]
    assert v.error is None, v.error
    return {name: cell.status for name, cell in v.cells.items()}


async def check(tmp_path: Path, driver: FakeDriver, **kwargs: Any) -> IsolationReport:
    baseline = make_fake_baseline(tmp_path)
    with Ledger(tmp_path / "ledger.db") as ledger:
        report = await IsolationCheck(driver, baseline, ledger, **kwargs).run()
        for env in ledger.envs(run_id=report.check_id):
            assert env.confirmed_absent_at is not None, env
    assert not token_processes([v.token for v in report.variants])  # the audit cleaned up
    for env_id in [e for v in report.variants for e in v.envs.values()]:
        assert not driver.exists(env_id) and not hostproc.pids_with_marker(env_id)
    return report


async def test_reusing_driver_fails_every_persistent_canary(tmp_path: Path) -> None:
    run_root = tmp_path / "run"
    factory = functools.partial(ReusingDriver, run_root=run_root)
    report = await check(tmp_path, factory(), driver_factory=factory)
    assert not report.ok
    has_cgroups = cgroups.detect() is not None
    for variant in ("sequential", "concurrent", "recovery"):
        cells = statuses(report, variant)
        for name in (*FILES, *guest.SYSCTLS, guest.BOOT_ID):
            assert cells[name] == "FAIL", (variant, name, cells)
        # destroy takes an env's whole process tree; a process still lives while its env does
        # (concurrent). After a controller's death (recovery) reap sweeps the env's cgroup,
        # setsid'd children included; with only the marker to go by it cannot find them.
        swept = variant == "sequential" or (variant == "recovery" and has_cgroups)
        assert cells[guest.PROCESS] == ("PASS" if swept else "FAIL"), (variant, cells)
        assert cells[guest.RANDOM] == "PASS"
        assert cells[guest.LOGIN] == "SKIP"  # no VM: a login shell would read the host's files
        assert cells[CLEANUP] == "PASS"
    leftovers = {(item.kind, item.what.split(":")[0]) for item in report.leftovers}
    assert any(kind == "file" for kind, _ in leftovers)  # the shared root keeps the canaries
    # with cgroups, destroy and reap took every planted process; without, the audit kills them
    assert any(kind == "process" for kind, _ in leftovers) is not has_cgroups, leftovers
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False
    assert data["variants"][0]["cells"]["file:/tmp"]["status"] == "FAIL"


async def test_fake_driver_isolates_files_and_processes_but_not_boot_id(tmp_path: Path) -> None:
    driver = FakeDriver(run_root=tmp_path / "run")
    report = await check(tmp_path, driver, variants=("sequential",))
    cells = statuses(report, "sequential")
    for name in (*FILES, *guest.SYSCTLS, guest.RANDOM, CLEANUP):
        assert cells[name] == "PASS", (name, cells)
    assert cells[guest.PROCESS] == "PASS"  # destroy took the double-forked process too
    assert cells[guest.BOOT_ID] == "FAIL"  # one host, one boot id
    assert not report.ok
    assert report.leftovers == []


def test_blind_canaries_do_not_pass() -> None:
    planted = {
        "planted": {"file:/tmp": "/tmp/x"},
        "skipped": {"etc:hosts": "read-only"},
        "observed": {guest.RANDOM: "aa", guest.BOOT_ID: "b1"},
    }
    nothing = {"seen": {}, "observed": {guest.RANDOM: "bb", guest.BOOT_ID: "b2"}}
    cells = evaluate(planted, nothing, nothing)
    assert cells["file:/tmp"].status == "BLIND"  # A could not see it itself: proves nothing
    assert cells["etc:hosts"].status == "SKIP"
    assert cells["file:/"].status == "SKIP"  # not planted
    assert cells[guest.RANDOM].status == "PASS" and cells[guest.BOOT_ID].status == "PASS"
    own = {"seen": {"file:/tmp": "exists"}, "observed": {}}
    assert evaluate(planted, own, nothing)["file:/tmp"].status == "PASS"


def test_cli_reports_and_exits_nonzero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cleanroom.checks.check_cli import check_app

    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    baseline = make_fake_baseline(tmp_path / "home")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        check_app,
        [
            "isolation",
            "--baseline",
            baseline.digest,
            "--driver",
            "fake",
            "--json",
            str(out),
            "--variant",
            "sequential",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "process:background" in result.output and "FAIL" in result.output
    assert "host audit" in result.output
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["variants"][0]["name"] == "sequential"
