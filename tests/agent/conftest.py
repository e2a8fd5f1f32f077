"""Fixtures of the agent tests: the real guest agent serving a host socket (its commands are host
processes, its ``/run/cleanroom`` in ``tmp_path``) and the real host session of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.agent.nativekit import connected

from cleanroom.agent import native
from cleanroom.agent.connection import AgentConnection


@pytest.fixture
async def native_agent(tmp_path: Path) -> AsyncIterator[AgentConnection]:
    """The native agent (``native.host_binary``, as the fake driver runs it) as a host process
    on a unix socket, and the host's session of it after HELLO."""
    binary = native.host_binary()
    async with connected(binary, tmp_path, ready_s=30, silence_timeout_s=15, shutdown=False) as s:
        yield s


@pytest.fixture
def agent_session(native_agent: AgentConnection) -> AgentConnection:
    """The host session of the guest agent (the native one, as the fake driver runs it)."""
    return native_agent
