"""The bulk disk: a file's bytes between host and guest through a raw disk, not the channel.

Over the agent channel (virtio-console) a host -> guest byte crosses in 4 KiB trips (QEMU's
socket chardev reads 4 KiB at a time, the guest's port buffers are a page each): under TCG
1 MiB each way takes ~15-20 ms. A disk moves it with a few DMA requests. The qemu driver gives
each VM a sparse file of ``SIZE`` bytes as a second virtio-blk disk (serial ``SERIAL``); an
agent that found it lists "bulk" in HELLO's features (``native/bulk.c``).

A put writes a piece of the data (at most ``SIZE`` bytes) at the file's start, then BULK_PUT
``{id, path, mode, offset, size}`` has the agent copy it into the guest file at ``offset``
(offset 0: created or truncated): DONE ``{size: offset + size}``. A get sends BULK_GET
``{id, path, offset, max}``; the agent copies up to ``max`` bytes of the file there and answers
DONE ``{size, eof}``; the host reads that many. One transfer at a time per disk (a lock); after
each the file is emptied (truncated to 0, then to ``SIZE``), so an idle VM holds none of the
host's disk and a VM never holds more than ``SIZE`` of it.

The guest is distrusted as on the channel: a DONE with another size, more than was asked, no
progress before its end, or any other frame is its ``ProtocolError`` (the channel breaks); a
missing file is ``GuestFileNotFound``. The bytes it leaves on the disk are only ever taken as
its file's content, as a stream's chunks are. A transfer left unfinished (cancelled) retires
the disk for the rest of the connection: the guest may still be copying, and the next transfer
must not meet its bytes; the channel's streams carry the rest. So does a failure of the host's
side of the disk (a full disk, the file gone): that transfer starts again on the channel.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from cleanroom.agent import protocol
from cleanroom.agent.channel import Channel
from cleanroom.agent.protocol import Frame, Kind
from cleanroom.agent.transfers import failure, violation
from cleanroom.errors import QuotaExceeded

T = TypeVar("T")

SIZE = 8 * 1024 * 1024
"""Bytes of each VM's bulk disk: the largest piece one request moves (a put or get of more
takes several)."""
SERIAL = "cr-bulk"
"""The disk's virtio-blk serial, by which the agent finds it (``native/bulk.h``)."""
THREAD_AT = 1024 * 1024
"""Pieces larger than this are read or written on the host in a worker thread."""


def file_in(run_dir: Path) -> Path:
    """Where a VM's disk file is: in its run folder (so it goes with the env)."""
    return run_dir / "bulk"


