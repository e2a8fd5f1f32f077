"""The native agent as a host process on a unix socket, and the host's session of it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from cleanroom.agent.connection import AgentConnection


@asynccontextmanager
async def connected(
    binary: Path,
    root: Path,
    extra_env: dict[str, str] | None = None,
    *,
    ready_s: float = 10,
    silence_timeout_s: float = 5,
    shutdown: bool = True,
) -> AsyncIterator[AgentConnection]:
    """``binary`` serving a socket in ``root`` (its guest root ``root/guest``) after HELLO; at
    the end SHUTDOWN and its exit awaited (``shutdown``), else the session closed; killed if
    still alive either way."""
    sock = root / "agent.sock"
    done: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future()
    )
    server = await asyncio.start_unix_server(
        lambda r, w: done.set_result((r, w)), str(sock), limit=1 << 22
    )
    env = {
        "PATH": os.environ["PATH"],
        "CLEANROOM_AGENT_SOCKET": str(sock),
        "CLEANROOM_GUEST_ROOT": str(root / "guest"),
        **(extra_env or {}),
    }
    proc = await asyncio.create_subprocess_exec(str(binary), env=env, start_new_session=True)
    try:
        reader, writer = await asyncio.wait_for(done, ready_s)
        session = AgentConnection(reader, writer, silence_timeout_s=silence_timeout_s)
        await asyncio.wait_for(session.wait_hello(), ready_s)
        yield session
        if shutdown:
            await session.shutdown()
            await asyncio.wait_for(proc.wait(), 10)
        else:
            await session.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        server.close()
