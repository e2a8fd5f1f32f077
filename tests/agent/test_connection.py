"""The host session distrusts the guest: garbage, oversized frames, quota, and escaping names."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cleanroom.agent import protocol
from cleanroom.agent.connection import AgentConnection, safe_relpath
from cleanroom.agent.protocol import Kind, encode
from cleanroom.errors import (
    EnvCrashed,
    FrameTooLarge,
    ProtocolError,
    QuotaExceeded,
    UnsafePath,
    Unsupported,
)


class Guest:
    """The guest end of a socket pair, scripted by the test."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, kind: Kind, header: dict[str, object] | None = None, body: bytes = b"") -> None:
        self.send(encode(kind, header, body))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[AgentConnection, Guest]]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock)
    session = AgentConnection(reader, writer, max_body=64 * 1024)
    yield session, Guest(guest_sock)
    await session.aclose()
    guest_sock.close()


def _run_episode_script(guest: Guest, frames: list[bytes]) -> None:
    for data in frames:
        guest.send(data)


async def test_hello_then_exec(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    guest.frame(Kind.HELLO, {"agent_version": "x", "features": list(protocol.FEATURES)})
    assert (await session.wait_hello())["agent_version"] == "x"
    guest.frame(Kind.STARTED, {"id": 1, "pid": 7})
    guest.frame(Kind.STDOUT, {"id": 1}, b"out")
    guest.frame(Kind.EXIT, {"id": 1, "code": 0, "duration_s": 0.5})
    guest.frame(Kind.DONE, {"id": 1})
    result = await session.exec(["true"])
    assert result.ok and result.stdout == b"out" and result.duration_s == 0.5


async def test_an_agent_that_does_not_multiplex_gets_no_command_or_transfer(
    pair: tuple[AgentConnection, Guest],
) -> None:
    """Protects the retirement of the first protocol's unnumbered EXEC, PUT and GET: an agent
    whose HELLO lacks "mux" gets ``Unsupported`` for a command, a write and a read, naming what
    was asked, and nothing is sent to it."""
    session, guest = pair
    guest.frame(Kind.HELLO, {"agent_version": "old"})
    await session.wait_hello()
    with pytest.raises(Unsupported, match="a command"):
        await session.exec(["ls"], cwd="/tmp")
    with pytest.raises(Unsupported, match="writing /x"):
        await session.put("/x", b"data")
    with pytest.raises(Unsupported, match="reading /x"):
        await session.get("/x")
    guest.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        guest.sock.recv(1)


async def test_garbage_is_a_protocol_error(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    guest.send(b"\x00" * 64)
    with pytest.raises(ProtocolError, match="magic"):
        await session.wait_hello()


async def test_oversized_frame_is_refused(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    guest.send(protocol.PREFIX.pack(protocol.MAGIC, int(Kind.HELLO), 2, 10**9) + b"{}")
    with pytest.raises(FrameTooLarge):
        await session.wait_hello()


async def test_closed_channel_is_a_crash(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    guest.sock.close()
    with pytest.raises(EnvCrashed):
        await session.wait_hello()


def _episode_end() -> list[bytes]:
    return [
        encode(Kind.EXIT, {"code": 0, "duration_s": 0.1}),
        encode(Kind.RESULT, {"present": True}, b'{"reward": 1}'),
        encode(Kind.DONE),
    ]


async def test_episode_collects_artifacts_with_digests(
    pair: tuple[AgentConnection, Guest], tmp_path: Path
) -> None:
    session, guest = pair
    guest.send(encode(Kind.STDOUT, {}, b"log line\n"))
    guest.send(
        encode(Kind.FILE, {"name": "d/a.bin", "offset": 0, "eof": False, "kind": "artifact"}, b"ab")
    )
    guest.send(
        encode(Kind.FILE, {"name": "d/a.bin", "offset": 2, "eof": True, "kind": "artifact"}, b"c")
    )
    for data in _episode_end():
        guest.send(data)
    out = await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1000)
    assert [a.name for a in out.artifacts] == ["d/a.bin"]
    assert (tmp_path / "artifacts/d/a.bin").read_bytes() == b"abc"
    import hashlib

    assert out.artifacts[0].sha256 == hashlib.sha256(b"abc").hexdigest()
    assert out.result_raw == b'{"reward": 1}'
    assert out.stdout_path is not None and out.stdout_path.read_bytes() == b"log line\n"


async def test_how_the_entrypoint_ran_is_taken_only_as_short_identifiers(
    pair: tuple[AgentConnection, Guest], tmp_path: Path
) -> None:
    session, guest = pair
    exit_header = {"code": 0, "entry": "function", "worker": "../../etc", "other": "x"}
    for data in (encode(Kind.EXIT, exit_header), encode(Kind.RESULT, {"present": False})):
        guest.send(data)
    guest.send(encode(Kind.DONE))
    out = await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1000)
    assert out.entry == {"entry": "function"}


@pytest.mark.parametrize(
    "name", ["../escape", "/etc/passwd", "a/../../b", "a//b", "./a", "", "a\x00b", "a\\..\\b"]
)
async def test_escaping_artifact_names_are_refused(
    pair: tuple[AgentConnection, Guest], tmp_path: Path, name: str
) -> None:
    session, guest = pair
    staging = tmp_path / "staging"
    guest.send(
        encode(Kind.FILE, {"name": name, "offset": 0, "eof": True, "kind": "artifact"}, b"x")
    )
    with pytest.raises(UnsafePath):
        await session.run_episode({"manifest": {}}, staging, quota_bytes=1000)
    outside = [p for p in tmp_path.rglob("*") if staging not in p.parents and p != staging]
    assert outside == []


async def test_symlinked_folder_in_staging_is_not_followed(
    pair: tuple[AgentConnection, Guest], tmp_path: Path
) -> None:
    session, guest = pair
    staging = tmp_path / "staging"
    (staging / "artifacts").mkdir(parents=True)
    (staging / "artifacts" / "link").symlink_to(tmp_path)
    guest.send(
        encode(Kind.FILE, {"name": "link/x", "offset": 0, "eof": True, "kind": "artifact"}, b"x")
    )
    with pytest.raises(UnsafePath):
        await session.run_episode({"manifest": {}}, staging, quota_bytes=1000)
    assert not (tmp_path / "x").exists()


async def test_output_quota_is_enforced(
    pair: tuple[AgentConnection, Guest], tmp_path: Path
) -> None:
    session, guest = pair
    for _ in range(5):
        guest.send(encode(Kind.STDOUT, {}, b"x" * 400))
    with pytest.raises(QuotaExceeded):
        await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1000)


async def test_out_of_order_chunk_is_refused(
    pair: tuple[AgentConnection, Guest], tmp_path: Path
) -> None:
    session, guest = pair
    guest.send(
        encode(Kind.FILE, {"name": "a", "offset": 0, "eof": False, "kind": "artifact"}, b"ab")
    )
    guest.send(encode(Kind.FILE, {"name": "a", "offset": 5, "eof": True, "kind": "artifact"}, b"c"))
    with pytest.raises(ProtocolError, match="out of order"):
        await session.run_episode({"manifest": {}}, tmp_path, quota_bytes=1000)


def test_safe_relpath_accepts_nested_names() -> None:
    assert str(safe_relpath("traj/ep-1/steps.jsonl")) == "traj/ep-1/steps.jsonl"


async def test_heartbeats_are_skipped_and_silence_is_a_crash(
    pair: tuple[AgentConnection, Guest],
) -> None:
    session, guest = pair
    session.silence_timeout_s = 0.3
    guest.frame(Kind.HELLO, {"agent_version": "x", "features": list(protocol.FEATURES)})
    await session.wait_hello()
    guest.frame(Kind.HEARTBEAT, {"t": 1})
    guest.frame(Kind.STARTED, {"id": 1, "pid": 7})
    guest.frame(Kind.EXIT, {"id": 1, "code": 0})
    guest.frame(Kind.HEARTBEAT, {"t": 2})
    guest.frame(Kind.DONE, {"id": 1})
    assert (await session.exec(["true"])).ok
    with pytest.raises(EnvCrashed, match="silent"):
        await session.exec(["true"])  # the guest never answers
