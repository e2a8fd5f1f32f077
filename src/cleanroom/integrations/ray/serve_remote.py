"""A served sandbox's session as the head sees it: every call forwarded to its node (imports Ray).

``RemoteSession`` stands in for the ``AsyncSession`` the envd handlers use (``commands``,
``files``, ``guard``) and sends each call to the ``ServeNode`` actor that holds the sandbox.
A background command's output comes back by long polls (``RemoteHandle``); a node that died
answers every call with ``SessionClosed``. ``guard.call`` yields an env whose agent only
connects guest ports (``RemoteAgent``: the port proxy's streams held on the node,
``serve_ports``); the filesystem calls, finding no FS feature there, take their command path;
a PTY is not routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from cleanroom.errors import CleanroomError, SessionClosed, Unsupported
from cleanroom.integrations.ray.aggregate import cause_of
from cleanroom.server.control import ServerError
from cleanroom.sessions.commands import CommandResult

Relay = Callable[[bytes], None] | None


async def call(ref: Awaitable[Any], node: str) -> Any:
    """Await a node's call; the node's own CleanroomError, or ``SessionClosed`` if it died."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayActorError as exc:
        raise SessionClosed(f"node {node} lost ({type(exc).__name__})") from exc
    except ray.exceptions.RayTaskError as exc:
        cause = cause_of(exc)
        if isinstance(cause, CleanroomError):
            raise cause from None
        raise ServerError(f"node {node}: {type(cause).__name__}: {cause}") from exc


class RemoteHandle:
    """A background command on the node: its output relayed as it comes, its result."""

    def __init__(self, session: RemoteSession, cid: str, out: Relay, err: Relay) -> None:
        self.session, self.cid = session, cid
        self._relay = {"stdout": out, "stderr": err}
        self._pump = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> CommandResult:
        cursor, node = 0, self.session.node
        while True:
            chunks, result, error = await call(
                node.handle.sbx_output.remote(self.session.sandbox_id, self.cid, cursor),
                node.node_id,
            )
            cursor += len(chunks)
            for kind, data in chunks:
                relay = self._relay.get(kind)
                if relay is not None:
                    relay(data)
            if error is not None:
                raise error
            if result is not None:
                return result  # type: ignore[no-any-return]

    async def wait(self) -> CommandResult:
        return await asyncio.shield(self._pump)

    async def send_stdin(self, data: bytes) -> None:
        await self.session.forward("sbx_input", self.cid, data)

    async def close_stdin(self) -> None:
        await self.session.forward("sbx_input", self.cid, None)

    async def kill(self) -> None:
        await self.session.forward("sbx_signal", self.cid)


class RemoteCommands:
    def __init__(self, session: RemoteSession) -> None:
        self.session = session

    async def run(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
        on_stdout: Relay = None,
        on_stderr: Relay = None,
        background: bool = False,
    ) -> Any:
        """A ``RemoteHandle`` (``background``), else the command run to its ``CommandResult``."""
        if not background:
            return await self.session.forward("sbx_run", argv, user)
        cid = await self.session.forward("sbx_start", argv, cwd, user, env)
        return RemoteHandle(self.session, cid, on_stdout, on_stderr)


class RemoteFiles:
    def __init__(self, session: RemoteSession) -> None:
        self.session = session

    async def read(self, path: str) -> bytes:
        data: bytes = await self.session.forward("sbx_read", path)
        return data

    async def write(self, path: str, data: bytes) -> None:
        await self.session.forward("sbx_write", path, data)


class RemoteStream:
    """A guest-port connection held by the node (``serve_ports``), as ``server/ports.py``
    uses a ``PortStream``: each read and write a call to the node."""

    def __init__(self, session: RemoteSession, cid: str) -> None:
        self.session, self.cid = session, cid
        self.sent = 0

    async def read(self) -> bytes:
        while True:
            data = await self.session.forward("port_read", self.cid)
            if data is not None:
                return data  # type: ignore[no-any-return]

    async def write(self, data: bytes) -> None:
        await self.session.forward("port_write", self.cid, data)
        self.sent += len(data)

    async def write_eof(self) -> None:
        await self.session.forward("port_write", self.cid, None)

    async def aclose(self) -> None:
        with contextlib.suppress(CleanroomError):
            await self.session.forward("port_close", self.cid)


class RemoteAgent:
    """What the head's port proxy asks of a guest agent: ``connect_port``, routed."""

    features = frozenset({"port"})

    def __init__(self, session: RemoteSession) -> None:
        self.session = session

    async def connect_port(self, port: int) -> RemoteStream:
        return RemoteStream(self.session, await self.session.forward("port_open", port))


class _Unrouted:
    """The env a ``guard.call`` yields here: its agent only connects ports (the filesystem
    calls then take their command path); a PTY is not routed through Ray."""

    def __init__(self, session: RemoteSession) -> None:
        self.session = RemoteAgent(session)

    async def spawn(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported("a PTY is not routed through Ray (cleanroom serve --ray)")


class _Transcript:
    path = Path(os.devnull)  # the node keeps the transcript (in its record)


class RemoteLifetime:
    """The sandbox's clock as ``Sandboxes._deadline`` moves it: each move sent to the node."""

    def __init__(self, session: RemoteSession) -> None:
        self.session = session
        self.deadline = 0.0
        self.timeout_s = 0.0

    def busy(self) -> None:
        left = max(0.0, self.deadline - asyncio.get_running_loop().time())
        self.session.node.handle.sbx_set_timeout.remote(self.session.sandbox_id, left)

    def idle(self) -> None:
        pass


class RemoteGuard:
    failed_by: BaseException | None = None  # a guest's failure ends it on its node

    def __init__(self, session: RemoteSession) -> None:
        self.session = session
        self.lifetime = RemoteLifetime(session)
        self.transcript = _Transcript()

    @asynccontextmanager
    async def call(self) -> AsyncIterator[_Unrouted]:
        yield _Unrouted(self.session)


class RemoteSession:
    """The sandbox ``sandbox_id`` held by ``node``'s ``ServeNode`` (a ``serve_head.Placed``)."""

    def __init__(self, node: Any, sandbox_id: str) -> None:
        self.node, self.sandbox_id = node, sandbox_id
        self.commands = RemoteCommands(self)
        self.files = RemoteFiles(self)
        self.guard = RemoteGuard(self)
        self.transcript = self.guard.transcript

    async def forward(self, method: str, *args: Any) -> Any:
        """``method`` of the node's actor for this sandbox."""
        remote = getattr(self.node.handle, method).remote(self.sandbox_id, *args)
        return await call(remote, self.node.node_id)
