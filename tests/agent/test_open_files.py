"""A guest cannot hold many host file descriptors open (issue 15 §8): an episode that begins
more than ``MAX_OPEN_ARTIFACTS`` artifacts without finishing them fails with QuotaExceeded, and
every file it had open is closed (before: up to 10,000 open at once, until its deadline; two
such guests made a third episode fail with EMFILE)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from cleanroom.agent.connection import MAX_OPEN_ARTIFACTS, AgentConnection
from cleanroom.agent.protocol import Kind, encode
from cleanroom.errors import QuotaExceeded


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_too_many_open_artifacts_is_a_quota_error_and_closes_them(tmp_path: Path) -> None:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock)
    session = AgentConnection(reader, writer, max_body=64 * 1024)
    before = open_fds()
    try:
        for i in range(MAX_OPEN_ARTIFACTS + 1):  # begun, never finished
            header = {"name": f"a{i}", "offset": 0, "eof": False, "kind": "artifact"}
            guest_sock.sendall(encode(Kind.FILE, header, b"x"))
        guest_sock.sendall(encode(Kind.EXIT, {"code": 0}) + encode(Kind.DONE))
        try:
            await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1 << 20)
        except QuotaExceeded as exc:
            assert "open at once" in str(exc)
        else:
            raise AssertionError("the guest held every artifact open")
        assert open_fds() <= before  # none of the 9 kept (other tests' threads may close some)
    finally:
        await session.aclose()
        guest_sock.close()


async def test_artifacts_sent_one_after_another_are_not_limited(tmp_path: Path) -> None:
    """The honest agent's way (one artifact at a time) may send many more than the bound."""
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock)
    session = AgentConnection(reader, writer, max_body=64 * 1024)
    try:
        for i in range(MAX_OPEN_ARTIFACTS * 3):
            header = {"name": f"a{i}", "offset": 0, "eof": True, "kind": "artifact"}
            guest_sock.sendall(encode(Kind.FILE, header, b"x"))
        guest_sock.sendall(encode(Kind.EXIT, {"code": 0}) + encode(Kind.DONE))
        output = await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1 << 20)
        assert len(output.artifacts) == MAX_OPEN_ARTIFACTS * 3
    finally:
        await session.aclose()
        guest_sock.close()
