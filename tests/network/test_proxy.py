"""The egress proxy, driven the way QEMU drives it: each connection is handed over by a real
``fdpass.py`` process (its stdin is the connection), then spoken to like a guest would."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from cleanroom.network.events import NetEvent
from cleanroom.network.policy import Policy
from cleanroom.network.proxy import EgressProxy
from cleanroom.network.qemu_args import FDPASS, Attachment
from tests.network.test_dns import query
from tests.waiting import until


@dataclass
class Servers:
    echo: int  # the allowed destination: answers "echo:" + what it got
    other: int  # a local server no rule allows
    hits: list[str]  # who reached which server


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    hits: list[str] = []

    def handler(name: str):  # type: ignore[no-untyped-def]
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            hits.append(name)
            data = await reader.read()  # until the client's EOF
            writer.write(b"echo:" + data)
            await writer.drain()
            writer.close()

        return serve

    echo = await asyncio.start_server(handler("echo"), "127.0.0.1", 0)
    other = await asyncio.start_server(handler("other"), "127.0.0.1", 0)
    yield Servers(echo.sockets[0].getsockname()[1], other.sockets[0].getsockname()[1], hits)
    for server in (echo, other):
        server.close()


async def start(policy: Policy, **kwargs: object) -> tuple[EgressProxy, Attachment, list[NetEvent]]:
    seen: list[NetEvent] = []
    proxy = EgressProxy(
        policy,
        name="cleanroom-env-00000000000000aa-egress",
        on_event=seen.append,
        hosts={"allowed.test": "127.0.0.1", "refused.test": "127.0.0.1"},
        **kwargs,  # type: ignore[arg-type]
    )
    return proxy, await proxy.start(), seen


async def guest_connection(
    att: Attachment, tag: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """What QEMU does for a guest connection to a forward: run the helper with it as stdin."""
    guest, handed = socket.socketpair()
    helper = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(FDPASS), att.socket, tag, stdin=handed
    )
    handed.close()
    assert await helper.wait() == 0
    return await asyncio.open_connection(sock=guest)


async def exchange(att: Attachment, tag: str, data: bytes, *, eof: bool = True) -> bytes:
    reader, writer = await guest_connection(att, tag)
    writer.write(data)
    if eof:
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_connect_to_an_allowed_destination_is_relayed_and_counted(servers: Servers) -> None:
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]))
    try:
        reader, writer = await guest_connection(att, "proxy")
        writer.write(f"CONNECT allowed.test:{servers.echo} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 200 Connection established\r\n\r\n"
        writer.write(b"tls-bytes")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"echo:tls-bytes"
        writer.close()
        await proxy.aclose()
    finally:
        await proxy.aclose()
    [event] = seen
    assert (event.via, event.dest, event.allowed) == (
        "connect",
        f"allowed.test:{servers.echo}",
        True,
    )
    assert (event.bytes_up, event.bytes_down) == (9, 14)
    assert event.address == f"127.0.0.1:{servers.echo}" and event.rule == event.dest
    assert servers.hits == ["echo"]


@pytest.mark.parametrize(
    ("request_line", "status", "reason"),
    [
        ("CONNECT denied.test:{echo}", "403", "not on the allowlist"),
        ("CONNECT allowed.test:{other}", "403", "not on the allowlist"),  # another port
        ("CONNECT 127.0.0.1:{other}", "403", "not on the allowlist"),  # the host's loopback
        ("CONNECT 10.0.2.2:{echo}", "403", "not on the allowlist"),
        ("CONNECT 2130706433:{echo}", "400", "not a DNS name or an address"),
        ("CONNECT allowed.test {echo}", "400", "not an HTTP request"),
        ("GET /relative", "400", "only CONNECT and absolute http://"),
        ("GET https://allowed.test:{echo}/", "400", "only CONNECT and absolute http://"),
    ],
)
async def test_anything_else_is_refused_and_recorded(
    servers: Servers, request_line: str, status: str, reason: str
) -> None:
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]))
    line = request_line.format(echo=servers.echo, other=servers.other)
    try:
        reply = await exchange(att, "proxy", f"{line} HTTP/1.1\r\n\r\n".encode(), eof=False)
    finally:
        await proxy.aclose()
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply
    assert reason.encode() in reply
    [event] = seen
    assert not event.allowed and reason in event.reason and event.bytes_up == 0
    assert servers.hits == []  # nothing reached any server


async def test_an_absolute_http_request_is_forwarded_in_origin_form(servers: Servers) -> None:
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]))
    head = (
        f"GET http://allowed.test:{servers.echo}/p?q=1 HTTP/1.1\r\nHost: allowed.test\r\n"
        "Proxy-Authorization: Basic eA==\r\nConnection: keep-alive\r\n\r\n"
    )
    try:
        reply = await exchange(att, "proxy", head.encode())
    finally:
        await proxy.aclose()
    assert reply == b"echo:GET /p?q=1 HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
    assert [(e.via, e.allowed) for e in seen] == [("http", True)]


async def test_an_allowed_destination_that_refuses_is_a_502_with_the_error(
    servers: Servers,
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    proxy, att, seen = await start(Policy.parse([f"refused.test:{port}"]))
    try:
        reply = await exchange(
            att, "proxy", f"CONNECT refused.test:{port} HTTP/1.1\r\n\r\n".encode()
        )
    finally:
        await proxy.aclose()
    assert reply.startswith(b"HTTP/1.1 502 ")
    [event] = seen
    assert event.allowed and event.error and "ConnectionRefused" in event.error


async def test_a_plain_tcp_forward_reaches_its_name(servers: Servers) -> None:
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]))
    forward = next(f for f in att.forwards if f.dest is not None)
    assert forward.dest == ("allowed.test", servers.echo)
    assert forward.guest_addr == proxy.plan.addresses["allowed.test"] == "10.0.2.128"
    try:
        assert await exchange(att, forward.tag, b"plain") == b"echo:plain"
        reader, writer = await guest_connection(att, "tcp-99")  # no such forward
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed at once
        writer.close()
    finally:
        await proxy.aclose()
    assert [(e.via, e.allowed, e.bytes_up, e.bytes_down) for e in seen] == [
        ("tcp", True, 5, 10),
        ("tcp", False, 0, 0),
    ]
    assert seen[1].reason == "unknown forward"


async def test_dns_answers_only_allowed_names(servers: Servers) -> None:
    policy = Policy.parse([f"allowed.test:{servers.echo}", "*.wild.test:443"])
    proxy, att, seen = await start(policy)
    questions = [query("allowed.test"), query("allowed.test", 28), query("a.wild.test")]
    questions += [query("denied.test"), b"\x00" * 12]
    try:
        reader, writer = await guest_connection(att, "dns")
        for message in questions:  # one TCP connection, several queries (as glibc does)
            writer.write(len(message).to_bytes(2, "big") + message)
        answers = []
        for _ in questions:
            size = int.from_bytes(await reader.readexactly(2), "big")
            answers.append(await reader.readexactly(size))
        writer.close()
    finally:
        await proxy.aclose()
    rcodes = [a[3] & 0xF for a in answers]
    counts = [struct.unpack_from("!H", a, 6)[0] for a in answers]
    assert rcodes == [0, 0, 0, 3, 1]  # NOERROR x3, NXDOMAIN, FORMERR
    assert counts == [1, 0, 0, 0, 0]  # only the allowed exact name has an address
    assert answers[0].endswith(socket.inet_aton("10.0.2.128"))
    assert [(e.dest, e.allowed) for e in seen] == [
        ("allowed.test A", True),
        ("allowed.test AAAA", True),
        ("a.wild.test A", True),
        ("denied.test A", False),
        ("(malformed query)", False),
    ]
    assert "HTTP proxy only" in seen[2].reason and seen[3].reason == "not on the allowlist"


async def test_closing_cuts_open_connections_and_records_them(servers: Servers) -> None:
    got = bytearray()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):  # what got through, as it arrives
            got.extend(data)
        writer.close()

    destination = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = destination.sockets[0].getsockname()[1]
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{port}"]))
    reader, writer = await guest_connection(att, "proxy")
    writer.write(f"CONNECT allowed.test:{port} HTTP/1.1\r\n\r\n".encode())
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"half")
    await writer.drain()
    await until(lambda: bytes(got) == b"half", "the 4 bytes reached the destination", 10)
    await proxy.aclose()
    destination.close()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the guest sees its connection end
    [event] = seen
    assert event.allowed and event.bytes_up == 4
    # the socket is gone: a helper now fails, and QEMU closes that guest connection
    guest, handed = socket.socketpair()
    helper = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        str(FDPASS),
        att.socket,
        "proxy",
        stdin=handed,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await helper.wait() == 1
    guest.close()
    handed.close()


async def test_events_are_capped(servers: Servers) -> None:
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]), max_events=2)
    try:
        for _ in range(3):
            await exchange(att, "proxy", b"CONNECT denied.test:1 HTTP/1.1\r\n\r\n", eof=False)
    finally:
        await proxy.aclose()
    assert len(seen) == len(proxy.events) == 2 and proxy.dropped == 1


@pytest.mark.skipif(
    os.getuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="needs root (and the system Python) to hand a connection over as another user",
)
async def test_a_hand_off_from_another_user_is_ignored(servers: Servers) -> None:
    """Protects the uid check: the helper (the real ``fdpass.py``, run as nobody) reached the
    proxy and was refused, said so and exited 1; the guest's connection was never served."""
    proxy, att, seen = await start(Policy.parse([f"allowed.test:{servers.echo}"]))
    guest, handed = socket.socketpair()
    try:
        helper = await asyncio.create_subprocess_exec(
            "/usr/bin/python3",
            "-I",
            "-S",
            "-c",
            FDPASS.read_text(),  # nobody may not read the checkout: the source, not its path
            att.socket,
            "proxy",
            stdin=handed,
            stderr=asyncio.subprocess.PIPE,
            user=65534,
            cwd="/",
        )
        handed.close()
        _, stderr = await asyncio.wait_for(helper.communicate(), 10)
        assert helper.returncode == 1, stderr
        assert stderr.strip() == b"cleanroom egress helper: the proxy refused the hand-off"
        reader, writer = await asyncio.open_connection(sock=guest)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped, never served
        writer.close()
    finally:
        await proxy.aclose()
    assert seen == [] and servers.hits == []
