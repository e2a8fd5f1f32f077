"""Fork for the qemu driver: a warm parent saved like a template, clones restored from it.

The parent is restored from the baseline's template like any clone, except that its guest RAM
is a sparse copy of the template's RAM file mapped *shared* (``share=on``): whatever the
group's setup changes lands in that file, so saving the paused parent with ``x-ignore-shared``
writes only its device state (~60 KiB, ~10 ms). A plain clone (``share=off``) can be saved as
well, but then its RAM goes into the migration stream in full (81 MiB, ~0.7 s here) and each
of its clones loads that into private memory (slower, ~125 MiB PSS each instead of ~28; see
``bench/results/fork.txt``). Without a template (``start="cold"``, or ``auto`` after a failed
build) the parent boots with its RAM in a fresh shared file.

Files: ``$CLEANROOM_HOME/forks/<snapshot_id>/`` holds ``owner.json`` (written first, for the
reaper), ``ram``, ``state`` and, once sealed, ``snapshot.json``. Clones map ``ram`` privately,
so the folder may go once the last is restored.

Sealing (``seal.py``) comes after the parent was destroyed and confirmed absent: the
files are frozen at once and hashed while the clones restore; a clone is handed over only once
the digest is known and its files were unchanged from the freeze through its own restore.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import Env, EnvRequest, ForkSnapshot, read_owner, write_owner
from cleanroom.drivers.qemu import seal
from cleanroom.drivers.qemu.clone import Cloner
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.live import Live
from cleanroom.drivers.qemu.templates import Templates
from cleanroom.errors import CleanroomError, DriverError, LaunchError, SnapshotDrift
from cleanroom.host import hostproc, paths
from cleanroom.host.digests import digest_of, sha256_file

MACHINE_FILE = "machine.json"  # what a clone must share with the parent
MIN_AGENT = (0, 2, 1)  # takes SNAPSHOT_PREPARE right after a request (older: a race)


def forks_dir() -> Path:
    return paths.home() / "forks"


def folder(snapshot_id: str) -> Path:
    return forks_dir() / snapshot_id


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new file ``dst`` keeping its holes (reflinked where the FS can)."""
    with src.open("rb") as fin, dst.open("xb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            while start < end:
                start += os.copy_file_range(fin.fileno(), fout.fileno(), end - start, start, start)
            offset = end
    dst.chmod(0o600)


def make_folder(snapshot_id: str, request: EnvRequest) -> Path:
    """A new snapshot folder for ``request``'s machine (its owner first, for the reaper)."""
    path = folder(snapshot_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    write_owner(path, request, "qemu")  # who to ask before reaping it
    (path / MACHINE_FILE).write_text(json.dumps(_machine(request)))
    return path


def _machine(request: EnvRequest) -> dict[str, Any]:
    lim = request.limits
    return {"baseline": request.baseline.digest, "memory_mib": lim.memory_mib, "vcpus": lim.vcpus}


class Forks:
    """Fork parents, their saves and their clones, for one driver."""

    def __init__(
        self, ctx: QemuContext, templates: Templates, cloner: Cloner, seals: seal.Seals
    ) -> None:
        self.ctx = ctx
        self.templates = templates
        self.cloner = cloner
        self.seals = seals
        self.parents: dict[str, tuple[Path, EnvRequest]] = {}  # env id -> RAM folder, request

    async def start_parent(
        self, request: EnvRequest, accel: accel_mod.Accel, snapshot_id: str
    ) -> Env:
        """The group's warm parent: restored from the template with RAM in a shared copy."""
        started, start = time.monotonic(), self.ctx.config.start
        try:
            path = await asyncio.to_thread(make_folder, snapshot_id, request)
        except OSError as exc:
            raise LaunchError(f"cannot make the snapshot folder: {exc}") from exc
        ram = path / snapshot.RAM_FILE
        template, note = None, None
        if start != "cold":
            try:
                template, note = await self.templates.template_for(request, accel)
            except (CleanroomError, OSError) as exc:
                if start == "snapshot":
                    raise LaunchError(f"no template for the fork parent: {exc}") from exc
                note = f"no template, parent booted cold: {type(exc).__name__}: {exc}"[:300]
        if template is None:
            memory = snapshot.memory_args(ram, request.limits.memory_mib, shared=True)
            env = await self.ctx.launcher.cold(
                request, accel, started, note, memory, memory_backend=True
            )
        else:
            try:
                await asyncio.to_thread(sparse_copy, template.ram, ram)
            except OSError as exc:
                raise LaunchError(
                    f"cannot copy the template's RAM for the fork parent: {exc}"
                ) from exc
            env = await self.cloner.clone(
                request, accel, template, started, note, ram=ram, shared=True
            )
            self.templates.restored(template.key)
        self.parents[env.env_id] = (path, request)  # ``live_fork.save_live`` may save it too
        return env

    async def save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        """SNAPSHOT_PREPARE, pause and save the parent, destroy it, freeze its files; their
        hash runs on meanwhile (``seal.Seals``)."""
        path, live = folder(snapshot_id), self.ctx.live.get(env.env_id)
        if live is None or not (path / snapshot.RAM_FILE).is_file():
            raise DriverError(f"{env.env_id} is not a fork parent of {snapshot_id} in this process")
        check_agent(env)
        started = time.monotonic()
        await env.session.snapshot_prepare()
        save_s = await save_state(live, path)
        report = await env.aclose()  # the parent must be gone before its RAM file is sealed
        self.parents.pop(env.env_id, None)
        if not report.confirmed_absent:
            raise DriverError(f"fork parent {env.env_id} could not be confirmed gone")
        destroyed = time.monotonic()
        facts = await self.seal_saved(env, snapshot_id, destroyed, save_s)
        facts["prepare_save_destroy_s"] = round(destroyed - started, 4)
        return ForkSnapshot(snapshot_id, self.ctx.config.name, None, folder(snapshot_id), facts)

    async def seal_saved(
        self, env: Env, snapshot_id: str, since: float, save_s: float
    ) -> dict[str, Any]:
        """Freeze the saved snapshot of ``env`` and start hashing it (``seal.Seals``); its
        facts (``seal_s`` counts from ``since``)."""
        path = folder(snapshot_id)
        frozen = await asyncio.to_thread(seal.freeze, path)
        self.seals.start(snapshot_id, path, frozen, since)
        return {
            "parent_env": env.env_id,
            "parent_start": env.info.start_kind,
            "template": env.info.template,
            "machine": json.loads((path / MACHINE_FILE).read_text()),
            "save_s": round(save_s, 4),
            **frozen,
        }

    async def clone(
        self, request: EnvRequest, accel: accel_mod.Accel | None, snap: ForkSnapshot
    ) -> Env:
        """A new QEMU process restored from the snapshot (RESEED: entropy, clone id, clock),
        returned once the snapshot is sealed and its files were unchanged throughout."""
        if snap.path is None or accel is None:
            raise LaunchError(f"snapshot {snap.snapshot_id} was not made by this driver")
        machine = snap.facts["machine"]
        if _machine(request) != machine:
            raise LaunchError(f"a clone of {snap.snapshot_id} needs its machine {machine}")
        if not self.seals.sealing(snap):
            raise LaunchError(f"snapshot {snap.snapshot_id} is not being sealed by this driver")
        await seal.check_unchanged(snap)
        template = snapshot.Template(
            key=snap.snapshot_id,
            path=snap.path,
            digest=snap.digest or "",  # not recorded: the env's template is the parent's (below)
            memory_mib=machine["memory_mib"],
            files={},
            facts={},
        )
        env = await self.cloner.clone(request, accel, template, time.monotonic(), None)
        try:
            await self.seals.sealed(snap)
            await seal.check_unchanged(snap)  # since the freeze: through hash and restore
        except BaseException as exc:
            await asyncio.shield(env.aclose())
            if isinstance(exc, DriverError) and not isinstance(exc, LaunchError):
                raise LaunchError(str(exc)) from exc
            raise
        env.info = dataclasses.replace(env.info, start_kind="fork", template=snap.facts["template"])
        return env

    async def resume_parent(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel | None,
        snap: ForkSnapshot,
        snapshot_id: str,
    ) -> Env:
        """A fork parent restored from the sealed ``snap`` (a paused session resumed): its RAM
        a sparse copy of the snapshot's in its own folder ``snapshot_id``, mapped shared, so
        it can be paused or forked again; the snapshot's files checked unchanged throughout."""
        if snap.path is None or snap.digest is None or accel is None:
            raise LaunchError(f"snapshot {snap.snapshot_id} is not a sealed one of this driver")
        machine = snap.facts["machine"]
        if _machine(request) != machine:
            raise LaunchError(f"a resume of {snap.snapshot_id} needs its machine {machine}")
        await seal.check_unchanged(snap)
        started = time.monotonic()
        try:
            path = await asyncio.to_thread(make_folder, snapshot_id, request)
            ram = path / snapshot.RAM_FILE
            await asyncio.to_thread(sparse_copy, snap.path / snapshot.RAM_FILE, ram)
        except OSError as exc:
            raise LaunchError(f"cannot copy the snapshot's RAM to resume it: {exc}") from exc
        template = snapshot.Template(
            key=snap.snapshot_id,
            path=snap.path,
            digest=snap.digest,
            memory_mib=machine["memory_mib"],
            files={},
            facts={},
        )
        env = await self.cloner.clone(request, accel, template, started, None, ram=ram, shared=True)
        try:
            await seal.check_unchanged(snap)  # the state loaded was the sealed one
        except BaseException:
            await asyncio.shield(env.aclose())
            raise
        self.parents[env.env_id] = (path, request)
        env.info = dataclasses.replace(
            env.info, start_kind="resume", template=snap.facts.get("template")
        )
        return env


def verify(snap: ForkSnapshot) -> None:
    """``SnapshotDrift`` unless the snapshot's files hash to what was sealed (a full hash)."""
    want = snap.facts.get("files", {})
    if snap.path is None or not want or digest_of(want) != snap.digest:
        raise SnapshotDrift(snap.snapshot_id, ["(not sealed)"])
    now: dict[str, str] = {}
    try:
        now[snapshot.RAM_FILE] = seal.content_digest(snap.path / snapshot.RAM_FILE)
        now[snapshot.STATE_FILE] = "sha256:" + sha256_file(snap.path / snapshot.STATE_FILE)
    except OSError:
        pass
    drifted = [name for name in snapshot.FILES if now.get(name) != want.get(name)]
    if drifted:
        raise SnapshotDrift(snap.snapshot_id, drifted)


async def save_state(live: Live, path: Path) -> float:
    """Migrate the prepared VM's device state into ``path``'s state file (the VM stops at
    its end; its RAM stays in its file); the seconds it took."""
    qmp = await live.open_qmp()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    state_fd = os.open(path / snapshot.STATE_FILE, flags, 0o600)
    try:
        return await snapshot.save(qmp, state_fd)
    finally:
        os.close(state_fd)


def check_agent(env: Env) -> None:
    """DriverError unless ``env``'s agent can be snapshotted for a fork."""
    version = str(env.hello.get("agent_version", "0"))
    if _version(version) < MIN_AGENT:
        raise DriverError(f"the baseline's guest agent {version} predates fork; rebuild it")


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return (0,)


def delete(snapshot_id: str) -> bool:
    """Remove a snapshot's folder (renamed away first); True once it is confirmed absent."""
    path = folder(snapshot_id)
    trash = path.with_name(f".trash-{snapshot_id}-{os.getpid()}")
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        pass
    except OSError:
        trash = path  # cannot rename: remove in place
    try:
        hostproc.remove_tree(trash)
    except OSError:
        return False
    return not path.exists() and not trash.exists()


def list_ids() -> list[str]:
    """Snapshot folders on the host (and trash of a delete that died half-way, removed here)."""
    root = forks_dir()
    if not root.is_dir():
        return []
    for stale in root.glob(".trash-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not hostproc.pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return sorted(p.name for p in root.iterdir() if p.name.startswith("snap-"))


def owner(snapshot_id: str) -> dict[str, Any] | None:
    return read_owner(folder(snapshot_id))
