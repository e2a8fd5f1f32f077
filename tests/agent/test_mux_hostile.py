"""A hostile multiplexing guest, scripted frame by frame: whatever it sends on the new paths
ends that session with a ``ProtocolError`` (or ``EnvCrashed`` for silence) for every waiter and
every later request, and never hangs or crashes the host. An agent without ``features`` gets a
typed ``Unsupported`` for what it lacks. Protects issue 16 ("the guest stays untrusted on every
new path"); none of these requests existed on the old code."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cleanroom.agent import protocol
from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.protocol import Kind, encode, read_frame
from cleanroom.errors import EnvCrashed, FrameTooLarge, ProtocolError, Unsupported

pytestmark = pytest.mark.timeout(30)


class Guest:
    """The guest end of a socket pair: reads the host's frames, sends what the test says."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stream = sock.makefile("rb", buffering=0)

    def send(self, kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> None:
        self.sock.sendall(encode(kind, header, body))

    async def request(self) -> protocol.Frame:
        return await asyncio.to_thread(read_frame, self.stream)


async def connect(features: list[str]) -> tuple[AgentConnection, Guest]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock)
    session = AgentConnection(reader, writer)
    guest = Guest(guest_sock)
    guest.send(Kind.HELLO, {"agent_version": "hostile", "features": features})
    await session.wait_hello()
    return session, guest


@pytest.fixture
async def pair() -> AsyncIterator[tuple[AgentConnection, Guest]]:
    session, guest = await connect(list(protocol.FEATURES))
    yield session, guest
    await session.aclose()
    guest.sock.close()


async def broken_after(session: AgentConnection, error: type[Exception]) -> None:
    """Every later request fails at once with the same kind of error."""
    with pytest.raises(error):
        await session.exec(["true"])


@pytest.mark.parametrize(
    "header",
    [{"id": 999}, {"id": "1"}, {"id": True}, {"id": 1.5}],
    ids=["unknown-id", "string-id", "bool-id", "float-id"],
)
async def test_a_frame_for_a_request_never_opened(
    pair: tuple[AgentConnection, Guest], header: dict[str, Any]
) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.exec(["true"]))
    request = await guest.request()
    assert request.kind == Kind.EXEC
    guest.send(Kind.STDOUT, header, b"x")
    with pytest.raises(ProtocolError):
        await running
    await broken_after(session, ProtocolError)


async def test_a_frame_after_the_request_ended(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.exec(["true"]))
    rid = (await guest.request()).header["id"]
    guest.send(Kind.STARTED, {"id": rid, "pid": 5})
    guest.send(Kind.EXIT, {"id": rid, "code": 0})
    guest.send(Kind.DONE, {"id": rid})
    assert (await running).ok
    guest.send(Kind.STDOUT, {"id": rid}, b"late")
    await asyncio.sleep(0.05)
    await broken_after(session, ProtocolError)


async def test_a_stream_past_its_window(pair: tuple[AgentConnection, Guest]) -> None:
    """The guest may send ``WINDOW`` bytes beyond the host's ACK, no more; the host does
    not keep what it was never asked for (its memory stays bounded)."""
    session, guest = pair

    async def read_all() -> None:
        async for _ in session.get_stream("/big"):
            await asyncio.sleep(3600)  # a consumer that never asks for more

    running = asyncio.ensure_future(read_all())
    rid = (await guest.request()).header["id"]
    chunk = b"x" * protocol.CHUNK
    for n in range(protocol.WINDOW // protocol.CHUNK + 2):
        header = {"id": rid, "offset": n * protocol.CHUNK, "eof": False}
        await asyncio.to_thread(guest.send, Kind.DATA, header, chunk)  # the loop reads on
    with pytest.raises(ProtocolError, match="window"):
        for _ in range(200):  # the reader task reads the flood meanwhile
            await asyncio.sleep(0.01)
            session.channel.check()
    running.cancel()


async def test_an_oversized_stream_chunk(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.get("/f"))
    rid = (await guest.request()).header["id"]
    big = b"x" * (protocol.CHUNK + 1)  # more than a socket buffer: sent from a thread
    await asyncio.to_thread(guest.send, Kind.DATA, {"id": rid, "offset": 0}, big)
    with pytest.raises(ProtocolError, match="at most"):
        await running
    await broken_after(session, ProtocolError)


async def test_a_chunk_out_of_order(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.get("/f"))
    rid = (await guest.request()).header["id"]
    guest.send(Kind.DATA, {"id": rid, "offset": 7}, b"x")
    with pytest.raises(ProtocolError, match="order"):
        await running


async def test_an_ack_of_bytes_never_sent(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.put("/f", b"abc"))
    rid = (await guest.request()).header["id"]
    guest.send(Kind.ACK, {"id": rid, "size": 10**6})
    with pytest.raises(ProtocolError, match="never sent"):
        await running


async def test_garbage_mid_session_fails_every_waiter(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    first = asyncio.ensure_future(session.exec(["sleep", "1"]))
    second = asyncio.ensure_future(session.exec(["sleep", "2"]))
    await guest.request()
    await guest.request()
    guest.sock.sendall(b"\x00" * 64)
    for waiter in (first, second):
        with pytest.raises(ProtocolError, match="magic"):
            await waiter
    await broken_after(session, ProtocolError)


async def test_a_frame_over_the_body_limit(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.exec(["true"]))
    await guest.request()
    guest.sock.sendall(protocol.PREFIX.pack(protocol.MAGIC, int(Kind.STDOUT), 2, 10**9) + b"{}")
    with pytest.raises(FrameTooLarge):
        await running


async def test_an_unnumbered_frame_nobody_asked_for(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.exec(["true"]))
    await guest.request()
    guest.send(Kind.PONG, {})
    with pytest.raises(ProtocolError, match="outside of a request"):
        await running


async def test_silence_is_a_crash(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    session.silence_timeout_s = 0.3
    running = asyncio.ensure_future(session.exec(["true"]))
    await guest.request()
    with pytest.raises(EnvCrashed, match="silent"):
        await running


async def test_heartbeats_keep_a_long_command_alive(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    session.silence_timeout_s = 0.3
    running = asyncio.ensure_future(session.exec(["sleep", "1"]))
    rid = (await guest.request()).header["id"]
    guest.send(Kind.STARTED, {"id": rid, "pid": 5})
    for _ in range(8):
        await asyncio.sleep(0.1)
        guest.send(Kind.HEARTBEAT, {"t": 0})
    guest.send(Kind.EXIT, {"id": rid, "code": 0})
    guest.send(Kind.DONE, {"id": rid})
    assert (await running).ok


async def test_an_agent_without_features_gets_unsupported() -> None:
    """An agent whose HELLO lists no features (no "mux"): every command, transfer and stream
    is refused, typed, and nothing is sent to it (the first protocol's unnumbered EXEC, PUT
    and GET are retired)."""
    session, guest = await connect([])
    try:
        with pytest.raises(Unsupported):
            await session.spawn(["true"])
        with pytest.raises(Unsupported):
            await session.exec(["cat"], stdin=b"x")
        with pytest.raises(Unsupported):
            await session.exec(["true"])
        with pytest.raises(Unsupported):
            await session.put("/f", b"x")
        with pytest.raises(Unsupported):
            await session.get("/f")
        with pytest.raises(Unsupported):
            async for _ in session.get_stream("/f"):
                pass
        guest.sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            guest.sock.recv(1)
    finally:
        await session.aclose()
        guest.sock.close()
