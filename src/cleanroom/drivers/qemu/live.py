"""A qemu env's live QEMU process as the driver holds it, and its agent channel.

The agent channel is one end of a socket pair the driver made before QEMU started (the guest's
virtio-serial port is the other end), so there is nothing to connect to or poll: the host's end
is opened once as streams, and every wait on the guest is cut short as soon as QEMU exits. The
QMP monitor is a socket pair too (no socket path: a home of any length works), opened on the
first ``open_qmp`` and closed with the env.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from cleanroom.agent import bulk
from cleanroom.agent.bulk import BulkDisk
from cleanroom.agent.connection import AgentConnection
from cleanroom.drivers.qmp import QmpClient
from cleanroom.errors import DriverError, LaunchError
from cleanroom.host import hostproc


class Live(hostproc.ConsoleProcess):
    """What the driver holds for an env it created in this process."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        console_fd: int,
        run_dir: Path,
        channel: socket.socket,
        monitor: socket.socket,
    ) -> None:
        super().__init__(proc, console_fd)
        self.run_dir = run_dir
        self.channel: socket.socket | None = channel  # the agent channel until it is opened
        self.monitor: socket.socket | None = monitor  # the QMP monitor until it is opened
        self.qmp: QmpClient | None = None
        self.jail: dict[str, Any] | None = None  # who it runs as, what confines it (launch.py)
        self.bulk = bulk.file_in(run_dir)  # its bulk disk's file (launch.py makes it)

    async def open_qmp(self) -> QmpClient:
        """The env's QMP client (connected on the first call, then the same one)."""
        if self.qmp is None:
            monitor, self.monitor = self.monitor, None
            if monitor is None:
                raise DriverError("the QMP monitor was already closed")
            self.qmp = await QmpClient.over(monitor)
        return self.qmp

    async def close_sockets(self) -> None:
        """Close QMP and whatever socket was never opened (idempotent)."""
        if self.qmp is not None:
            await self.qmp.aclose()
            self.qmp = None
        for sock in (self.channel, self.monitor):
            if sock is not None:
                sock.close()
        self.channel = self.monitor = None

    async def open_channel(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The host's end of the agent channel as streams (once: the streams then own it)."""
        channel, self.channel = self.channel, None
        if channel is None:
            raise DriverError("the agent channel was already opened")
        return await asyncio.open_unix_connection(sock=channel, limit=1 << 22)

    def session_over(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> AgentConnection:
        """The agent session on the opened channel, with the VM's bulk disk."""
        session = AgentConnection(reader, writer)
        session.bulk = BulkDisk(self.bulk)
        return session

    async def connect(self) -> AgentConnection:
        reader, writer = await self.open_channel()
        session = self.session_over(reader, writer)
        await self.await_hello(session)
        return session

    async def await_hello(self, session: AgentConnection) -> None:
        """Wait for HELLO, or fail as soon as QEMU exits; closes the session on failure."""
        try:
            await self.while_running(session.wait_hello())
        except BaseException:
            await session.aclose()
            raise

    async def while_running(self, step: Awaitable[Any]) -> Any:
        """``step``'s result, or LaunchError as soon as QEMU exits before it is done."""
        step_task = asyncio.ensure_future(step)
        exit_task = asyncio.ensure_future(self.proc.wait())
        try:
            done, _ = await asyncio.wait(
                {step_task, exit_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if step_task not in done:
                raise LaunchError(f"QEMU exited with status {self.proc.returncode} during boot")
            return step_task.result()
        finally:
            for task in (step_task, exit_task):
                task.cancel()
            await asyncio.gather(step_task, exit_task, return_exceptions=True)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for notes and reasons."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
