"""The qemu driver: one ``-M microvm`` QEMU process per environment.

Per env: a run folder ``$CLEANROOM_HOME/run/<env_id>/`` (owner.json, pid, the QMP socket); the
baseline's root image as a read-only virtio-blk disk; no network device (with an egress
allowlist: a restricted user-mode network whose only exits lead to the env's egress proxy,
``cleanroom.network.qemu_args``; such VMs always boot cold); the agent on a virtio-serial port
whose host side is one end of a socket pair the driver made (connected before QEMU starts:
nothing to wait for or poll); the serial console piped to the driver, which keeps a bounded
tail for diagnostics (a fixed ring, read at a capped rate: ``hostproc.ConsoleProcess``). The
process runs in the env's own cgroup (``cgroups.py``: how envs are found and counted) and
under ``hostproc.supervised``, so it dies with its controller and at its hard deadline.
destroy = kill the cgroup and the process group, reap, remove the run folder and the emptied
cgroup, then confirm that neither the cgroup, a process of ours with the env's marker (an older
version's env) nor the folder remains.

Starts (``QemuDriver(start=...)``, default ``$CLEANROOM_QEMU_START`` or ``auto``): ``cold``
boots the kernel every time; ``snapshot`` restores a clone (``clone.py``) of the
baseline's template (``templates.py``, files in ``snapshot.py``: built on first use by
booting the baseline once with its RAM in a file and saving it); ``auto`` is ``snapshot``,
falling back to a cold boot, with the reason recorded in ``EnvInfo.start_note``, if the
template cannot be built or a clone cannot be restored (after a failed build, or 3 failed
restores in a row, it boots cold for 5 minutes before trying again). Clones and the template's
build VM carry the same ``cleanroom-<env_id>`` marker and run folder as a cold VM, so destroy,
confirm and reap treat them alike.

This module only composes the parts, each given a ``context.QemuContext`` (never the driver):
``launch.py`` (spawn a QEMU process, wait for its agent; its command line in ``cmdline.py``,
the live process and its agent channel in ``live.py``), ``templates.py``, ``clone.py``, fork (a
warm env saved, clones restored from it, for groups) in ``fork.py`` and ``seal.py`` (a live
env saved for a session's branches, running on: ``live_fork.py``), spares
(clones started ahead, paused before their first guest instruction, resumed by ``create``
under the id ``next_env_id`` handed out) in ``spares.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from cleanroom.agent.connection import AgentConnection
from cleanroom.core.baseline_model import Baseline
from cleanroom.core.limits import ResolvedLimits
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import snapshot
from cleanroom.drivers.base import (
    Capabilities,
    DestroyReport,
    Env,
    EnvInfo,
    EnvRequest,
    ForkSnapshot,
    RunFolderDriver,
    new_env_id,
)
from cleanroom.drivers.qemu import fork, live_fork, seal
from cleanroom.drivers.qemu.clone import Cloner
from cleanroom.drivers.qemu.config import START_ENV, STARTS, QemuConfig
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.launch import Launcher
from cleanroom.drivers.qemu.live import Live, first_line
from cleanroom.drivers.qemu.spares import Spares
from cleanroom.drivers.qemu.templates import Templates
from cleanroom.errors import CleanroomError, LaunchError
from cleanroom.host import cgroups, hostproc, jail, paths

__all__ = ["STARTS", "START_ENV", "QemuDriver"]


class QemuDriver(RunFolderDriver):
    """Fresh microVMs from a baseline's kernel, initramfs and read-only root image."""

    name = "qemu"
    groups: cgroups.EnvGroups
    capabilities = Capabilities(
        console=True, snapshot=True, egress=True, fork=True, fork_live=True, spares=True
    )

    def __init__(
        self,
        *,
        boot_timeout_s: float = 90.0,
        run_root: Path | None = None,
        start: str | None = None,
        restore_timeout_s: float = 30.0,
    ) -> None:
        self.config = QemuConfig(
            boot_timeout_s=boot_timeout_s,
            restore_timeout_s=restore_timeout_s,
            start=start or os.environ.get(START_ENV, "auto").strip().lower() or "auto",
            run_root=run_root or paths.run_dir() / self.name,
            name=self.name,
        )
        self._live: dict[str, Live] = {}
        self.accel: accel_mod.Accel | None = None
        self.groups = cgroups.EnvGroups(
            cgroups.detect(), cgroups.scope_of(self.name, self.config.run_root)
        )
        launcher = Launcher(self.config, self._live, self.destroy, self._env, self.groups)
        self.ctx = QemuContext(self.config, self._live, launcher, self.destroy)
        self.templates = Templates(self.ctx)
        self.cloner = Cloner(self.ctx)
        self.spares = Spares(self.ctx, self.templates, self.cloner)
        self.forks = fork.Forks(self.ctx, self.templates, self.cloner, seal.Seals())

    @property
    def start(self) -> str:
        return self.config.start

    @property
    def run_root(self) -> Path:
        return self.config.run_root

    def _env(self, info: EnvInfo, session: AgentConnection) -> Env:
        return Env(self, info, session)

    def run_dir(self, env_id: str) -> Path:
        return self.config.run_dir(env_id)

    def describe(self) -> dict[str, str]:
        if self.accel is None:
            return {"driver": self.name}
        return {
            "driver": self.name,
            "accelerator": self.accel.name,
            "accelerator_version": f"qemu {self.accel.qemu_version}",
            "isolation": self.accel.isolation,
        }

    async def _accel(self, request: EnvRequest) -> accel_mod.Accel:
        if self.accel is None:
            self.accel = await accel_mod.choose(request.baseline)
        return self.accel

    def template_key(self, request: EnvRequest, accel: accel_mod.Accel) -> str:
        return self.templates.key(request, accel)

    async def create(self, request: EnvRequest) -> Env:
        with self.spares.create_in_flight():
            return await self._create(request)

    async def _create(self, request: EnvRequest) -> Env:
        accel = await self._accel(request)
        started = time.monotonic()
        note: str | None = None
        if request.network is not None and self.spares.claim(request.env_id) is not None:
            await self.destroy(request.env_id)  # a spare has no NIC: the id is free again
        if request.network is not None and self.start != "cold":
            note = "egress needs a NIC and snapshot templates have none: booted cold"
        elif self.start != "cold":
            try:
                template, note = await self.templates.template_for(request, accel)
                env, unused = await self._from_spare(request, accel, template, started)
                if env is None:
                    env = await self.cloner.clone(request, accel, template, started, note or unused)
                    self.templates.restored(template.key)
                self.spares.top_up(request, accel)
                return env
            except (CleanroomError, OSError) as exc:  # OSError: e.g. template removed under us
                self.templates.count_restore_failure(request, accel, exc)
                if self.start == "snapshot":
                    if isinstance(exc, LaunchError):
                        raise
                    raise LaunchError(f"snapshot start failed: {exc}") from exc
                note = f"snapshot start failed, booted cold: {first_line(exc)}"
        return await self.ctx.launcher.cold(request, accel, started, note)

    async def _from_spare(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        template: snapshot.Template,
        started: float,
    ) -> tuple[Env | None, str | None]:
        """Resume the spare reserved under ``request.env_id``, if any and if it still fits.
        (env, None), or (None, why the spare was not used: it is destroyed), or (None, None)."""
        spare = self.spares.claim(request.env_id)
        if spare is None:
            return None, None
        why = spare.fits(request, template, time.monotonic())
        if why is None:
            try:
                return await self.spares.resume(spare, request, accel, started), None
            except LaunchError as exc:  # destroyed already
                why = first_line(exc)
        else:
            await self.destroy(request.env_id)
        return None, f"a spare was not used: {why}"

    def keep_spares(self, count: int) -> None:
        self.spares.target = max(0, count) if self.start != "cold" else 0

    def next_env_id(self, baseline: Baseline, limits: ResolvedLimits) -> str:
        return self.spares.take_id(baseline, limits) or new_env_id()

    async def release_spares(self) -> list[DestroyReport]:
        return await self.spares.release()

    # -- fork (fork.py, seal.py) ----------------------------------------------------------------

    async def fork_parent(self, request: EnvRequest, snapshot_id: str) -> Env:
        return await self.forks.start_parent(request, await self._accel(request), snapshot_id)

    async def fork_save(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        return await self.forks.save(env, snapshot_id)

    async def fork_live(self, env: Env, snapshot_id: str) -> ForkSnapshot:
        return await live_fork.save_live(self.forks, env, snapshot_id)

    async def fork_sealed(self, snap: ForkSnapshot) -> ForkSnapshot:
        return await self.forks.seals.sealed(snap)

    async def fork_clone(self, request: EnvRequest, snap: ForkSnapshot) -> Env:
        return await self.forks.clone(request, self.accel, snap)

    async def fork_resume(self, request: EnvRequest, snap: ForkSnapshot, snapshot_id: str) -> Env:
        accel = await self._accel(request)
        return await self.forks.resume_parent(request, accel, snap, snapshot_id)

    async def verify_snapshot(self, snap: ForkSnapshot) -> None:
        await asyncio.to_thread(fork.verify, snap)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        self.forks.seals.forget(snapshot_id)
        return await asyncio.to_thread(fork.delete, snapshot_id)

    def list_snapshots(self) -> list[str]:
        return fork.list_ids()

    def snapshot_owner(self, snapshot_id: str) -> dict[str, Any] | None:
        return fork.owner(snapshot_id)

    async def destroy(self, env_id: str) -> DestroyReport:
        start = time.perf_counter()
        self.spares.forget(env_id)
        self.forks.parents.pop(env_id, None)
        live = self._live.get(env_id)
        gone, attempts = False, 0
        for attempts in range(1, 6):
            gone = await self._kill_and_confirm(env_id, live)
            if gone:
                break
            await asyncio.sleep(0.01 * 2**attempts)
        if live is not None:
            await live.close_sockets()
        if live is not None and live.pump is not None:
            live.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await live.pump
        self._live.pop(env_id, None)
        return DestroyReport(env_id, gone, attempts, (time.perf_counter() - start) * 1000)

    async def _kill_and_confirm(self, env_id: str, live: Live | None) -> bool:
        """Kill the env's cgroup, remove its run folder and the emptied cgroup, then one
        /proc scan for processes of an older version's env (no cgroup: marker and our uid).

        No graceful SIGTERM first: the guest's state is disposable (read-only disk, RAM
        overlay) and a dying QEMU needs no CPU time to die on SIGKILL, whereas on SIGTERM it
        must be scheduled, which with dozens of busy VMs on two cores costs tens of ms. True
        only if the cgroup is empty and gone, no process of ours carries the env's marker and
        no folder is left; strays the scan finds are SIGKILLed (by pidfd) for the next try.
        """
        if live is not None and live.proc.returncode is None:
            hostproc.kill_group(live.proc.pid, signal.SIGKILL)
        self.groups.kill(env_id)
        if live is not None:
            await live.proc.wait()
        hostproc.remove_tree(self.run_dir(env_id))
        removed = await self.groups.remove(env_id)
        strays = cgroups.own_pids_with_marker(env_id)
        if strays:
            cgroups.pidfd_kill(strays)
            await hostproc.wait_gone(strays, 2.0)
            return False
        return removed and not self.run_dir(env_id).exists()

    def exists(self, env_id: str) -> bool:
        return (
            self.run_dir(env_id).exists()
            or self.groups.exists(env_id)
            or bool(cgroups.own_pids_with_marker(env_id))
        )

    def alive(self, env_id: str) -> bool:
        live = self._live.get(env_id)
        if live is not None:
            return live.proc.returncode is None
        return bool(self.groups.pids(env_id) or cgroups.own_pids_with_marker(env_id))

    def list_owned(self) -> list[str]:
        """This driver's envs under this run folder (not gvisor's, not another home's): by
        their cgroups and run folders, and an older version's by marker, our uid and the run
        folder in their command line. Another user's process named like an env is none."""
        found = self.groups.listed()
        needles = (b"qemu-system", str(self.run_root).encode())
        found |= hostproc.env_ids_running(*needles, owned=jail.ours)
        if self.run_root.is_dir():
            found.update(p.name for p in self.run_root.iterdir() if p.name.startswith("env-"))
        return sorted(found)
