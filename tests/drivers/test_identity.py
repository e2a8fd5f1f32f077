"""Env identity by cgroup (issue 15 §6), on real VMs and real processes: an env's processes are
those in the cgroup the driver made, destroy kills that cgroup and removes it, and a process of
another user that merely carries an env's marker (``exec -a cleanroom-env-<id>``, started as
``nobody``) is neither counted as an env nor signalled. An env left by an older version (a run
folder and a root process with the marker, no cgroup) is still found and destroyed."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import new_env_id
from cleanroom.drivers.qemu import QemuDriver
from cleanroom.host import cgroups

from ..vmkit import request
from .spoof import spoofer

pytestmark = pytest.mark.vm


@pytest.fixture
def driver() -> Iterator[QemuDriver]:
    if cgroups.detect() is None:
        pytest.skip("no usable cgroup tree on this host (the marker fallback is tested below)")
    yield QemuDriver(start="auto")


async def test_destroy_kills_the_env_cgroup_and_removes_it(
    driver: QemuDriver, tiny_baseline: Baseline
) -> None:
    """The QEMU process is in the env's own cgroup, named in provenance; destroy leaves neither
    a process in it nor the cgroup (before: no cgroup at all, envs known by name only)."""
    env = await driver.create(request(tiny_baseline))
    path = driver.groups.path(env.env_id)
    assert path is not None and path.is_dir()
    assert env.info.pid in driver.groups.pids(env.env_id)
    assert env.info.start_facts()["jail"]["cgroup"] == str(path)
    assert env.env_id in driver.list_owned()
    report = await env.aclose()
    assert report.confirmed_absent
    assert not path.exists() and not driver.exists(env.env_id)
    assert env.env_id not in driver.list_owned()


async def test_another_users_process_named_like_an_env_is_neither_counted_nor_signalled(
    driver: QemuDriver, tiny_baseline: Baseline
) -> None:
    """A ``nobody`` process carrying a live env's marker (and one with a made-up env id, its
    command line naming qemu-system and the run folder) does not make that env exist or leak,
    and destroy neither kills it nor fails to confirm the real env absent (before: it was
    SIGKILLed, destroy needed a second try, and the made-up id 'existed')."""
    env = await driver.create(request(tiny_baseline))
    fake_id = new_env_id()
    spoofers: list[subprocess.Popen[bytes]] = []
    try:
        spoofers.append(spoofer(env.env_id, str(driver.run_root)))
        spoofers.append(spoofer(fake_id, str(driver.run_root)))
        assert fake_id not in driver.list_owned()
        assert not driver.exists(fake_id) and not driver.alive(fake_id)
        report = await env.aclose()
        assert report.confirmed_absent
        assert not driver.exists(env.env_id)
        assert env.env_id not in driver.list_owned()
        again = await driver.destroy(fake_id)
        assert again.confirmed_absent
        await asyncio.sleep(0.05)
        assert all(proc.poll() is None for proc in spoofers)  # never signalled
    finally:
        await env.aclose()  # idempotent
        for proc in spoofers:
            proc.kill()
            proc.wait()


async def test_an_env_of_an_older_version_is_still_found_and_destroyed(
    driver: QemuDriver,
) -> None:
    """A run folder and a root process with the marker but no cgroup (what an older version
    left): ``list_owned`` (so ``ps`` and ``reap``) finds it and destroy kills it."""
    env_id = new_env_id()
    old = spoofer(env_id, str(driver.run_root), user="root")
    driver.run_dir(env_id).mkdir(parents=True)
    try:
        assert env_id in driver.list_owned() and driver.exists(env_id)
        report = await driver.destroy(env_id)
        assert report.confirmed_absent
        assert old.wait(timeout=5) != 0
        assert env_id not in driver.list_owned()
    finally:
        old.kill()
        old.wait()


async def test_without_cgroups_the_marker_fallback_still_ignores_other_users(
    tiny_baseline: Baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No usable cgroup: provenance says the fallback, envs are found by marker and our uid,
    and another user's process with the marker is still not signalled (pidfd + uid check)."""
    monkeypatch.setenv(cgroups.SWITCH_ENV, "off")
    cgroups.detect.cache_clear()
    try:
        driver = QemuDriver(start="auto")
    finally:
        cgroups.detect.cache_clear()
    env = await driver.create(request(tiny_baseline))
    assert env.info.jail is not None
    assert (env.info.jail["identity"], env.info.jail["cgroup"]) == (cgroups.FALLBACK, None)
    try:
        assert driver.alive(env.env_id) and env.env_id in driver.list_owned()
        same = spoofer(env.env_id)
    except BaseException:
        await env.aclose()
        raise
    try:
        report = await env.aclose()
        assert report.confirmed_absent
        assert same.poll() is None
    finally:
        same.kill()
        same.wait()


async def test_a_process_in_the_env_cgroup_outside_its_process_group_dies_with_it(
    driver: QemuDriver, tiny_baseline: Baseline
) -> None:
    """A process of the env that left QEMU's process group and carries no marker (a new
    session: what killpg and a marker scan both miss) is killed with the env's cgroup, and the
    env is confirmed absent only once it is gone."""
    env = await driver.create(request(tiny_baseline))
    path = driver.groups.path(env.env_id)
    assert path is not None
    join = 'echo $$ > "$0" && exec sleep 120'
    escaped = subprocess.Popen(
        ["sh", "-c", join, str(path / "cgroup.procs")], start_new_session=True
    )
    try:
        for _ in range(200):
            if escaped.pid in driver.groups.pids(env.env_id):
                break
            await asyncio.sleep(0.01)
        assert escaped.pid in driver.groups.pids(env.env_id)
        report = await env.aclose()
        assert report.confirmed_absent and not path.exists()
        assert escaped.wait(timeout=5) == -9
    finally:
        escaped.kill()
        escaped.wait()


def test_the_cgroup_scope_separates_homes() -> None:
    """Two run folders never share a cgroup folder (one home cannot list another's envs)."""
    a, b = Path("/a/run/qemu"), Path("/b/run/qemu")
    assert cgroups.scope_of("qemu", a) != cgroups.scope_of("qemu", b)
    assert cgroups.scope_of("qemu", a) == cgroups.scope_of("qemu", a)
