"""Transfers of any documented size work end to end: the real guest agent (the native one as a host
process) talks to the real host session, both with the default frame limit (``DEFAULT_MAX_BODY``, 1
MiB). On the old code a 2 MiB result.json was one RESULT frame (``FrameTooLarge``) and a PUT over 1
MiB one frame the agent refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cleanroom.agent import protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.evidence.record import parse_guest_result

pytestmark = pytest.mark.timeout(60)  # on the old code a multi-chunk PUT hung the agent

WRITE_RESULT = """
import os, sys
size = int(sys.argv[1])
head = b'{"reward": 1, "pad": "'
with open(os.environ["CLEANROOM_DIR"] + "/result.json", "wb") as f:
    f.write(head + b"x" * (size - len(head) - 2) + b'"}')
"""


@pytest.fixture
def session(agent_session: AgentConnection) -> AgentConnection:
    return agent_session


async def run_with_result(session: AgentConnection, staging: Path, size: int) -> bytes | None:
    request = {
        "manifest": {},
        "entrypoint": [sys.executable, "-c", WRITE_RESULT, str(size)],
        "timeout_s": 60,
    }
    out = await session.run_episode(request, staging, quota_bytes=64 << 20)
    assert out.exit.exit_code == 0, out.stderr_path and out.stderr_path.read_text()
    return out.result_raw


async def test_a_2_mib_result_arrives_whole(session: AgentConnection, tmp_path: Path) -> None:
    raw = await run_with_result(session, tmp_path / "s", 2 << 20)
    assert raw is not None and len(raw) == 2 << 20
    assert parse_guest_result(raw).problem is None


async def test_result_limit_at_its_edge(session: AgentConnection, tmp_path: Path) -> None:
    limit = protocol.RESULT_MAX_BYTES
    raw = await run_with_result(session, tmp_path / "a", limit)
    assert raw is not None and len(raw) == limit and parse_guest_result(raw).problem is None
    raw = await run_with_result(session, tmp_path / "b", limit + 1000)
    assert raw is not None and len(raw) == limit + 1  # enough to say "too large", no more
    problem = parse_guest_result(raw).problem
    assert problem is not None and "larger than" in problem


async def test_put_of_several_chunks_and_get_back(session: AgentConnection, tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * protocol.DEFAULT_MAX_BODY // 256 + 7)
    path = str(tmp_path / "put" / "file.bin")
    await session.put(path, data)
    assert Path(path).read_bytes() == data
    assert await session.get(path) == data
    await session.put(path, b"")  # an empty file truncates, as before
    assert Path(path).read_bytes() == b""
