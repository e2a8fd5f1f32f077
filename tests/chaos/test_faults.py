"""Chaos on real VMs: inject a fault, then check the invariants that must survive it.

After every fault: each episode has exactly one outcome, no durable record is lost or doubled,
and no QEMU process, run folder or socket of the run remains.
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

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import ExportError
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc, paths
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore

from ..drivers.spoof import spoofer
from ..vmkit import assert_records_match
from .conftest import record_fault

pytestmark = pytest.mark.vm


def manifest(eid: str, seed: int = 1, **task: Any) -> Manifest:
    limits = task.pop("limits", {})
    return Manifest.model_validate(
        {"episode_id": eid, "seed": seed, "policy": {"id": "chaos"}, "task": task, "limits": limits}
    )


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.driver = QemuDriver()
        self.ctl = Controller(
            self.driver,
            self.ledger,
            self.store,
            options=RunOptions(parallel=2, cleanup_window_s=30, staging_dir=tmp / "staging"),
        )

    def invariants(self, run_id: str) -> None:
        rows = self.ledger.episodes(run_id)
        assert all(r.outcome is not None for r in rows), rows
        for env in self.ledger.envs(run_id=run_id):
            assert env.confirmed_absent_at is not None, env
            assert not self.driver.exists(env.env_id)
        records = list((self.tmp / "store" / "runs" / run_id / "episodes").glob("*/result.json"))
        assert len(records) == len({p.parent.name for p in records})
        assert_records_match(self.ledger, self.ctl.store, run_id)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(tmp_path)
    yield rig
    rig.ledger.close()


async def test_guest_side_faults(rig: Rig, tiny_baseline: Baseline) -> None:
    """Panic, a killed agent, garbage on the channel, an escaping artifact, a hang."""
    batch = [
        manifest("panic", mode="panic"),
        manifest("kill-agent", mode="kill-agent"),
        manifest("garbage", mode="garbage"),
        manifest("evil", mode="evil-artifact"),
        manifest("hang", mode="sleep", seconds=600, limits={"timeout_s": 3}),
        manifest("control", mode="ok"),
    ]
    result = await rig.ctl.run(batch, tiny_baseline, run_id="chaos-guest")
    got = {e.episode_id: e for e in result.episodes}
    expected = {
        "panic": "env_crashed",
        "kill-agent": "env_crashed",
        "garbage": "episode_error",
        "evil": "episode_error",
        "hang": "timeout",
        "control": "completed",
    }
    for eid, want in expected.items():
        record_fault(f"guest: {eid}", want, got[eid].outcome.value)
    assert {k: v.outcome.value for k, v in got.items()} == expected
    assert "ProtocolError" in (got["garbage"].error or "")
    assert "UnsafePath" in (got["evil"].error or "")
    assert not (rig.tmp / "escape").exists() and not (rig.tmp / "staging" / "escape").exists()
    panic_logs = rig.tmp / "store/runs/chaos-guest/episodes/panic/attempts/1/logs/console.log"
    assert b"Kernel panic" in panic_logs.read_bytes()
    for eid in ("garbage", "evil"):  # the guest's fault: final, durable, not run again
        record = rig.store.get_record("chaos-guest", eid)
        assert record is not None and record["outcome"] == "episode_error"
    rig.invariants("chaos-guest")
    again = await rig.ctl.run(batch[2:4], tiny_baseline, run_id="chaos-guest")
    assert sorted(again.skipped) == ["evil", "garbage"] and again.episodes == []


class FaultyQemu(QemuDriver):
    """Real VMs whose RUN raises ``fault`` after the real episode answered: a parser bug or a
    guest input no boundary caught (RecursionError from a deep result, say)."""

    def __init__(self, fault: Exception) -> None:
        super().__init__()
        self.fault = fault

    async def create(self, request: EnvRequest) -> Env:
        env = await super().create(request)
        if request.labels.get("episode_id") == "victim":
            real = env.run_episode

            async def broken(*args: Any, **kwargs: Any) -> Any:
                await real(*args, **kwargs)
                raise self.fault

            env.run_episode = broken  # type: ignore[method-assign]
        return env


async def test_an_unexpected_exception_ends_only_its_episode(
    rig: Rig, tiny_baseline: Baseline
) -> None:
    """Protects (real VMs): a RecursionError out of one episode ends it infra_error with its
    traceback kept and its VM destroyed and confirmed absent; the other episode completes
    (before: the exception aborted the batch and the VM lived until its hard deadline)."""
    rig.ctl.driver = rig.driver = FaultyQemu(RecursionError("too deep (simulated)"))
    batch = [manifest("victim", mode="ok"), manifest("bystander", mode="ok")]
    result = await rig.ctl.run(batch, tiny_baseline, run_id="chaos-bug")
    got = {e.episode_id: e for e in result.episodes}
    record_fault("unexpected exception in RUN", "infra_error", got["victim"].outcome.value)
    assert got["victim"].outcome.value == "infra_error" and got["bystander"].outcome.value == (
        "completed"
    )
    trace = rig.tmp / "store/runs/chaos-bug/episodes/victim/attempts/1/logs/traceback.txt"
    assert "RecursionError" in trace.read_text()
    rig.invariants("chaos-bug")
    assert rig.driver.list_owned() == []


async def test_qemu_sigkilled_mid_episode(rig: Rig, tiny_baseline: Baseline) -> None:
    async def killer() -> None:
        while True:
            await asyncio.sleep(0.1)
            for env in rig.ledger.envs(run_id="chaos-kill"):
                if env.ready_at is not None and env.pid:
                    os.killpg(env.pid, signal.SIGKILL)
                    return

    task = asyncio.create_task(killer())
    result = await rig.ctl.run(
        [manifest("victim", mode="sleep", seconds=120)], tiny_baseline, run_id="chaos-kill"
    )
    task.cancel()
    record_fault("SIGKILL of QEMU", "env_crashed", result.episodes[0].outcome.value)
    assert result.episodes[0].outcome.value == "env_crashed"
    rig.invariants("chaos-kill")


async def test_another_users_process_named_like_an_env(rig: Rig, tiny_baseline: Baseline) -> None:
    """Protects (real VMs, issue 15 §6): a ``nobody`` process named like each env of a run
    (``exec -a cleanroom-env-<id>``, from the env's intent on) neither fails nor leaks the run,
    nor is signalled (before: destroy SIGKILLed it and needed a second try)."""
    spoofers: list[subprocess.Popen[bytes]] = []

    async def spoof() -> None:
        seen: set[str] = set()
        while True:
            await asyncio.sleep(0.02)
            for env in rig.ledger.envs(run_id="chaos-spoof"):
                if env.env_id not in seen:
                    seen.add(env.env_id)
                    spoofers.append(spoofer(env.env_id, str(rig.driver.run_root)))

    task = asyncio.create_task(spoof())
    try:
        batch = [manifest("a", mode="ok"), manifest("b", mode="sleep", seconds=1)]
        result = await rig.ctl.run(batch, tiny_baseline, run_id="chaos-spoof")
        task.cancel()
        outcomes = sorted(e.outcome.value for e in result.episodes)
        record_fault("another user's process named like an env", "completed", outcomes[0])
        assert outcomes == ["completed", "completed"]
        rig.invariants("chaos-spoof")
        assert rig.driver.list_owned() == []
        assert spoofers and all(p.poll() is None for p in spoofers)  # never signalled
    finally:
        task.cancel()
        for proc in spoofers:
            proc.kill()
            proc.wait()


async def test_store_that_raises(rig: Rig, tiny_baseline: Baseline) -> None:
    def broken(*a: object, **k: object) -> bool:
        raise ExportError("simulated backend outage")

    rig.store.put_record = broken  # type: ignore[method-assign]
    result = await rig.ctl.run([manifest("x", mode="ok")], tiny_baseline, run_id="chaos-store")
    record_fault("store raises on write", "export_failed", result.episodes[0].outcome.value)
    assert result.episodes[0].outcome.value == "export_failed"
    rig.invariants("chaos-store")


async def test_full_disk_under_the_store(rig: Rig, tiny_baseline: Baseline) -> None:
    mnt = rig.tmp / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        rig.ctl.store = store = LocalStore(mnt)
        ok = manifest("fits", mode="ok")
        big = manifest("too-big", mode="big", bytes=4 * 1024 * 1024)
        first = await rig.ctl.run([ok], tiny_baseline, run_id="chaos-disk")
        second = await rig.ctl.run([big], tiny_baseline, run_id="chaos-disk")
        record_fault("full disk under the store", "export_failed", second.episodes[0].outcome.value)
        assert first.episodes[0].outcome.value == "completed"
        assert second.episodes[0].outcome.value == "export_failed"
        assert "ENOSPC" in (second.episodes[0].error or "")
        assert store.get_record("chaos-disk", "fits") is not None  # earlier evidence intact
        assert store.get_record("chaos-disk", "too-big") is None
        rig.invariants("chaos-disk")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- the controller itself dies --------------------------------------------------------------------


def _write_manifests(path: Path, items: list[Manifest]) -> None:
    path.write_text("".join(json.dumps(m.model_dump(mode="json")) + "\n" for m in items))


def _cli(args: list[str], tmp: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cleanroom", *args, "--store", str(tmp / "store")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "CI": "true"},
    )


def _wait_running(run_id: str, count: int, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with Ledger() as ledger:
            if len([e for e in ledger.envs(run_id=run_id) if e.ready_at]) >= count:
                return
        time.sleep(0.2)
    raise AssertionError(f"{count} envs of {run_id} never became ready")


def _no_qemu_of(run_id: str, *, processes_only: bool = False) -> list[str]:
    """Envs of the run with anything left on the host (or only: with a process left)."""
    with Ledger() as ledger:
        envs = ledger.envs(run_id=run_id)
    driver = QemuDriver()
    if processes_only:
        return [e.env_id for e in envs if hostproc.pids_with_marker(e.env_id)]
    return [e.env_id for e in envs if driver.exists(e.env_id)]


def test_sigterm_of_the_controller_cancels_and_cleans(
    tmp_path: Path, tiny_baseline: Baseline
) -> None:
    run_id = f"chaos-term-{os.getpid()}"
    path = tmp_path / "m.jsonl"
    _write_manifests(path, [manifest(f"t{i}", mode="sleep", seconds=300) for i in range(3)])
    argv = ["run", str(path), "--baseline", tiny_baseline.digest, "--run-id", run_id]
    proc = _cli([*argv, "--spares", "2"], tmp_path)  # on 2 cores the default keeps none
    _wait_running(run_id, 2)
    end = time.monotonic() + 120
    while not _spares_of(proc.pid) and time.monotonic() < end:
        time.sleep(0.1)
    spares = [o["env_id"] for o in _spares_of(proc.pid)]
    assert spares, "the controller keeps spare VMs: SIGTERM must take them down too"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    with Ledger() as ledger:
        outcomes = {r.episode_id: r.outcome for r in ledger.episodes(run_id)}
    record_fault(
        "SIGTERM of the controller",
        "exit 130, cancelled",
        f"exit {proc.returncode}, " + ",".join(sorted({str(o) for o in outcomes.values() if o})),
    )
    assert proc.returncode == 130, out.decode()
    assert sorted(o for o in outcomes.values() if o) == ["cancelled", "cancelled"]
    assert _no_qemu_of(run_id) == []
    # spares have no ledger row: gone by their owner records and their processes
    assert _owned_by(proc.pid) == []
    assert [s for s in spares if hostproc.pids_with_marker(s)] == []


def _owned_by(pid: int) -> list[dict[str, Any]]:
    """The owner records of the qemu run folders a controller process left."""
    owners = []
    for path in paths.run_dir().glob("qemu/env-*/owner.json"):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(path.read_text())
            if owner.get("pid") == pid:
                owners.append(owner)
    return owners


def _spares_of(pid: int) -> list[dict[str, Any]]:
    return [o for o in _owned_by(pid) if o.get("labels", {}).get("spare") == "true"]


def test_sigkill_of_the_controller_then_resume(tmp_path: Path, tiny_baseline: Baseline) -> None:
    run_id = f"chaos-kill9-{os.getpid()}"
    path = tmp_path / "m.jsonl"
    items = [
        manifest("quick", mode="ok"),
        # still running at the kill (asserted below), finished within their limit on resume
        manifest("slow1", mode="sleep", seconds=20, limits={"timeout_s": 90}),
        manifest("slow2", mode="sleep", seconds=20, limits={"timeout_s": 90}),
    ]
    _write_manifests(path, items)
    proc = _cli(
        [
            "run",
            str(path),
            "--baseline",
            tiny_baseline.digest,
            "--run-id",
            run_id,
            "--parallel",
            "3",
            "--spares",
            "3",
        ],
        tmp_path,
    )
    store = LocalStore(tmp_path / "store")
    end = time.monotonic() + 180
    while store.get_record(run_id, "quick") is None and time.monotonic() < end:
        time.sleep(0.1)
    while not _spares_of(proc.pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert _spares_of(proc.pid), "the controller keeps spare VMs: one must be there to kill"
    with Ledger() as ledger:  # the precondition: both slow episodes are mid-run
        running = {r.episode_id for r in ledger.episodes(run_id) if r.outcome is None}
    assert {"slow1", "slow2"} <= running, running
    assert store.get_record(run_id, "slow1") is None and store.get_record(run_id, "slow2") is None
    killed_at = time.monotonic()
    proc.kill()
    proc.wait()
    while _no_qemu_of(run_id, processes_only=True) and time.monotonic() - killed_at < 10:
        time.sleep(0.01)
    deadman_s = time.monotonic() - killed_at
    assert _no_qemu_of(run_id, processes_only=True) == [], "VMs outlived their controller"
    # restart with the same run id: the lost attempts are reaped and run again
    again = _cli(
        [
            "run",
            str(path),
            "--baseline",
            tiny_baseline.digest,
            "--run-id",
            run_id,
            "--parallel",
            "3",
            "--spares",
            "3",
        ],
        tmp_path,
    )
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out.decode()
    with Ledger() as ledger:
        latest = {r.episode_id: (r.attempt, r.outcome) for r in ledger.episodes(run_id)}
        every = ledger.episodes(run_id, all_attempts=True)
    assert latest["quick"] == (1, "completed")  # durable before the kill: not rerun
    assert latest["slow1"][1] == latest["slow2"][1] == "completed"
    lost = [r for r in every if r.attempt == 1 and r.episode_id != "quick"]
    assert {r.outcome for r in lost} == {"infra_error"}
    records = list((tmp_path / "store" / "runs" / run_id / "episodes").glob("*/result.json"))
    assert sorted(p.parent.name for p in records) == ["quick", "slow1", "slow2"]
    assert _no_qemu_of(run_id) == []  # the restart reaped the run folders too
    assert all(
        json.loads(p.read_text())["labels"].get("run_id") != run_id
        for p in paths.run_dir().glob("qemu/env-*/owner.json")
    )
    assert _owned_by(proc.pid) == [] and _owned_by(again.pid) == []  # spares too
    record_fault(
        "SIGKILL of the controller + resume",
        "no VM left, resumed",
        "no VM left, resumed",
        f"QEMU gone {deadman_s * 1000:.0f} ms after the kill",
    )
    assert hostproc.env_ids_running().isdisjoint({r.env_id for r in every if r.env_id})
