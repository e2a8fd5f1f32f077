"""Network is off by default: the VM has no network device, so nothing gets out."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.vmkit import request

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

pytestmark = pytest.mark.vm


async def test_an_episode_cannot_connect_or_resolve(
    tmp_path: Path, tiny_baseline: Baseline
) -> None:
    targets = ["1.1.1.1:53", "10.0.2.2:22", "127.0.0.1:22"]
    manifest = Manifest.model_validate(
        {
            "episode_id": "net",
            "seed": 1,
            "policy": {"id": "p"},
            "task": {"mode": "net", "targets": targets, "names": ["example.com", "localhost.x"]},
        }
    )
    with Ledger(tmp_path / "ledger.db") as ledger:
        ctl = Controller(
            QemuDriver(),
            ledger,
            LocalStore(tmp_path / "store"),
            options=RunOptions(parallel=1, staging_dir=tmp_path / "staging"),
        )
        result = await ctl.run([manifest], tiny_baseline, run_id="net")
    record = result.episodes[0].record
    assert record is not None, result.episodes[0].error
    info = record["info"]
    assert info["interfaces"] == ["lo"]  # no network device at all
    assert set(info["attempts"]) == {
        "1.1.1.1:53",
        "10.0.2.2:22",
        "127.0.0.1:22",
        "example.com",
        "localhost.x",
    }
    for what, outcome in info["attempts"].items():
        assert not outcome.startswith(("connected", "resolved")), (what, outcome)


async def test_a_vm_without_a_nic_loads_no_network_driver(tiny_baseline: Baseline) -> None:
    driver = QemuDriver()
    env = await driver.create(request(tiny_baseline))
    try:
        loaded = await env.exec(["sh", "-c", "ls /sys/module"])
        modules = set(loaded.check().stdout.decode().split())
        assert {"virtio_blk", "virtio_console", "erofs", "overlay"} <= modules  # it read them
        assert not modules & {"virtio_net", "net_failover", "failover"}  # ~0.1 s of boot saved
    finally:
        assert (await env.aclose()).confirmed_absent
