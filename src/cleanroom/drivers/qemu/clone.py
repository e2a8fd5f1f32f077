"""Snapshot starts for the qemu driver: a clone restored from a template (or a fork snapshot).

A clone is a new QEMU process with the template's devices, its RAM mapped copy-on-write from
the template's RAM file, ``-incoming defer`` and a second monitor (a socket pair) that already
holds the commands loading the device state (``migrate-incoming fd:N``, the state file
inherited); it runs once loaded. When the monitor has accepted them the driver queues RESEED
(host entropy, the env id, the wall clock) on the agent channel, and the clone is ready when
the agent answers with HELLO naming it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from cleanroom.agent import protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.drivers import accel as accel_mod
from cleanroom.drivers import qmp, snapshot
from cleanroom.drivers.base import Env, EnvRequest
from cleanroom.drivers.qemu.context import QemuContext
from cleanroom.drivers.qemu.live import Live
from cleanroom.errors import DriverError

RESEED_BYTES = 64


class Cloner:
    """Restores clones of a template (or of a fork snapshot) for one driver."""

    def __init__(self, ctx: QemuContext) -> None:
        self.ctx = ctx

    async def clone(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        template: snapshot.Template,
        started: float,
        note: str | None,
        *,
        ram: Path | None = None,
        shared: bool = False,
    ) -> Env:
        """Restore ``template`` (a fork parent maps its own copy of the RAM ``shared``)."""
        launcher = self.ctx.launcher
        live, monitor = await self.spawn_restoring(request, accel, template, ram=ram, shared=shared)
        try:
            session = await launcher.ready_or_destroy(
                request.env_id,
                live,
                restore(request.env_id, live, monitor),
                self.ctx.config.restore_timeout_s,
                "restore",
            )
        finally:
            monitor.close()
        return launcher.env(
            request,
            accel,
            live,
            started,
            session,
            start_kind="snapshot",
            template=template.digest,
            start_note=note,
        )

    async def spawn_restoring(
        self,
        request: EnvRequest,
        accel: accel_mod.Accel,
        template: snapshot.Template,
        *,
        ram: Path | None = None,
        shared: bool = False,
        paused: bool = False,
    ) -> tuple[Live, socket.socket]:
        """Start the QEMU process of a clone of ``template``: its monitor (returned) already
        holds the commands loading the device state. It runs once loaded, unless ``paused``
        (``-S``: its vCPU then waits for ``cont``, and no guest code runs before)."""
        state_fd = os.open(template.state, os.O_RDONLY | os.O_CLOEXEC)
        monitor, guest_end = socket.socketpair()  # QEMU reads its load commands from it
        try:
            monitor.sendall(snapshot.restore_script(state_fd))
            memory = snapshot.memory_args(ram or template.ram, template.memory_mib, shared=shared)
            mon = [
                "-chardev",
                f"socket,id=load,fd={guest_end.fileno()}",
                "-mon",
                "chardev=load,mode=control",
            ]
            live = await self.ctx.launcher.spawn(
                request,
                accel,
                [*memory, "-incoming", "defer", *mon, *(["-S"] if paused else [])],
                pass_fds=(state_fd, guest_end.fileno()),
                memory_backend=True,
            )
        except BaseException:
            monitor.close()
            raise
        finally:
            os.close(state_fd)
            guest_end.close()
        return live, monitor


async def restore(env_id: str, live: Live, monitor: socket.socket) -> AgentConnection:
    """Once the monitor accepted the load, queue RESEED; wait for the clone's HELLO."""
    mon_reader, mon_writer = await asyncio.open_unix_connection(sock=monitor)
    try:
        await load_accepted(live, mon_reader)
    finally:
        mon_writer.close()
    return await reseed(env_id, live)


async def load_accepted(live: Live, mon_reader: asyncio.StreamReader) -> None:
    """The monitor's answers to the load commands (DriverError if it refused one)."""
    await live.while_running(qmp.read_answers(mon_reader, snapshot.RESTORE_COMMANDS))


async def reseed(env_id: str, live: Live) -> AgentConnection:
    """Send the clone its RESEED (host entropy, its id, the wall clock); await its HELLO."""
    reader, writer = await live.open_channel()
    header = {"clone_id": env_id, "time_ns": time.time_ns()}
    writer.write(protocol.encode(protocol.Kind.RESEED, header, secrets.token_bytes(RESEED_BYTES)))
    session = live.session_over(reader, writer)
    await live.await_hello(session)
    if session.hello.get("clone_id") != env_id:
        await session.aclose()
        raise DriverError(f"clone answered as {session.hello.get('clone_id')!r}, not {env_id}")
    return session


async def reseed_again(env_id: str, session: AgentConnection) -> dict[str, Any]:
    """RESEED an agent that said HELLO already (a live-forked parent, a spare being taken): its
    own id, the clock, fresh host entropy; its HELLO (DriverError if it answers as another)."""
    header = {"clone_id": env_id, "time_ns": time.time_ns()}
    hello = await session.rejoin(header, secrets.token_bytes(RESEED_BYTES))
    if hello.get("clone_id") != env_id:
        raise DriverError(f"{env_id} answered RESEED as {hello.get('clone_id')!r}")
    return hello
