"""The host's side of the bulk disk (``agent/bulk.py``) against a scripted guest over a socket
pair and a real disk file: the bytes cross on the disk, pieces of at most ``bulk.SIZE``, the
file emptied after every transfer; whatever a hostile guest answers is a typed error (the
channel broken where the protocol was), a missing file leaves the session usable, and a
transfer left unfinished retires the disk so the next one takes the channel. The guest's half
(``native/bulk.c``) on real VMs: tests/agent/test_bulk_vm.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cleanroom.agent import bulk, protocol
from cleanroom.agent.bulk import BulkDisk
from cleanroom.agent.connection import AgentConnection
from cleanroom.agent.protocol import Kind, encode, read_frame
from cleanroom.errors import GuestFileNotFound, ProtocolError, QuotaExceeded

pytestmark = pytest.mark.timeout(60)


class Guest:
    """The guest end: reads the host's frames; ``serve`` answers them as an honest agent."""

    def __init__(self, sock: socket.socket, disk: Path) -> None:
        self.sock, self.disk = sock, disk
        self.stream = sock.makefile("rb", buffering=0)
        self.files: dict[str, bytes] = {}
        self.requests: list[protocol.Frame] = []

    def send(self, kind: int, header: dict[str, Any] | None = None) -> None:
        self.sock.sendall(encode(kind, header))

    async def request(self) -> protocol.Frame:
        frame = await asyncio.to_thread(read_frame, self.stream)
        self.requests.append(frame)
        return frame

    async def serve(self, count: int) -> None:
        """Answer ``count`` BULK_* requests as native/bulk.c does."""
        for _ in range(count):
            frame = await self.request()
            h = frame.header
            if frame.kind == Kind.BULK_PUT:
                piece = self.disk.read_bytes()[: h["size"]]
                old = self.files.get(h["path"], b"") if h["offset"] else b""
                self.files[h["path"]] = old[: h["offset"]] + piece
                self.send(Kind.DONE, {"id": h["id"], "size": h["offset"] + h["size"]})
            elif frame.kind == Kind.BULK_GET:
                data = self.files[h["path"]][h["offset"] : h["offset"] + h["max"]]
                with self.disk.open("r+b") as f:
                    f.write(data)
                eof = len(data) < h["max"]
                self.send(Kind.DONE, {"id": h["id"], "size": len(data), "eof": eof})


@contextlib.asynccontextmanager
async def connect(tmp: Path, features: list[str]) -> AsyncIterator[tuple[AgentConnection, Guest]]:
    """A host session with a bulk disk in ``tmp``, and the guest that said HELLO."""
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock)
    session = AgentConnection(reader, writer)
    bulk.create(tmp / "bulk")
    session.bulk = BulkDisk(tmp / "bulk")
    guest = Guest(guest_sock, tmp / "bulk")
    guest.send(Kind.HELLO, {"agent_version": "scripted", "features": features})
    await session.wait_hello()
    try:
        yield session, guest
    finally:
        await session.aclose()
        guest_sock.close()


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[AgentConnection, Guest]]:
    async with connect(tmp_path, list(protocol.FEATURES)) as both:
        yield both


def emptied(disk: Path) -> bool:
    """The disk file is its full size and holds no block of the host's disk."""
    st = disk.stat()
    return st.st_size == bulk.SIZE and st.st_blocks == 0


def test_the_disk_file_is_new_private_and_sparse(tmp_path: Path) -> None:
    bulk.create(tmp_path / "bulk")
    st = (tmp_path / "bulk").stat()
    assert st.st_mode & 0o777 == 0o600 and emptied(tmp_path / "bulk")
    with pytest.raises(FileExistsError):  # never one another user made first
        bulk.create(tmp_path / "bulk")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        bulk.create(tmp_path / "link")
    assert not (tmp_path / "elsewhere").exists()


def test_the_qemu_backend_escapes_commas_and_reports_errors() -> None:
    [flag, spec] = bulk.qemu_args(Path("/a,b/bulk"))
    assert flag == "-drive" and spec.startswith("id=bulk,file=/a,,b/bulk,")
    options = spec.split(",")
    assert {"werror=report", "rerror=report", "auto-read-only=off"} <= set(options)


