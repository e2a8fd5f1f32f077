"""Fork for groups on real QEMU microVMs (TCG here): one setup in a warm parent, N clones.

The setup writes a file in the parent; every clone sees it, yet each has its own entropy, boot
id and clone id; the parent and its snapshot files are gone afterwards, on success, when the
setup fails, and after the controller is SIGKILLed mid-setup (``reap``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cleanroom.api as cr
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import Env, EnvRequest, new_snapshot_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.drivers.qemu import fork as qemu_fork
from cleanroom.evidence.manifest import Manifest
from cleanroom.evidence.provenance import missing
from cleanroom.ledger import Ledger
from cleanroom.lifecycle.reaper import reap
from cleanroom.store import LocalStore

from ... import vmkit
from ...conftest import TINY_SPEC
from ...vmkit import Harness, assert_gone

pytestmark = pytest.mark.vm

WARM = "/root/warm.txt"
SETUP = ["sh", "-c", f"head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > {WARM}"]
PROBES = [WARM, "/proc/sys/kernel/random/boot_id", "/proc/sys/kernel/random/uuid"]
LIMITS = ResolvedLimits(timeout_s=60, memory_mib=256, vcpus=1)


def group(gid: str, setup: list[str], n: int = 3, **task: Any) -> list[Manifest]:
    episodes = [
        {"episode_id": f"{gid}-{i}", "seed": i, "policy": {"id": "fork"}, "task": task}
        for i in range(n)
    ]
    return cr.group(gid, {"command": setup, "timeout_s": 120}, episodes)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    yield from vmkit.harness(tmp_path, QemuDriver(start="snapshot"), parallel=3)


async def test_three_clones_share_the_setup_and_nothing_else(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    ctl, ledger, store, driver = harness
    batch = group("warm", SETUP, mode="write", paths=[], probe=PROBES)
    result = await ctl.run(batch, tiny_baseline, run_id="fork-ok")
    assert result.counts() == {"completed": 3}, [e.error for e in result.episodes]
    [report] = result.groups
    records = [store.get_record("fork-ok", f"warm-{i}") for i in range(3)]
    seen = []
    for record in records:
        assert record is not None and missing(record) == []
        group_facts = record["provenance"]["group"]
        assert record["provenance"]["start"] == "fork"
        assert group_facts["mode"] == "fork" and group_facts["digest"] == report.digest
        assert group_facts["snapshot"] == report.snapshot and report.snapshot is not None
        assert group_facts["parent_env"] == report.parent_env
        seen.append(record["info"]["seen"])
    warm = {s[WARM] for s in seen}
    assert len(warm) == 1 and len(warm.pop()) == 16  # the parent's file, in every clone
    assert len({s["/proc/sys/kernel/random/boot_id"] for s in seen}) == 3
    assert len({s["/proc/sys/kernel/random/uuid"] for s in seen}) == 3
    clones = [r["provenance"]["env_id"] for r in records if r is not None]
    assert len(set(clones)) == 3 and report.parent_env not in clones
    for env in ledger.envs(run_id="fork-ok"):
        assert env.confirmed_absent_at is not None
        assert_gone(driver, env.env_id)
    [snap] = ledger.snapshots(run_id="fork-ok")
    assert snap.state == "absent" and snap.group_digest == report.digest
    assert report.snapshot_id == snap.snapshot_id
    assert not qemu_fork.folder(snap.snapshot_id).exists()
    # timed, not speed-checked: the target (snapshot < 5 s) is bench/fork.py's
    assert report.timings["snapshot_s"] > 0 and report.timings["setup_s"] > 0


async def test_a_failing_setup_fails_every_episode_and_leaves_nothing(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    ctl, ledger, store, driver = harness
    broken = ["sh", "-c", "echo 'pip: no such package' >&2; exit 7"]
    result = await ctl.run(group("broken", broken), tiny_baseline, run_id="fork-bad")
    assert result.counts() == {"infra_error": 3}
    for episode in result.episodes:
        assert episode.outcome is Outcome.INFRA_ERROR
        assert episode.error is not None and episode.error.startswith("setup_failed:")
        assert "exit 7" in episode.error and "pip: no such package" in episode.error
        folder = Path(store.episode_uri("fork-bad", episode.episode_id).removeprefix("file://"))
        assert b"no such package" in (folder / "attempts/1/logs/setup-stderr.log").read_bytes()
    [parent] = ledger.envs(run_id="fork-bad")  # no clone was ever made
    assert parent.episode_id is None and parent.confirmed_absent_at is not None
    assert_gone(driver, parent.env_id)
    [snap] = ledger.snapshots(run_id="fork-bad")
    assert snap.state == "absent" and not qemu_fork.folder(snap.snapshot_id).exists()


async def test_clones_diverge_and_the_parent_is_gone_before_they_start(
    tiny_baseline: Baseline,
) -> None:
    driver = QemuDriver(start="snapshot")

    def request() -> EnvRequest:
        return vmkit.request(tiny_baseline, LIMITS, "fork-tests")

    sid = new_snapshot_id()
    parent = await driver.fork_parent(request(), sid)
    clones: list[Env] = []
    try:
        (await parent.exec(SETUP)).check()
        snap = await driver.fork_save(parent, sid)
        assert_gone(driver, parent.env_id)  # sealed only after the parent was confirmed gone
        assert snap.facts["state_bytes"] < 1 << 20  # device state only: RAM stayed in its file
        clones = list(await asyncio.gather(*(driver.fork_clone(request(), snap) for _ in range(3))))
        assert await driver.delete_snapshot(sid)  # the clones' private mappings outlive it
        probe = "cat /root/warm.txt; echo; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
        outputs = [(await c.exec(["sh", "-c", probe])).check().stdout.split() for c in clones]
    finally:
        await parent.aclose()
        reports = [await c.aclose() for c in clones]
        await driver.delete_snapshot(sid)
    assert [c.hello["clone_id"] for c in clones] == [c.env_id for c in clones]
    assert all(c.info.start_kind == "fork" and c.hello["reseeded"] for c in clones)
    assert len({out[0] for out in outputs}) == 1  # the setup's file, in every clone
    assert len({out[1] for out in outputs}) == 3  # each clone's own entropy
    assert all(r.confirmed_absent for r in reports) and sid not in driver.list_snapshots()


async def test_without_a_template_the_parent_boots_cold_and_still_forks(
    tiny_baseline: Baseline,
) -> None:
    driver = QemuDriver(start="cold")
    sid = new_snapshot_id()
    parent = await driver.fork_parent(vmkit.request(tiny_baseline, LIMITS, "fork-tests"), sid)
    clones: list[Env] = []
    try:
        assert parent.info.start_kind == "cold" and parent.info.template is None
        (await parent.exec(SETUP)).check()
        snap = await driver.fork_save(parent, sid)
        assert snap.facts["parent_start"] == "cold" and snap.facts["template"] is None
        for _ in range(2):
            request = vmkit.request(tiny_baseline, LIMITS, "fork-tests")
            clones.append(await driver.fork_clone(request, snap))
        probe = f"cat {WARM}; echo; cat /proc/sys/kernel/random/uuid"
        outputs = [(await c.exec(["sh", "-c", probe])).check().stdout.split() for c in clones]
    finally:
        await parent.aclose()
        reports = [await c.aclose() for c in clones]
        assert await driver.delete_snapshot(sid)
    assert outputs[0][0] == outputs[1][0] and outputs[0][1] != outputs[1][1]
    assert all(r.confirmed_absent for r in reports)
    assert_gone(driver, parent.env_id)


CRASHING_CONTROLLER = """
import asyncio, json, sys
from pathlib import Path
import cleanroom.api as cr
from cleanroom.baseline.resolve import resolve_or_build
from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

