"""Starting one env's QEMU process and waiting for its agent (cold boots, and the spawn that
clones share).

``spawn`` makes the run folder (owner record first), the bulk disk's file (``agent.bulk``), the
env's cgroup with its limits, its jail (``jail.py``: a uid of its own, an empty root), the agent
channel's and the QMP monitor's socket pairs, then the supervised process, and records it in
``live``; ``ready_or_destroy`` waits for a readiness step and destroys the env on any failure;
``cold`` is both, for a kernel boot.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cleanroom.agent import bulk
from cleanroom.agent.connection import AgentConnection
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers.base import DestroyReport, Env, EnvInfo, EnvRequest, fail_launch, write_owner
from cleanroom.drivers.qemu import cmdline
from cleanroom.drivers.qemu.config import QemuConfig
from cleanroom.drivers.qemu.jail import Jail, env_limits
from cleanroom.drivers.qemu.live import Live
from cleanroom.errors import ConfigError, LaunchError
from cleanroom.host import hostproc
from cleanroom.host.cgroups import EnvGroups

MakeEnv = Callable[[EnvInfo, AgentConnection], Env]  # the driver's Env around a ready session


class Launcher:
    """Spawns QEMU processes for one driver and turns ready ones into ``Env``s."""

    def __init__(
        self,
        config: QemuConfig,
        live: dict[str, Live],
        destroy: Callable[[str], Awaitable[DestroyReport]],
        make_env: MakeEnv,
        groups: EnvGroups,
    ) -> None:
        self.config = config
        self.live = live
        self.groups = groups
        self.destroy = destroy
        self.make_env = make_env

    async def spawn(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        extra: list[str] | None = None,
        *,
        pass_fds: tuple[int, ...] = (),
        memory_backend: bool = False,
    ) -> Live:
        """Start the env's QEMU process (run folder first: owner, its cgroup and limits, its
        jail, then the process inside that cgroup, its pid)."""
        run_dir = self.config.run_dir(request.env_id)
        run_dir.mkdir(parents=True, mode=0o700)
        write_owner(run_dir, request, self.config.name)
        disk = bulk.file_in(run_dir)
        try:
            bulk.create(disk)
            self.groups.create(request.env_id, env_limits(request))
            jail = Jail.open(request, run_dir) if self.config.jail else Jail(None, None, "off")
        except (OSError, ConfigError) as exc:
            hostproc.remove_tree(run_dir)
            await self.groups.remove(request.env_id)
            raise LaunchError(f"cannot make the env's bulk disk, cgroup or jail: {exc}") from exc
        channel, guest_end = socket.socketpair()
        monitor, qemu_monitor = socket.socketpair()
        fds = (guest_end.fileno(), qemu_monitor.fileno())
        argv = cmdline.command(
            request,
            accel,
            extra,
            ctl_fd=fds[0],
            qmp_fd=fds[1],
            bulk_disk=disk,
            memory_backend=memory_backend,
            jail=jail.args,
        )
        argv = self.groups.wrap(request.env_id, argv)
        try:
            proc, console_fd = await hostproc.spawn_with_console(
                argv, pass_fds=(*pass_fds, *fds, *jail.pass_fds)
            )
        except OSError as exc:
            channel.close()
            monitor.close()
            hostproc.remove_tree(run_dir)
            await self.groups.remove(request.env_id)
            raise LaunchError(f"cannot start QEMU: {exc}") from exc
        finally:
            guest_end.close()
            qemu_monitor.close()
            jail.spawned()
        live = Live(proc, console_fd, run_dir, channel, monitor)
        live.jail = {**jail.facts(request), **self.groups.jail(request.env_id)}
        self.live[request.env_id] = live
        live.pump = asyncio.create_task(live.read_console())
        (run_dir / "pid").write_text(str(proc.pid))
        return live

    async def ready_or_destroy(
        self,
        env_id: str,
        live: Live,
        ready: Awaitable[AgentConnection],
        timeout_s: float,
        what: str,
    ) -> AgentConnection:
        """Await ``ready`` within ``timeout_s``; on any failure destroy the env, then raise."""
        try:
            return await asyncio.wait_for(ready, timeout_s)
        except BaseException as exc:
            await fail_launch(self.destroy, env_id, live.console_tail(), exc, timeout_s, what)

    async def cold(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        started: float,
        note: str | None,
        extra: list[str] | None = None,
        *,
        memory_backend: bool = False,
    ) -> Env:
        """Boot the kernel; the env once its agent said HELLO."""
        live = await self.spawn(request, accel, extra, memory_backend=memory_backend)
        session = await self.ready_or_destroy(
            request.env_id, live, live.connect(), self.config.boot_timeout_s, "boot"
        )
        return self.env(request, accel, live, started, session, start_note=note)

    def env(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        live: Live,
        started: float,
        session: AgentConnection,
        **start: Any,
    ) -> Env:
        """The ready env: its ``EnvInfo`` (``start``: how it started) around ``session``."""
        info = EnvInfo(
            env_id=request.env_id,
            driver=self.config.name,
            accelerator=accel.name,
            isolation=accel.isolation,
            pid=live.proc.pid,
            run_dir=live.run_dir,
            created_at=time.time(),
            ready_s=time.monotonic() - started,
            jail=live.jail,
            console=live.console,
            **start,
        )
        return self.make_env(info, session)
