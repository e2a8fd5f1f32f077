"""A served sandbox's guest ports on its node: connections the head reads and writes by call.

``get_host(port)`` under ``serve --ray``: the head's port proxy (``server/ports.py``,
unchanged) talks to a ``serve_remote.RemoteStream``, whose every read and write is a call to
the node's actor, which holds the real stream here: opened as the local proxy opens one (inside
a guest call of the sandbox's session, over the agent channel), until the head closes it or the
sandbox ends. A read waits at most ``READ_S`` (then answers None: nothing yet), so no call is
left reading after the head stopped asking. Plain Python (no Ray here).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass

from cleanroom.agent.ports import PortStream
from cleanroom.errors import PortUnreachable
from cleanroom.sessions import AsyncSession

READ_S = 5.0


@dataclass
class Held:
    stream: PortStream
    done: asyncio.Event
    task: asyncio.Task[None]


class NodePorts:
    """The open guest-port connections of this node's sandboxes, by connection id."""

    def __init__(self) -> None:
        self.held: dict[str, Held] = {}

    async def open(self, sb: AsyncSession, port: int) -> str:
        """A connection to the guest's ``port`` (``PortUnreachable`` where nothing listens)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[PortStream] = loop.create_future()
        done = asyncio.Event()

        async def hold() -> None:
            async with sb.guard.call() as env:
                agent = getattr(env, "session", None)
                if agent is None or "port" not in agent.features:
                    raise PortUnreachable("this sandbox's guest agent does not serve ports")
                stream = await agent.connect_port(port)
                try:
                    ready.set_result(stream)
                    await done.wait()
                finally:
                    await stream.aclose()

        def failed(task: asyncio.Task[None]) -> None:
            if not ready.done():
                exc = None if task.cancelled() else task.exception()
                ready.set_exception(exc or PortUnreachable(f"port {port}: the sandbox ended"))

        task = loop.create_task(hold())
        task.add_done_callback(failed)
        stream = await ready
        cid = secrets.token_hex(6)
        self.held[cid] = Held(stream, done, task)
        return cid

    def _get(self, cid: str) -> Held:
        held = self.held.get(cid)
        if held is None:
            raise PortUnreachable(f"connection {cid} is closed")
        return held

    async def read(self, cid: str) -> bytes | None:
        """The guest's next bytes (``b""``: it closed), or None if none came in ``READ_S``."""
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self._get(cid).stream.read(), READ_S)
        return None

    async def write(self, cid: str, data: bytes | None) -> None:
        """``data`` to the guest's end; None: no more (its sending half shut)."""
        stream = self._get(cid).stream
        await (stream.write_eof() if data is None else stream.write(data))

    async def close(self, cid: str) -> None:
        held = self.held.pop(cid, None)
        if held is not None:
            held.done.set()
            with contextlib.suppress(Exception):
                await held.task
