"""Streams of any size between host and guest: files and tar archives of folders, both ways.

``put_stream``: UPLOAD ``{id, path, mode, tar}``, then DATA frames (at most ``CHUNK`` each, at
most ``WINDOW`` bytes beyond the guest's last ACK), the last with ``eof``; the guest answers
DONE ``{id, size}`` (or FAILED). ``get_stream``: DOWNLOAD ``{id, path, tar}``; the guest sends
DATA frames in order within the window the host's ACKs open, then DONE. With ``tar`` the guest
packs or safely unpacks a folder (``native/tar.c``: no member outside it, no device nodes, links
kept inside). The guest is held to the protocol: a chunk out of order, larger than ``CHUNK``
or past the window is its ``ProtocolError`` (the channel breaks; the caller destroys the env);
a missing file is ``GuestFileNotFound``, and the env stays usable.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from cleanroom.agent import protocol, wire
from cleanroom.agent.channel import Channel
from cleanroom.agent.protocol import CHUNK, WINDOW, Frame, Kind
from cleanroom.errors import (
    GuestFileNotFound,
    GuestOperationError,
    GuestUnsafePath,
    ProtocolError,
    QuotaExceeded,
    UnknownUser,
)

FAILURES: dict[str, type[GuestOperationError]] = {
    "not_found": GuestFileNotFound,
    "unknown_user": UnknownUser,
    "unsafe_path": GuestUnsafePath,
}
"""FAILED ``code`` -> the error the host raises (any other code: ``GuestOperationError``)."""


def failure(header: dict[str, Any]) -> GuestOperationError:
    """The typed error a FAILED frame stands for (the guest's words made safe to show)."""
    code = header.get("code")
    kind = FAILURES.get(code, GuestOperationError) if isinstance(code, str) else GuestOperationError
    return kind(f"in the guest: {wire.guest_text(header.get('message'))}")


def send_window(sent: int, acked: int, size: int) -> bool:
    """May ``size`` more bytes go out, with ``sent`` sent and ``acked`` acknowledged?"""
    return sent - acked + size <= WINDOW or sent == acked


async def chunks_of(data: bytes) -> AsyncIterator[bytes]:
    """``data`` as an async stream of ``CHUNK``-sized pieces (one empty piece if empty)."""
    for offset in range(0, max(len(data), 1), CHUNK):
        yield data[offset : offset + CHUNK]


def violation(channel: Channel, message: str) -> ProtocolError:
    """The guest broke the protocol: the channel breaks with this error (returned to raise)."""
    exc = ProtocolError(message)
    channel.break_with(exc)
    return exc


async def put_stream(
    channel: Channel,
    path: str,
    chunks: AsyncIterable[bytes],
    mode: int = 0o644,
    *,
    tar: bool = False,
) -> int:
    """Write the stream to ``path`` (with ``tar``: unpack it into the folder ``path``);
    returns how many bytes were sent."""
    channel.require("tar" if tar else "stream", "a tar upload" if tar else "a streamed upload")
    channel = channel
    rid, inbox = channel.open(hard=64 * 1024)
    finished = False
    sent = acked = 0

    async def answer(expect_done: bool) -> Frame:
        nonlocal acked, finished
        frame = await channel.take(inbox)
        if frame.kind == Kind.ACK:
            size = frame.header.get("size")
            if not isinstance(size, int) or not acked <= size <= sent:
                raise violation(channel, f"upload {rid}: ACK of bytes never sent")
            acked = size
        elif frame.kind == Kind.FAILED:
            finished = True
            raise failure(frame.header)
        elif frame.kind == Kind.DONE and expect_done:
            finished = True
        else:
            raise violation(channel, f"unexpected {protocol.kind_name(frame.kind)} in an upload")
        return frame

    try:
        await channel.send(Kind.UPLOAD, {"id": rid, "path": path, "mode": mode, "tar": tar})
        async for data in chunks:
            for offset in range(0, len(data), CHUNK):
                chunk = bytes(data[offset : offset + CHUNK])
                while not send_window(sent, acked, len(chunk)):
                    await answer(expect_done=False)
                await channel.send(Kind.DATA, {"id": rid, "offset": sent, "eof": False}, chunk)
                sent += len(chunk)
        await channel.send(Kind.DATA, {"id": rid, "offset": sent, "eof": True})
        while not finished:
            frame = await answer(expect_done=True)
        if frame.header.get("size") != sent:
            raise violation(channel, f"upload of {path}: the guest's DONE does not say {sent}")
        return sent
    finally:
        if not finished:
            channel.send_nowait(Kind.KILL, {"id": rid})
        channel.close(rid, finished=finished)


async def get_stream(channel: Channel, path: str, *, tar: bool = False) -> AsyncIterator[bytes]:
    """The file at ``path`` (with ``tar``: the folder as a tar archive), chunk by chunk; the
    next chunks are asked for (ACK) as the caller takes these. Leaving early stops the guest."""
    channel.require("tar" if tar else "stream", "a tar download" if tar else "a stream")
    channel = channel
    rid, inbox = channel.open(hard=WINDOW + 64 * 1024)
    finished = False
    received = 0
    try:
        await channel.send(Kind.DOWNLOAD, {"id": rid, "path": path, "tar": tar})
        while True:
            frame = await channel.take(inbox)
            if frame.kind == Kind.FAILED:
                finished = True
                raise failure(frame.header)
            if frame.kind == Kind.DONE:
                finished = True
                return
            if frame.kind != Kind.DATA:
                name = protocol.kind_name(frame.kind)
                raise violation(channel, f"unexpected {name} in a download")
            _check_chunk(channel, frame, received)
            received += len(frame.body)
            if frame.body:
                yield frame.body
                await channel.send(Kind.ACK, {"id": rid, "size": received})
    finally:
        if not finished:
            channel.send_nowait(Kind.KILL, {"id": rid})
        channel.close(rid, finished=finished)


def _check_chunk(channel: Channel, frame: Frame, received: int) -> None:
    if frame.header.get("offset") != received:
        raise violation(channel, "a stream chunk out of order")
    if len(frame.body) > CHUNK:
        raise violation(channel, f"a stream chunk of {len(frame.body)} bytes (at most {CHUNK})")


async def get_all(channel: Channel, path: str, max_size: int) -> bytes:
    """The whole file at ``path``; ``QuotaExceeded`` once it passes ``max_size`` bytes.
    The chunks are joined once at the end (one copy of the file, not a growing buffer's)."""
    chunks: list[bytes] = []
    size = 0
    stream = get_stream(channel, path)
    try:
        async for chunk in stream:
            size += len(chunk)
            if size > max_size:
                raise QuotaExceeded(f"{path} is larger than {max_size} bytes")
            chunks.append(chunk)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return b"".join(chunks)
