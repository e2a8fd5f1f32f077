"""The fake driver has the qemu driver's identity (issue 15 §6): its agent process is in the
env's own cgroup, named in provenance, and destroy kills and removes that cgroup; a ``nobody``
process named like the env is not signalled. Before, fake envs were found and killed by their
marker alone, whoever ran the process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cleanroom.drivers.fake import FakeDriver
from cleanroom.host import cgroups

from ..conftest import make_fake_baseline
from ..vmkit import request
from .spoof import spoofer


async def test_a_fake_env_is_its_cgroup_and_a_spoofer_is_left_alone(tmp_path: Path) -> None:
    if cgroups.detect() is None:
        pytest.skip("no usable cgroup tree on this host")
    driver = FakeDriver(run_root=tmp_path / "run")
    env = await driver.create(request(make_fake_baseline(tmp_path)))
    other = spoofer(env.env_id)
    try:
        path = driver.groups.path(env.env_id)
        assert path is not None and env.info.pid in driver.groups.pids(env.env_id)
        assert env.info.start_facts()["jail"]["cgroup"] == str(path)
        assert env.env_id in driver.list_owned()
        report = await env.aclose()
        assert report.confirmed_absent and not path.exists()
        await asyncio.sleep(0.05)
        assert other.poll() is None  # another user's process named like the env: untouched
    finally:
        await env.aclose()
        other.kill()
        other.wait()