def create(path: Path) -> None:
    """Make the sparse disk file (new, private, not through a link)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, SIZE)
    finally:
        os.close(fd)


def qemu_args(path: Path) -> list[str]:
    """The disk's backend (its device is in ``machine_args``, the same for every VM): a host
    error is the guest's I/O error, never a paused VM; ``auto-read-only=off`` keeps QEMU from
    reopening the file by name when a snapshot's save drops its writers (a jailed QEMU is in an
    empty chroot by then: the save would fail)."""
    file = str(path).replace(",", ",,")
    return [
        "-drive",
        f"id=bulk,file={file},format=raw,if=none,cache=writeback,werror=report,rerror=report,"
        "auto-read-only=off",
    ]


DEVICE = ["-device", f"virtio-blk-device,drive=bulk,serial={SERIAL}"]
"""The disk as the guest sees it (in every VM's devices, so a template's and its clones')."""


class BulkDisk:
    """One VM's bulk disk, as its host connection uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = asyncio.Lock()
        self.retired: str | None = None  # why it is no longer used (the module docstring)

    def usable(self, channel: Channel) -> bool:
        """Does this agent serve it, and is it not retired?"""
        return self.retired is None and "bulk" in channel.features

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    async def put(self, channel: Channel, path: str, data: bytes, mode: int) -> bool:
        """Write ``data`` to ``path`` in the guest, a disk-sized piece per request (False: the
        disk is retired, now or while this waited for it; the caller takes the channel)."""
        done = await self._held(functools.partial(self._put, channel, path, data, mode))
        return done is not None

    async def get(self, channel: Channel, path: str, max_size: int) -> bytes | None:
        """The whole file at ``path``; ``QuotaExceeded`` once it passes ``max_size`` bytes
        (None: the disk is retired, now or while this waited for it)."""
        return await self._held(functools.partial(self._get, channel, path, max_size))

    async def _held(self, transfer: Callable[[], Awaitable[T]]) -> T | None:
        """``transfer()`` holding the disk; None if it is retired, now or while this waited,
        or once its host's side fails (the caller takes the channel)."""
        async with self.lock:
            if self.retired is not None:
                return None
            try:
                return await transfer()
            except OSError as exc:  # only the host's file: the channel's errors are typed
                self.retired = f"the host's side failed: {exc}"
                return None

    async def _put(self, channel: Channel, path: str, data: bytes, mode: int) -> bool:
        fd = self._open()
        try:
            offset = 0
            while True:
                piece = memoryview(data)[offset : offset + SIZE]
                await _run(len(piece), functools.partial(_write_all, fd, piece))
                header = {"path": path, "mode": mode, "offset": offset, "size": len(piece)}
                answer = await self._request(channel, Kind.BULK_PUT, header)
                offset += len(piece)
                if answer.header.get("size") != offset:
                    raise violation(channel, f"bulk put of {path}: DONE does not say {offset}")
                if offset >= len(data):
                    return True
        finally:
            _empty(fd)

    async def _get(self, channel: Channel, path: str, max_size: int) -> bytes:
        pieces: list[bytes] = []
        size = 0
        fd = self._open()
        try:
            while True:
                want = min(SIZE, max_size + 1 - size)  # one byte past the quota tells
                header = {"path": path, "offset": size, "max": want}
                answer = await self._request(channel, Kind.BULK_GET, header)
                got, eof = answer.header.get("size"), answer.header.get("eof")
                if not (isinstance(got, int) and 0 <= got <= want and isinstance(eof, bool)):
                    raise violation(channel, f"bulk get of {path}: a DONE of {got!r} bytes")
                if not eof and got < want:
                    raise violation(channel, f"bulk get of {path}: {got} bytes, not its end")
                if got:
                    pieces.append(await _run(got, functools.partial(_read_all, fd, got)))
                size += got
                if size > max_size:
                    raise QuotaExceeded(f"{path} is larger than {max_size} bytes")
                if eof:
                    return b"".join(pieces)
        finally:
            _empty(fd)

    async def _request(self, channel: Channel, kind: int, header: dict[str, object]) -> Frame:
        """One BULK_* request and its DONE (FAILED: the typed error). Left unfinished, it
        retires the disk (the module docstring)."""
        rid, inbox = channel.open(hard=64 * 1024)
        finished = False
        try:
            await channel.send(kind, {"id": rid, **header})
            frame = await channel.take(inbox)
            finished = frame.kind in (Kind.DONE, Kind.FAILED)
            if frame.kind == Kind.FAILED:
                raise failure(frame.header)
            if not finished:
                name = protocol.kind_name(frame.kind)
                raise violation(channel, f"unexpected {name} in a bulk transfer")
            return frame
        finally:
            if not finished:
                self.retired = "a transfer was left unfinished"
            channel.close(rid, finished=finished)


def _write_all(fd: int, data: memoryview) -> None:
    """``data`` at the disk's start."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


def _read_all(fd: int, size: int) -> bytes:
    """The disk's first ``size`` bytes (it is ``SIZE`` long: never fewer)."""
    data = os.pread(fd, size, 0)
    if len(data) != size:
        raise OSError(f"the bulk disk gave {len(data)} of {size} bytes")
    return data


async def _run(size: int, call: Callable[[], T]) -> T:
    """``call()``, in a worker thread when it moves more than ``THREAD_AT`` bytes."""
    return await asyncio.to_thread(call) if size > THREAD_AT else call()


def _empty(fd: int) -> None:
    """Give the disk's blocks back to the host (it reads as zeros), then close it."""
    try:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, SIZE)
    except OSError:
        pass  # its blocks stay until the env's run folder goes; the transfer itself is done
    finally:
        os.close(fd)