@pytest.mark.parametrize("size", [0, 1, 300_000, bulk.SIZE, bulk.SIZE + 1])
async def test_a_round_trip_crosses_the_disk_in_pieces(
    pair: tuple[AgentConnection, Guest], size: int
) -> None:
    session, guest = pair
    data = os.urandom(size)
    pieces = max(1, -(-size // bulk.SIZE))
    await asyncio.gather(session.put("/w/f", data, 0o600), guest.serve(pieces))
    assert guest.files["/w/f"] == data and emptied(guest.disk)
    puts = [f.header for f in guest.requests]
    assert [h["offset"] for h in puts] == [i * bulk.SIZE for i in range(pieces)]
    assert {(h["path"], h["mode"]) for h in puts} == {("/w/f", 0o600)}
    assert sum(h["size"] for h in puts) == size
    gets = pieces + (size % bulk.SIZE == 0 and size > 0)  # a full last piece: one more says eof
    got, _ = await asyncio.gather(session.get("/w/f"), guest.serve(gets))
    assert got == data and emptied(guest.disk)
    assert all(f.kind in (Kind.BULK_PUT, Kind.BULK_GET) for f in guest.requests)


async def test_a_missing_file_is_typed_and_the_session_goes_on(
    pair: tuple[AgentConnection, Guest],
) -> None:
    session, guest = pair
    getting = asyncio.ensure_future(session.get("/nope"))
    frame = await guest.request()
    guest.send(Kind.FAILED, {"id": frame.header["id"], "code": "not_found", "message": "gone"})
    with pytest.raises(GuestFileNotFound):
        await getting
    assert emptied(guest.disk)
    await asyncio.gather(session.put("/w/g", b"still", 0o644), guest.serve(1))
    assert guest.files["/w/g"] == b"still"


async def test_a_file_past_the_quota_is_quota_exceeded(pair: tuple[AgentConnection, Guest]) -> None:
    session, guest = pair
    guest.files["/big"] = b"x" * 100
    with pytest.raises(QuotaExceeded):
        await asyncio.gather(session.get("/big", max_size=99), guest.serve(1))
    assert guest.requests[-1].header["max"] == 100  # one byte past the quota, no more


@pytest.mark.parametrize(
    ("kind", "answer"),
    [
        (Kind.BULK_PUT, {"size": 4}),  # not what was sent
        (Kind.BULK_GET, {"size": 1 << 30, "eof": True}),  # more than was asked
        (Kind.BULK_GET, {"size": -1, "eof": True}),
        (Kind.BULK_GET, {"size": 3, "eof": False}),  # short, and not the file's end
        (Kind.BULK_GET, {"size": 3, "eof": "yes"}),
        (Kind.BULK_GET, {"eof": True}),
        (Kind.BULK_GET, {"size": 2.5, "eof": True}),
    ],
    ids=["put-size", "past-max", "negative", "short", "eof-text", "no-size", "float"],
)
async def test_a_hostile_answer_breaks_the_channel(
    pair: tuple[AgentConnection, Guest], kind: int, answer: dict[str, Any]
) -> None:
    session, guest = pair
    call = session.put("/w", b"12345") if kind == Kind.BULK_PUT else session.get("/w")
    running = asyncio.ensure_future(call)
    frame = await guest.request()
    assert frame.kind == kind
    guest.send(Kind.DONE, {"id": frame.header["id"], **answer})
    with pytest.raises(ProtocolError):
        await running
    assert emptied(guest.disk)
    with pytest.raises(ProtocolError):  # broken for every later request
        await session.exec(["true"])


async def test_another_frame_in_a_bulk_transfer_breaks_the_channel(
    pair: tuple[AgentConnection, Guest],
) -> None:
    session, guest = pair
    running = asyncio.ensure_future(session.get("/w"))
    frame = await guest.request()
    guest.sock.sendall(encode(Kind.DATA, {"id": frame.header["id"], "offset": 0}, b"x"))
    with pytest.raises(ProtocolError, match="unexpected DATA in a bulk transfer"):
        await running


async def test_a_transfer_left_unfinished_retires_the_disk(
    pair: tuple[AgentConnection, Guest],
) -> None:
    """The guest may still be copying the abandoned piece: the next put takes the channel
    (UPLOAD and DATA frames), and a put that waited for the disk meanwhile does too."""
    session, guest = pair
    abandoned = asyncio.ensure_future(session.put("/w/a", b"a" * 10))
    assert (await guest.request()).kind == Kind.BULK_PUT
    waiting = asyncio.ensure_future(session.put("/w/b", b"b"))
    await asyncio.sleep(0.05)
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    assert session.bulk is not None and session.bulk.retired and emptied(guest.disk)
    frame = await guest.request()
    assert frame.kind == Kind.UPLOAD and frame.header["path"] == "/w/b"
    upload_id = frame.header["id"]
    while not (await guest.request()).header.get("eof"):  # its DATA frames
        pass
    guest.send(Kind.DONE, {"id": upload_id, "size": 1})
    await waiting


async def test_a_failure_of_the_hosts_file_retires_the_disk_and_takes_the_channel(
    pair: tuple[AgentConnection, Guest],
) -> None:
    """A full host disk (ENOSPC) or the file gone: the same transfer starts again over the
    channel, and so do the next ones; nothing is lost, no untyped error reaches the caller."""
    session, guest = pair
    guest.disk.rename(guest.disk.with_suffix(".away"))
    putting = asyncio.ensure_future(session.put("/w/c", b"abc"))
    frame = await guest.request()
    assert frame.kind == Kind.UPLOAD and frame.header["path"] == "/w/c"
    while not (await guest.request()).header.get("eof"):  # its DATA frames
        pass
    guest.send(Kind.DONE, {"id": frame.header["id"], "size": 3})
    await putting
    assert session.bulk is not None and "host's side failed" in (session.bulk.retired or "")
    getting = asyncio.ensure_future(session.get("/w/c"))
    assert (await guest.request()).kind == Kind.DOWNLOAD
    getting.cancel()


async def test_an_agent_without_bulk_takes_the_channel(tmp_path: Path) -> None:
    features = [f for f in protocol.FEATURES if f != "bulk"]
    async with connect(tmp_path, features) as (session, guest):
        getting = asyncio.ensure_future(session.get("/f"))
        frame = await guest.request()
        assert frame.kind == Kind.DOWNLOAD
        guest.send(Kind.DONE, {"id": frame.header["id"], "size": 0})
        assert await getting == b""
