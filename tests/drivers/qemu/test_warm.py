"""Function entrypoints on real VMs: the warm baseline's worker imports ``entry`` before the
snapshot, and each clone's episode runs ``entry.run`` in the worker's child saved with it.
The native agent starts the worker at boot and relays each function episode to it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.batch.runner import Controller, RunOptions
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers.base import RunFolderDriver
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.evidence.manifest import Manifest
from cleanroom.ledger import Ledger
from cleanroom.store import LocalStore
from tests.stored import evidence_bytes

from ...conftest import ROOT
from ...vmkit import assert_nothing_left, request

pytestmark = pytest.mark.vm

WARM_SPEC = ROOT / "tests" / "baselines" / "warm" / "baseline.toml"


@pytest.fixture(scope="module")
def warm_baseline() -> Baseline:
    """The warm test baseline (a function entrypoint), built once and cached."""
    from cleanroom.baseline.resolve import resolve_or_build

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (run `make setup`)")
    baseline = resolve_or_build(str(WARM_SPEC))
    assert baseline.function is not None and baseline.entrypoint == ()
    return baseline


def manifest(eid: str, seed: int = 1, **fields: Any) -> Manifest:
    task = fields.pop("task", {})
    return Manifest.model_validate(
        {"episode_id": eid, "seed": seed, "policy": {"id": "warm"}, "task": task, **fields}
    )


class Run:
    """A controller over ``driver`` with its own ledger and store in ``tmp``."""

    def __init__(self, tmp: Path, driver: RunFolderDriver) -> None:
        self.tmp = tmp
        self.driver = driver
        self.ledger = Ledger(tmp / "ledger.db")
        self.store = LocalStore(tmp / "store")
        self.ctl = Controller(
            driver,
            self.ledger,
            self.store,
            options=RunOptions(parallel=2, cleanup_window_s=30, staging_dir=tmp / "staging"),
        )

    def record(self, run_id: str, eid: str) -> dict[str, Any]:
        record = self.store.get_record(run_id, eid)
        assert record is not None, eid
        return record

    def log(self, run_id: str, eid: str, name: str) -> str:
        return evidence_bytes(self.store, run_id, eid, "logs", name).decode()

    def assert_all_destroyed(self, run_id: str) -> None:
        assert_nothing_left(self.driver, self.ledger, run_id)


@pytest.fixture
def snap(tmp_path: Path) -> Iterator[Run]:
    run = Run(tmp_path, QemuDriver(start="snapshot"))
    yield run
    run.ledger.close()


async def test_five_clones_run_the_function_warm_and_draw_different_randoms(
    snap: Run, warm_baseline: Baseline
) -> None:
    manifests = [manifest(f"w{i}", seed=i) for i in range(5)]
    result = await snap.ctl.run(manifests, warm_baseline, run_id="warm-5")
    assert result.counts() == {"completed": 5}, [e.error for e in result.episodes]
    infos = []
    for i in range(5):
        record = snap.record("warm-5", f"w{i}")
        assert record["reward"] == i * 0.5
        provenance = record["provenance"]
        assert provenance["start"] == "snapshot"
        assert provenance["entry_kind"] == "function"
        assert provenance["entry_function"] == "entry:run"
        assert provenance["worker"] == "warm"  # imported before the episode: in the template
        assert [a["name"] for a in record["artifacts"]] == ["hello.txt"]
        assert f"warm: stdout w{i} seed={i}" in snap.log("warm-5", f"w{i}", "stdout.log")
        assert f"warm: stderr w{i}" in snap.log("warm-5", f"w{i}", "stderr.log")
        infos.append(record["info"])
    # each episode ran in the worker's child (the module was imported by its parent) ...
    assert all(info["ppid"] == info["imported_in"] != info["pid"] for info in infos)
    assert all(info["pgid"] == info["pid"] for info in infos)  # its own group: killable
    # ... the same child, saved in the template, restored in every clone ...
    assert len({(info["pid"], info["imported_in"]) for info in infos}) == 1
    # ... and still each clone drew its own randoms (reseeded from the host's RESEED bytes)
    randoms = [info["random"] for info in infos]
    assert len(set(randoms)) == 5, randoms
    snap.assert_all_destroyed("warm-5")


async def test_a_spare_warms_its_worker_and_its_episode_still_runs_in_the_saved_child(
    warm_baseline: Baseline, tmp_path: Path
) -> None:
    """A function baseline's spare runs WARM_UP ahead (its worker walks an episode's Python
    paths; no ``true``), and the episode that takes it still runs in the child the template
    saved, as a fresh clone's does, drawing a random of its own (the take's RESEED)."""
    driver = QemuDriver(start="snapshot")
    driver.keep_spares(1)
    limits = request(warm_baseline).limits
    first = driver.next_env_id(warm_baseline, limits)  # none ready: a fresh id
    # the template, then (this shape was asked for) a spare
    plain = await driver.create(dataclasses.replace(request(warm_baseline), env_id=first))
    outputs = []
    try:
        await driver.spares.settled()
        taken = driver.next_env_id(warm_baseline, limits)
        spare = driver.spares.taken[taken]
        assert spare.warmed == "worker", spare.session.hello.get("warm")
        env = await driver.create(dataclasses.replace(request(warm_baseline), env_id=taken))
        assert env.info.spare_s is not None
        for which, one in (("spare", env), ("plain", plain)):
            run = {
                "manifest": manifest(which).guest_view(),
                "function": warm_baseline.function.to_json(),  # type: ignore[union-attr]
                "timeout_s": 60,
                "env": {},
            }
            output = await one.run_episode(run, tmp_path / which, quota_bytes=1 << 24)
            assert output.exit.exit_code == 0, output.exit
            assert output.result_raw is not None
            outputs.append(json.loads(output.result_raw)["info"])
        await env.aclose()
    finally:
        await plain.aclose()
        await driver.release_spares()
    spare_info, plain_info = outputs
    assert spare_info["pid"] == plain_info["pid"]  # the child saved in the template, both
    assert spare_info["ppid"] == spare_info["imported_in"]
    assert spare_info["random"] != plain_info["random"]


async def test_failures_timeouts_and_secrets_behave_as_with_a_command(
    snap: Run, warm_baseline: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = "hf_WarmVmSecretValue"
    monkeypatch.setenv("HF_TOKEN", value)
    manifests = [
        manifest("raise", task={"mode": "raise"}),
        manifest("nondict", task={"mode": "nondict"}),
        manifest("slow", task={"mode": "sleep"}, limits={"timeout_s": 3}),
        manifest("leak", secrets=["HF_TOKEN"], task={"mode": "leak", "secret": "HF_TOKEN"}),
    ]
    result = await snap.ctl.run(manifests, warm_baseline, run_id="warm-f")
    outcomes = {e.episode_id: (e.outcome, e.error) for e in result.episodes}
    assert outcomes["raise"] == (Outcome.EPISODE_ERROR, "entrypoint failed (exit code 1)")
    assert outcomes["nondict"] == (Outcome.EPISODE_ERROR, "entrypoint failed (exit code 1)")
    assert outcomes["slow"][0] is Outcome.TIMEOUT, outcomes["slow"]
    assert outcomes["leak"][0] is Outcome.COMPLETED, outcomes["leak"]
    stderr = snap.log("warm-f", "raise", "stderr.log")
    assert "Traceback (most recent call last)" in stderr and "ValueError: boom in raise" in stderr
    assert "returned list, not a dict" in snap.log("warm-f", "nondict", "stderr.log")
    slow = snap.record("warm-f", "slow")
    assert slow["exit"]["timed_out"] is True and slow["exit"]["signal"] == 9
    leak = snap.record("warm-f", "leak")
    assert leak["info"] == {"leak": "[REDACTED:HF_TOKEN]", "file_matches": True}
    assert leak["secrets"]["redactions"]["HF_TOKEN"] >= 4
    stored = [p for p in (snap.tmp / "store").rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if value.encode() in p.read_bytes()]
    snap.assert_all_destroyed("warm-f")


async def test_a_cold_boot_starts_the_worker_at_boot(
    tmp_path: Path, warm_baseline: Baseline
) -> None:
    run = Run(tmp_path, QemuDriver(start="cold"))
    try:
        result = await run.ctl.run([manifest("cold", seed=4)], warm_baseline, run_id="warm-c")
        assert result.counts() == {"completed": 1}, result.episodes[0].error
        record = run.record("warm-c", "cold")
        assert record["reward"] == 2.0
        assert record["provenance"]["start"] == "cold"
        assert record["provenance"]["worker"] == "warm"  # ready before HELLO, before the RUN
        run.assert_all_destroyed("warm-c")
    finally:
        run.ledger.close()


async def test_gvisor_runs_a_function_entry(
    tmp_path: Path, warm_baseline: Baseline, gvisor_usable: None
) -> None:
    run = Run(tmp_path, GvisorDriver(run_root=tmp_path / "run"))
    try:
        result = await run.ctl.run([manifest("gv", seed=8)], warm_baseline, run_id="warm-g")
        assert result.counts() == {"completed": 1}, result.episodes[0].error
        record = run.record("warm-g", "gv")
        assert record["reward"] == 4.0
        assert record["provenance"]["isolation"] == "userspace-kernel"
        assert record["provenance"]["entry_kind"] == "function"
        info = record["info"]
        assert info["ppid"] == info["imported_in"] != info["pid"]
        run.assert_all_destroyed("warm-g")
    finally:
        run.ledger.close()
