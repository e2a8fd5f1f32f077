"""The native agent's CONNECT (``agent/native/mux.c``, ``port.c``): a TCP connection to a port
of the guest relayed both ways over the channel, driven by the real host side
(``AgentConnection.connect_port``, ``agent/ports.py``). The agent runs as a host process here, so
"the guest's 127.0.0.1" is the host's: the servers below listen on the host's loopback."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.agent.test_native_agent import drive, pytestmark  # noqa: F401

from cleanroom.agent import native
from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.ports import PortStream
from cleanroom.agent.protocol import Kind
from cleanroom.errors import PortUnreachable


@pytest.fixture(scope="module")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-port") / native.BINARY
    subprocess.run(native.gcc_argv(out), cwd=native.NATIVE_DIR, check=True)
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def closed_port() -> Iterator[int]:
    yield free_port()


async def read_all(stream: PortStream) -> bytes:
    parts = []
    while chunk := await stream.read():
        parts.append(chunk)
    return b"".join(parts)


def test_bytes_go_both_ways_in_order_and_half_close_is_kept(agent_binary: Path, root: Path) -> None:
    """Protects: 3 MiB (past the window both ways) reach the guest's server whole and in
    order; its answer (the digest, then the bytes back) reaches the host whole; the host's
    end-of-input is the server's EOF while the server can still answer; DONE counts both."""
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB

    async def body(session: AgentConnection) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = await reader.read()  # until the host's eof
            writer.write(hashlib.sha256(got).hexdigest().encode() + b"\n" + got)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            stream = await session.connect_port(port)
            try:

                async def send() -> None:
                    await stream.write(payload)
                    await stream.write_eof()

                sender = asyncio.create_task(send())
                answer = await asyncio.wait_for(read_all(stream), 60)
                await sender
            finally:
                await stream.aclose()
        digest, _, echoed = answer.partition(b"\n")
        assert digest.decode() == hashlib.sha256(payload).hexdigest()
        assert echoed == payload
        assert stream.done and stream.sent == len(payload) == stream.acked
        await session.ping()  # the channel is fine after it

    drive(agent_binary, root, body)


def test_a_closed_port_is_port_unreachable_and_the_agent_goes_on(
    agent_binary: Path, root: Path, closed_port: int
) -> None:
    """Protects: nothing listening is ``PortUnreachable`` (FAILED "refused"), a port out of
    range is refused on the host, and the session keeps working."""

    async def body(session: AgentConnection) -> None:
        with pytest.raises(PortUnreachable, match="refused"):
            await session.connect_port(closed_port)
        with pytest.raises(ValueError):
            await session.connect_port(70000)
        assert (await session.exec(["true"])).exit_code == 0

    drive(agent_binary, root, body)


def test_the_guest_refuses_a_bad_port_and_the_host_can_stop_a_connection(
    agent_binary: Path, root: Path
) -> None:
    """Protects: a CONNECT whose port is not 1..65535 (sent raw, past the host's check) is the
    guest's FAILED, not a dial; a KILL ends a connection whose server never answers (DONE
    stopped) and frees the guest's side: more connections open after it."""

    async def body(session: AgentConnection) -> None:
        channel = session.channel
        for bad in (0, 65536, "80", None, 1.5):
            rid, inbox = channel.open()
            await channel.send(Kind.CONNECT, {"id": rid, "port": bad})
            frame = await channel.take(inbox)
            assert frame.kind == Kind.FAILED and "1..65535" in frame.header["message"]
            channel.close(rid, finished=True)

        accepted: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # reads nothing, answers nothing

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            for _ in range(3):
                stream = await session.connect_port(port)
                await stream.write(b"hello")
                await stream.aclose()
            for w in accepted:
                w.close()
        assert len(accepted) == 3
        assert (await session.exec(["true"])).exit_code == 0

    drive(agent_binary, root, body)
