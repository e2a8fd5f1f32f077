"""The gvisor driver's bundle: the OCI spec it writes and the verified root-tree cache."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest

from cleanroom.core.baseline_model import AGENT_FILE, ROOTFS_FILE, Baseline, Component
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers import gvisor_bundle as gb
from cleanroom.drivers.base import EnvRequest, Owner, new_env_id
from cleanroom.drivers.gvisor import GvisorDriver
from cleanroom.errors import DriftError, LaunchError
from cleanroom.host import hostproc

from ..conftest import make_fake_baseline


def test_spec_runs_the_agent_without_network_under_limits(tmp_path: Path) -> None:
    fake = make_fake_baseline(tmp_path)
    agent = Component(AGENT_FILE, 3, "ab" * 32)  # every baseline built today has one
    baseline = dataclasses.replace(fake, components=(*fake.components, agent))
    env_id = new_env_id()
    limits = ResolvedLimits(vcpus=2, memory_mib=512)
    request = EnvRequest(env_id, baseline, limits, Owner("t"), hard_deadline_s=60)
    cid = hostproc.marker(env_id)
    spec = gb.oci_spec(request, tmp_path / "tree", tmp_path / "ctl", cid)
    process = spec["process"]
    assert process["args"] == ["/opt/cleanroom/agent/agent"]  # the native agent as PID 1
    assert f"CLEANROOM_AGENT_SOCKET={gb.GUEST_CTL_DIR}/{gb.SOCKET_NAME}" in process["env"]
    assert process["noNewPrivileges"] is True
    caps = set(process["capabilities"]["bounding"])
    assert not caps & {"CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE", "CAP_NET_ADMIN"}
    assert spec["root"] == {"path": str(tmp_path / "tree"), "readonly": False}
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert {"/proc", "/sys", "/dev", "/dev/shm", "/run", "/tmp"} <= set(mounts)
    assert set(mounts) <= set(gb.MOUNT_POINTS)  # each is made in the tree before fingerprinting
    assert mounts["/run"]["type"] == mounts["/tmp"]["type"] == "tmpfs"
    ctl = mounts[gb.GUEST_CTL_DIR]
    assert ctl["type"] == "bind" and ctl["source"] == str(tmp_path / "ctl")
    assert {"type": "network"} in spec["linux"]["namespaces"]
    assert cid in spec["linux"]["cgroupsPath"]
    resources = spec["linux"]["resources"]
    assert resources["memory"]["limit"] == 512 * 1024 * 1024
    assert resources["cpu"]["quota"] == 2 * resources["cpu"]["period"]


def test_fingerprint_sees_every_change(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "conf").write_text("a")
    first = gb.fingerprint(tree)
    assert gb.fingerprint(tree) == first
    (tree / "etc" / "conf").write_text("ab")
    second = gb.fingerprint(tree)
    assert second != first
    (tree / "new").write_text("")
    assert gb.fingerprint(tree) != second
    os.remove(tree / "new")
    os.chmod(tree / "etc" / "conf", 0o600)
    assert gb.fingerprint(tree) != second


async def test_a_baseline_without_a_root_image_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    with pytest.raises(LaunchError, match=ROOTFS_FILE):
        await gb.ensure_tree(make_fake_baseline(tmp_path))


@pytest.mark.vm
async def test_tree_is_extracted_once_verified_and_repaired(
    tiny_baseline: Baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("fsck.erofs") is None:
        pytest.skip("fsck.erofs (erofs-utils) is not installed")
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gb, "_verified", set())
    tree = await gb.ensure_tree(tiny_baseline)
    assert tree == gb.tree_dir(tiny_baseline) / "rootfs"
    agent = tree / "opt" / "cleanroom" / "agent" / "agent"
    original = agent.read_bytes()
    assert await gb.ensure_tree(tiny_baseline) == tree

    agent.write_bytes(b"tampered")  # drift in the cached tree: noticed by the next process
    assert await gb.ensure_tree(tiny_baseline) == tree  # this process already verified it
    gb._verified.clear()
    assert await gb.ensure_tree(tiny_baseline) == tree
    assert agent.read_bytes() == original  # extracted again from the verified image

    copy = tmp_path / "copy"  # an image that no longer matches the digest is refused
    copy.mkdir()
    for item in tiny_baseline.path.iterdir():
        os.link(item, copy / item.name)
    os.remove(copy / ROOTFS_FILE)
    data = bytearray((tiny_baseline.path / ROOTFS_FILE).read_bytes())
    data[4096] ^= 0xFF
    (copy / ROOTFS_FILE).write_bytes(bytes(data))
    tampered = Baseline(
        "sha256:" + "1" * 64,
        copy,
        tiny_baseline.spec_digest,
        tiny_baseline.name,
        tiny_baseline.components,
        tiny_baseline.entrypoint,
        tiny_baseline.limits,
        tiny_baseline.kernel_version,
        tiny_baseline.agent_version,
    )
    with pytest.raises(DriftError, match=ROOTFS_FILE):
        await gb.ensure_tree(tampered)


def test_stale_trees_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANROOM_HOME", str(tmp_path))
    now = time.time()

    def tree(name: str, age_s: float, *, baseline: bool) -> Path:
        folder = gb.cache_root() / name
        (folder / "rootfs").mkdir(parents=True)
        (folder / gb.TREE_FILE).write_text("{}")
        os.utime(folder / gb.TREE_FILE, (now - age_s, now - age_s))
        if baseline:
            (tmp_path / "baselines" / name).mkdir(parents=True)
        return folder

    current = tree("a" * 64, 30 * 86400, baseline=True)  # the one being used: never pruned
    recent = tree("b" * 64, 3600, baseline=True)
    old = tree("c" * 64, 8 * 86400, baseline=True)
    orphan_recent = tree("d" * 64, 3600, baseline=False)
    orphan_old = tree("e" * 64, 2 * 86400, baseline=False)
    removed = gb.prune_stale_trees(keep=current)
    assert sorted(removed) == sorted([old, orphan_old])
    assert current.is_dir() and recent.is_dir() and orphan_recent.is_dir()


@pytest.mark.vm
async def test_a_sandbox_leaves_the_tree_untouched(
    tiny_baseline: Baseline, tmp_path: Path, gvisor_usable: None
) -> None:
    tree = await gb.ensure_tree(tiny_baseline)
    before = gb.fingerprint(tree)
    driver = GvisorDriver(run_root=tmp_path / "run")
    limits = ResolvedLimits(timeout_s=60)
    request = EnvRequest(new_env_id(), tiny_baseline, limits, Owner("t"), hard_deadline_s=120)
    async with await driver.create(request) as env:
        script = "echo x > /etc/canary; mkdir -p /opt/new /run/x; rm -f /usr/bin/python3; echo ok"
        result = await env.exec(["sh", "-c", script])
        assert result.stdout == b"ok\n", result.stderr
    assert gb.fingerprint(tree) == before
    assert not (tree / "etc" / "canary").exists() and (tree / "usr" / "bin" / "python3").exists()
