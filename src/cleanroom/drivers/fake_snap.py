"""The fake driver with a faithful fake snapshot: what a live fork, a pause and a resume do to
a fake env's files, with no VM (``--driver fake-snap``; for fast tests of sessions and serve).

A fake env's guest is a host process whose ``/`` is relocated to ``<run_dir>/root`` only for
``/run/cleanroom``; what its commands write under that root (the agent's
``CLEANROOM_GUEST_ROOT``) is its "disk".
A snapshot is that disk as it is now: ``<home>/forks-fake/<snapshot_id>/`` (0700) holds
``owner.json`` (first, for the reaper), ``disk.tar`` (the root, minus the agent's own
``run/cleanroom``) and ``state.json`` (the parent env, when), both 0600. Its digest is sealed
over both files' sha256 (``fork_sealed``) and checked again by ``verify_snapshot`` (a file that
no longer matches: ``SnapshotDrift``). A clone or a resumed parent is a new fake env with the
disk unpacked into its root. What the fake cannot keep, it does not pretend to: the processes
of the parent and their memory are not in the snapshot (a qemu snapshot holds them: its RAM).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, read_owner, write_owner
from cleanroom.drivers.fake import FakeDriver
from cleanroom.errors import DriverError, LaunchError, SnapshotDrift, Unsupported
from cleanroom.host import digests, paths

DISK, STATE = "disk.tar", "state.json"
FILES = (DISK, STATE)
AGENT_DIR = "run/cleanroom"  # the agent's own files in the root: never part of a snapshot


class SnapshotFake(FakeDriver):
    """``FakeDriver`` with ``fork`` and ``fork-live`` (module docstring)."""

    capabilities = FakeDriver.capabilities.with_(fork=True, fork_live=True)

    def __init__(self, *, run_root: Path | None = None, forks: Path | None = None) -> None:
        super().__init__(run_root=run_root)
        self.forks = forks or paths.home() / "forks-fake"
        self.parents: dict[str, EnvRequest] = {}  # a forkable env's id -> its request

    def folder(self, snapshot_id: str) -> Path:
        return self.forks / snapshot_id

    def _make_folder(self, snapshot_id: str, request: EnvRequest) -> Path:
        self.forks.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.folder(snapshot_id)
        path.mkdir(mode=0o700)
        write_owner(path, request, self.name)
        return path

    async def fork_parent(self, request: EnvRequest, snapshot_id: str) -> Env:
        await asyncio.to_thread(self._make_folder, snapshot_id, request)
        env = await self.create(request)
        self.parents[env.env_id] = request
        return env

    async def fork_save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        snap = await self.fork_live(env, snapshot_id)
        report = await env.aclose()
        if not report.confirmed_absent:
            raise DriverError(f"fork parent {env.env_id} could not be confirmed gone")
        return snap

    async def fork_live(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        request = self.parents.get(env.env_id)
        if request is None:
            raise Unsupported(f"{env.env_id} was not created forkable")
        path = await asyncio.to_thread(self._make_folder, snapshot_id, request)
        started = time.monotonic()
        await asyncio.to_thread(_save, self.guest_root(env.env_id), path, env.env_id)
        facts = {"parent_env": env.env_id, "save_s": round(time.monotonic() - started, 4)}
        return ForkSnapshot(snapshot_id, self.name, None, path, facts)

    async def fork_sealed(self, snap: ForkSnapshot) -> ForkSnapshot:
        if snap.digest is not None:
            return snap
        assert snap.path is not None
        files = await asyncio.to_thread(_hash_files, snap.path)
        for name in FILES:
            (snap.path / name).chmod(0o400)  # frozen: read-only, the owner's alone
        facts = {**snap.facts, "files": files}
        return dataclasses.replace(snap, digest=digests.digest_of(files), facts=facts)

    async def verify_snapshot(self, snap: ForkSnapshot) -> None:
        if snap.path is None or snap.digest is None:
            raise SnapshotDrift(snap.snapshot_id, ["(not sealed)"])
        try:
            now = await asyncio.to_thread(_hash_files, snap.path)
        except OSError:
            now = {}
        want = snap.facts.get("files", {})
        drifted = [name for name in FILES if now.get(name) != want.get(name)]
        if drifted or digests.digest_of(want) != snap.digest:
            raise SnapshotDrift(snap.snapshot_id, drifted or ["digest"])

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        env = await self.create(request)
        await self._restore(env, snap)
        env.info = dataclasses.replace(env.info, start_kind="fork")
        return env

    async def fork_resume(self, request: EnvRequest, snap: ForkSnapshot, snapshot_id: str) -> Env:
        env = await self.fork_parent(request, snapshot_id)
        await self._restore(env, snap)
        env.info = dataclasses.replace(env.info, start_kind="resume")
        return env

    async def _restore(self, env: Env, snap: ForkSnapshot) -> None:
        try:
            if snap.path is None:
                raise LaunchError(f"snapshot {snap.snapshot_id} has no files")
            await asyncio.to_thread(_unpack, snap.path / DISK, self.guest_root(env.env_id))
        except BaseException as exc:
            await asyncio.shield(env.aclose())
            if isinstance(exc, OSError | tarfile.TarError):
                raise LaunchError(f"cannot restore {snap.snapshot_id}: {exc}") from exc
            raise

    def guest_root(self, env_id: str) -> Path:
        return self.run_dir(env_id) / "root"

    async def destroy(self, env_id: str) -> Any:
        self.parents.pop(env_id, None)
        return await super().destroy(env_id)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        path = self.folder(snapshot_id)
        await asyncio.to_thread(shutil.rmtree, path, True)
        return not path.exists()

    def list_snapshots(self) -> list[str]:
        if not self.forks.is_dir():
            return []
        return sorted(p.name for p in self.forks.iterdir() if p.name.startswith("snap-"))

    def snapshot_owner(self, snapshot_id: str) -> dict[str, Any] | None:
        return read_owner(self.folder(snapshot_id))


def _save(root: Path, path: Path, env_id: str) -> None:
    fd = os.open(path / DISK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            name = entry.name
            if name == "run":
                for sub in sorted(entry.iterdir()):
                    if f"run/{sub.name}" != AGENT_DIR:
                        tar.add(sub, f"run/{sub.name}")
                continue
            tar.add(entry, name)
    state = json.dumps({"parent_env": env_id, "at": time.time()}).encode()
    fd = os.open(path / STATE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(state)


def _unpack(disk: Path, root: Path) -> None:
    """Restore the saved files (the guest wrote them: nothing may land outside ``root``):
    tarfile's data filter where this Python has it (3.11.4+), else only the members that
    stay inside by name and link target (no devices, no FIFOs)."""
    with tarfile.open(disk) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter="data")
        else:
            tar.extractall(root, members=[m for m in tar.getmembers() if _inside(m)])


def _inside(member: tarfile.TarInfo) -> bool:
    def stays(path: str) -> bool:
        norm = posixpath.normpath(path)
        return not posixpath.isabs(path) and norm != ".." and not norm.startswith("../")

    if not stays(member.name) or ".." in member.name.split("/"):
        return False
    if member.issym():
        return stays(posixpath.join(posixpath.dirname(member.name), member.linkname))
    if member.islnk():
        return stays(member.linkname)
    return member.isreg() or member.isdir()


def _hash_files(path: Path) -> dict[str, str]:
    return {n: "sha256:" + hashlib.sha256((path / n).read_bytes()).hexdigest() for n in FILES}
