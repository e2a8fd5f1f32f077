"""A test double: the fake driver with a pretend fork, for fast tests of group orchestration.

A "snapshot" is a folder (owner.json, a state file naming the parent); a "clone" is a fresh fake
env. Nothing of the parent's state reaches a clone: what fork itself does is proven on real VMs
in tests/drivers/qemu/test_fork.py. Like qemu's, a snapshot's digest comes later (``fork_sealed``).
``fail_clones`` makes every fork_clone fail, ``fail_deletes`` every delete_snapshot,
``fail_seal`` the seal (as if the files changed before they were hashed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, read_owner, write_owner
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import DriverError, LaunchError


class ForkingFake(FakeDriver):
    capabilities = FakeDriver.capabilities.with_(fork=True)

    def __init__(self, root: Path) -> None:
        super().__init__(run_root=root / "run")
        self.forks = root / "forks"
        self.fail_clones = False
        self.fail_deletes = False
        self.fail_seal = False
        self.calls: list[str] = []

    async def fork_parent(self, request: EnvRequest, snapshot_id: str) -> Env:
        self.calls.append("parent")
        folder = self.forks / snapshot_id
        folder.mkdir(parents=True)
        write_owner(folder, request, self.name)
        return await self.create(request)

    async def fork_save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        self.calls.append("save")
        folder = self.forks / snapshot_id
        (folder / "state").write_text(env.env_id)
        report = await env.aclose()
        if not report.confirmed_absent:
            raise DriverError("parent not gone")
        return ForkSnapshot(snapshot_id, self.name, None, folder, {"parent_env": env.env_id})

    async def fork_sealed(self, snap: ForkSnapshot) -> ForkSnapshot:
        if self.fail_seal:
            raise DriverError(f"snapshot {snap.snapshot_id} changed while sealed (ram)")
        parent = snap.facts["parent_env"]
        digest = "sha256:" + hashlib.sha256(parent.encode()).hexdigest()
        return dataclasses.replace(snap, digest=digest)

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        self.calls.append("clone")
        assert snap.path is not None
        if self.fail_clones or not (snap.path / "state").is_file():
            raise LaunchError(f"cannot restore {snap.snapshot_id}")
        env = await self.create(request)
        env.info = dataclasses.replace(env.info, start_kind="fork")
        return env

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        if self.fail_deletes:
            return False
        shutil.rmtree(self.forks / snapshot_id, ignore_errors=True)
        return not (self.forks / snapshot_id).exists()

    def list_snapshots(self) -> list[str]:
        return sorted(p.name for p in self.forks.iterdir()) if self.forks.is_dir() else []

    def snapshot_owner(self, snapshot_id: str) -> dict[str, Any] | None:
        return read_owner(self.forks / snapshot_id)
