"""``cleanroom check isolation`` on a busybox-only image (no Python), in real QEMU VMs.

Protects: the check works where its canary used to need python3. The native agent's envs get
the static C canary (``canary.c``); all three variants (sequential, concurrent, recovery) pass
every row, the login-shell row included (busybox ``sh -l``), and nothing is left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cleanroom.baseline.builder import build
from cleanroom.checks.isolation import IsolationCheck
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from tests.baseline import testimages
from tests.baseline.conftest import needs_root_tools

pytestmark = [pytest.mark.vm, pytest.mark.build]

ENTRY = b"#!/bin/sh\necho '{\"reward\": 0}' > /run/cleanroom/result.json\n"


async def test_isolation_check_passes_on_a_busybox_only_image(tmp_path: Path) -> None:
    needs_root_tools()
    config = {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "/opt/img/entry.sh"]}
    ref = testimages.save([testimages.busybox_layer(ENTRY)], config, tmp_path, "oci-archive")
    baseline = build(testimages.spec(tmp_path, "busybox-isolation", ref))
    driver = QemuDriver()
    with Ledger(tmp_path / "ledger.db") as ledger:
        report = await IsolationCheck(driver, baseline, ledger).run()
        envs = ledger.envs(run_id=report.check_id)
    bad = {
        (v.name, name): cell
        for v in report.variants
        for name, cell in v.cells.items()
        if cell.status != "PASS"
    }
    assert not bad, bad
    assert [v.name for v in report.variants] == ["sequential", "concurrent", "recovery"]
    assert all(v.error is None for v in report.variants)
    assert report.ok and report.leftovers == []
    assert len(envs) == 6 and all(e.confirmed_absent_at is not None for e in envs)
    assert not any(driver.exists(e.env_id) for e in envs)
