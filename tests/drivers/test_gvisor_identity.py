"""gVisor envs have the qemu driver's identity (issue 15 §6): the sandbox's host processes
(runsc, its sandbox, gofer and stubs) are in the env's identity cgroup, named in provenance;
destroy kills that cgroup and removes it; and a ``nobody`` process named like the env's
sandbox (marker, ``runsc``, the run folder in its command line) is neither listed, nor makes
an env exist, nor is signalled. Before, gVisor envs were found and SIGKILLed by marker alone,
whoever ran the process."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from cleanroom.core.baseline_model import Baseline
from cleanroom.drivers.base import new_env_id
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.host import cgroups, hostproc, jail

from ..vmkit import request
from .spoof import spoofer

pytestmark = pytest.mark.vm


async def test_a_gvisor_env_is_its_cgroup_and_a_spoofer_is_nobodys(
    gvisor_usable: None, tiny_baseline: Baseline
) -> None:
    if cgroups.detect() is None:
        pytest.skip("no usable cgroup tree on this host")
    driver = GvisorDriver()
    env = await driver.create(request(tiny_baseline))
    fake_id = new_env_id()
    spoofers: list[subprocess.Popen[bytes]] = []
    try:
        path = driver.groups.path(env.env_id)
        assert path is not None and path.is_dir()
        inside = set(driver.groups.pids(env.env_id))
        assert env.info.pid in inside
        runsc = {p for p in hostproc.pids_with_marker(env.env_id) if jail.ours(hostproc.uid_of(p))}
        assert runsc and runsc <= inside  # every sandbox process of ours is in the cgroup
        assert env.info.start_facts()["jail"]["cgroup"] == str(path)
        for env_id in (env.env_id, fake_id):
            spoofers.append(spoofer(env_id, "runsc", str(driver.run_root)))
        assert fake_id not in driver.list_owned() and not driver.exists(fake_id)
        report = await env.aclose()
        assert report.confirmed_absent, report.detail
        assert not path.exists() and not driver.exists(env.env_id)
        assert env.env_id not in driver.list_owned()
        assert (await driver.destroy(fake_id)).confirmed_absent
        await asyncio.sleep(0.05)
        assert all(proc.poll() is None for proc in spoofers)  # never signalled
    finally:
        await env.aclose()
        for proc in spoofers:
            proc.kill()
            proc.wait()
