"""Fixtures of the agent tests: the real guest agent serving a host socket (its commands are host
processes, its ``/run/cleanroom`` in ``tmp_path``) and the real host session of it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import native
from cleanroom.agent.session import AgentSession


@pytest.fixture
async def native_agent(tmp_path: Path) -> AsyncIterator[AgentSession]:
    """The native agent (``native.host_binary``, as the fake driver runs it) as a host process
    on a unix socket, and the host's session of it after HELLO."""
    sock = tmp_path / "agent.sock"
    done: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.get_running_loop().create_future()
    )
    server = await asyncio.start_unix_server(
        lambda r, w: done.set_result((r, w)), str(sock), limit=1 << 22
    )
    env = {
        "PATH": os.environ["PATH"],
        "CLEANROOM_AGENT_SOCKET": str(sock),
        "CLEANROOM_GUEST_ROOT": str(tmp_path / "guest"),
    }
    binary = native.host_binary()
    proc = await asyncio.create_subprocess_exec(str(binary), env=env, start_new_session=True)
    try:
        reader, writer = await asyncio.wait_for(done, 30)
        session = AgentSession(reader, writer)
        await asyncio.wait_for(session.wait_hello(), 30)
        yield session
        await session.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        server.close()


@pytest.fixture
def agent_session(native_agent: AgentSession) -> AgentSession:
    """The host session of the guest agent (the native one, as the fake driver runs it)."""
    return native_agent