cfg = json.loads(sys.argv[1])
batch = cr.group("crash", ["sleep", "300"], [
    {"episode_id": f"crash-{i}", "seed": i, "policy": {"id": "fork"}} for i in range(2)])
ledger, store = Ledger(Path(cfg["ledger"])), LocalStore(Path(cfg["store"]))
ctl = Controller(QemuDriver(start="snapshot"), ledger, store, options=RunOptions(parallel=2))
asyncio.run(ctl.run(batch, resolve_or_build(cfg["spec"]), run_id="fork-crash"))
"""


async def test_a_controller_killed_during_the_setup_leaves_nothing_reap_cannot_delete(
    tmp_path: Path, tiny_baseline: Baseline
) -> None:
    cfg = {"ledger": str(tmp_path / "ledger.db"), "store": str(tmp_path / "store")}
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_CONTROLLER, json.dumps({**cfg, "spec": str(TINY_SPEC)})],
        start_new_session=True,
    )
    with Ledger(Path(cfg["ledger"])) as ledger:
        try:
            deadline = time.monotonic() + 240
            while not any(e.ready_at for e in _envs(ledger)):
                assert child.poll() is None and time.monotonic() < deadline
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)  # mid-setup: parent alive, snapshot made
            child.wait()
        [parent] = _envs(ledger)
        [snap] = ledger.snapshots(run_id="fork-crash")
        assert qemu_fork.folder(snap.snapshot_id).exists()
        driver = QemuDriver(start="snapshot")
        report = await reap(driver, ledger, LocalStore(Path(cfg["store"])))
        assert parent.env_id in report.destroyed and snap.snapshot_id in report.snapshots
        assert_gone(driver, parent.env_id)
        assert not qemu_fork.folder(snap.snapshot_id).exists()
        assert not ledger.get_snapshot(snap.snapshot_id).live  # type: ignore[union-attr]
        assert ledger.get_env(parent.env_id).confirmed_absent_at  # type: ignore[union-attr]


def _envs(ledger: Ledger) -> list[Any]:
    try:
        return ledger.envs(run_id="fork-crash")
    except Exception:  # the child may still be creating the schema
        return []
