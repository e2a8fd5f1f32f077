"""Fixtures of the agent tests: a real guest agent serving a host socket (its commands are host
processes, its ``/run/cleanroom`` in ``tmp_path``) and the real host session of it."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import guest, native
from cleanroom.agent.session import AgentSession


@pytest.fixture
async def thread_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AgentSession]:
    """``guest.Agent`` serving a socket pair from a thread (its commands are host processes,
    its ``/run/cleanroom`` in ``tmp_path``), and the host's session of it after HELLO."""
    monkeypatch.setenv("CLEANROOM_GUEST_ROOT", str(tmp_path / "guest"))
    host_sock, guest_sock = socket.socketpair()
    agent = guest.Agent(guest_sock.makefile("rwb", buffering=0))
    threading.Thread(target=agent.serve, daemon=True).start()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock, limit=1 << 22)
    session = AgentSession(reader, writer)
    await session.wait_hello()
    yield session
    await session.aclose()
    guest_sock.close()


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


@pytest.fixture(params=["python", "native"])
def agent_session(request: pytest.FixtureRequest) -> AgentSession:
    """The host session of each guest agent in turn (their behaviour must be the same; the
    Python one goes once the native one serves everything)."""
    session: AgentSession = request.getfixturevalue(
        "thread_agent" if request.param == "python" else "native_agent"
    )
    return session
