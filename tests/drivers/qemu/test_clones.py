"""Snapshot starts on real QEMU microVMs (TCG here): clones of the tiny baseline's template."""

from __future__ import annotations

import asyncio
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.core.states import Outcome
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import Env
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.errors import DriftError, DriverError
from cleanroom.evidence.manifest import Manifest
from cleanroom.host import hostproc

from ... import vmkit
from ...vmkit import Harness, assert_gone, request

pytestmark = pytest.mark.vm

PROBE = (
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
    "cat /proc/sys/kernel/random/boot_id; "
    "python3 -c 'import random; print(random.random())'; "
    "date +%s"
)


def manifest(eid: str, seed: int, **task: Any) -> Manifest:
    return vmkit.manifest(eid, seed, policy="snap", **task)


async def test_a_clone_runs_an_episode_to_a_durable_record(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    ctl, ledger, store, driver = harness
    result = await ctl.run([manifest("clone-ok", 6, mode="ok")], tiny_baseline, run_id="snap-ok")
    episode = result.episodes[0]
    assert episode.outcome == Outcome.COMPLETED, episode.error
    record = store.get_record("snap-ok", "clone-ok")
    assert record is not None and record["reward"] == 3.0
    provenance = record["provenance"]
    assert provenance["start"] == "snapshot"
    assert provenance["template"].startswith("sha256:")
    assert "start_note" not in provenance  # nothing was rebuilt, nothing fell back
    key = driver.template_key(request(tiny_baseline), driver.accel)  # type: ignore[arg-type]
    template = snapshot.load(key)
    assert template is not None and provenance["template"] == template.digest
    env_id = provenance["env_id"]
    assert env_id == ledger.envs(run_id="snap-ok")[0].env_id
    assert ledger.envs(run_id="snap-ok")[0].confirmed_absent_at is not None
    assert episode.destroy is not None and episode.destroy.confirmed_absent
    assert_gone(driver, env_id)
    if "build_env" in template.facts:  # the template's build VM is gone as well
        assert_gone(driver, template.facts["build_env"])


async def test_five_clones_diverge(tiny_baseline: Baseline) -> None:
    driver = QemuDriver(start="snapshot")
    await (await driver.create(request(tiny_baseline))).aclose()  # the template exists now
    envs: list[Env] = list(
        await asyncio.gather(*(driver.create(request(tiny_baseline)) for _ in range(5)))
    )
    try:
        outputs = []
        for env in envs:
            assert env.info.start_kind == "snapshot"
            assert env.hello["clone_id"] == env.env_id and env.hello["reseeded"] is True
            assert env.hello["reseeder"] == "native"  # the helper answered, not Python
            result = (await env.exec(["sh", "-c", PROBE], timeout_s=60)).check()
            outputs.append(result.stdout.decode().split())
        aslr = (await envs[0].exec(["cat", "/proc/sys/kernel/randomize_va_space"])).check()
        assert driver.accel is not None  # TCG: one layout, so a repeated command's code is reused
        assert aslr.stdout.strip() == (b"2" if driver.accel.name == "kvm" else b"0")
    finally:
        reports = [await env.aclose() for env in envs]
    urandom, boot_ids, randoms, clocks = zip(*outputs, strict=True)
    assert len(set(urandom)) == 5, urandom
    assert len(set(boot_ids)) == 5, boot_ids
    assert len(set(randoms)) == 5, randoms
    assert all(abs(int(c) - time.time()) < 120 for c in clocks), clocks  # clock set on restore
    assert all(r.confirmed_absent for r in reports)
    for env in envs:
        assert_gone(driver, env.env_id)


async def test_a_clone_never_sees_what_an_earlier_clone_wrote(
    harness: Harness, tiny_baseline: Baseline
) -> None:
    writer, prober = await vmkit.writer_then_prober(
        harness, tiny_baseline, "snap-fresh", policy="snap"
    )
    assert writer["provenance"]["start"] == prober["provenance"]["start"] == "snapshot"
    assert writer["provenance"]["template"] == prober["provenance"]["template"]


async def test_a_modified_template_is_named_and_rebuilt(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "templates_dir", lambda: tmp_path / "templates")
    driver = QemuDriver(start="snapshot")
    first = await driver.create(request(tiny_baseline))
    await first.aclose()
    key = driver.template_key(request(tiny_baseline), driver.accel)  # type: ignore[arg-type]
    template = snapshot.load(key)
    assert template is not None and first.info.template == template.digest
    for name in (snapshot.RAM_FILE, snapshot.STATE_FILE, snapshot.META_FILE):
        assert stat.S_IMODE((template.path / name).stat().st_mode) == 0o444, name

    state = template.state
    state.chmod(0o644)
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(DriftError) as caught:
        snapshot.load(key)
    assert caught.value.drifted == ["state"]

    env = await driver.create(request(tiny_baseline))
    try:
        assert env.info.start_kind == "snapshot"
        assert env.info.start_note is not None and "(state)" in env.info.start_note
        assert (await env.exec(["true"])).ok
    finally:
        await env.aclose()
    rebuilt = snapshot.load(key)
    assert rebuilt is not None and rebuilt.facts["build_env"] != template.facts["build_env"]


class NoTemplates:
    """A template builder that always fails (the sibling part ``Templates`` asks)."""

    async def build(self, *args: Any) -> snapshot.Template:
        raise DriverError("no template today")


async def test_auto_falls_back_to_a_cold_boot_and_says_why(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "templates_dir", lambda: tmp_path / "templates")
    driver = QemuDriver(start="auto")
    driver.templates.builder = NoTemplates()
    env = await driver.create(request(tiny_baseline))
    try:
        assert env.info.start_kind == "cold" and env.info.template is None
        assert env.info.start_note is not None and "no template today" in env.info.start_note
        assert (await env.exec(["true"])).ok
    finally:
        report = await env.aclose()
    assert report.confirmed_absent
    assert_gone(driver, env.env_id)


async def test_destroy_confirms_a_clone_absent_even_when_it_is_killed(
    tiny_baseline: Baseline,
) -> None:
    driver = QemuDriver(start="snapshot")
    env = await driver.create(request(tiny_baseline))
    pids = hostproc.pids_with_marker(env.env_id)
    assert env.info.start_kind == "snapshot" and pids
    assert env.env_id in driver.list_owned()
    hostproc.kill_pids(pids, signal.SIGKILL)  # a crashed clone
    report = await env.aclose()
    assert report.confirmed_absent
    assert_gone(driver, env.env_id)
    again = await driver.destroy(env.env_id)  # idempotent
    assert again.confirmed_absent
