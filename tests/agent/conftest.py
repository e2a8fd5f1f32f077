"""Fixtures of the agent tests: the real guest agent in a host thread, the real host session."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import guest
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
