"""A TCP connection to a port of the guest, over the agent channel (HELLO ``features`` has
"port"; ``native/mux.c``, ``native/port.h``): no NIC, the guest dials only its own 127.0.0.1.

CONNECT ``{id, port}``; the guest answers STARTED ``{port}`` once connected, or FAILED (``code``
"refused": nothing listens there, "timeout", "busy", ...: ``PortUnreachable``). Then bytes go
both ways as DATA frames of at most ``CHUNK``, each side within ``WINDOW`` of the other's ACK;
the host's DATA with ``eof`` shuts the guest socket's sending half. The guest's DONE ``{size,
received, stopped}`` ends the connection (its end closed, or the host's KILL). One task per
connection (``_pump``) takes the guest's frames, so a reader and a writer can run at once. The
guest is held to the protocol as in ``transfers``: a chunk out of order, too large or past the
window, an ACK of bytes never sent, is its ``ProtocolError``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from cleanroom.agent import protocol
from cleanroom.agent.channel import Channel, Inbox
from cleanroom.agent.protocol import CHUNK, WINDOW, Kind
from cleanroom.agent.transfers import failure, send_window, violation
from cleanroom.errors import PortUnreachable


class PortStream:
    """One open connection to a guest port: ``read`` / ``write`` / ``write_eof`` / ``aclose``."""

    def __init__(self, channel: Channel, rid: int, inbox: Inbox, port: int) -> None:
        self.channel, self.rid, self.port = channel, rid, port
        self._inbox = inbox
        self.sent = 0  # bytes written to the guest
        self.acked = 0  # of them, taken by the guest
        self.received = 0  # bytes read from the guest
        self.done = False  # the guest's DONE (or FAILED) came
        self._chunks: collections.deque[bytes] = collections.deque()
        self._moved = asyncio.Event()  # a chunk, an ACK, the end, or an error
        self._error: BaseException | None = None
        self._eof_sent = False
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        expected = 0
        try:
            while True:
                frame = await self.channel.take(self._inbox)
                if frame.kind == Kind.ACK:
                    size = frame.header.get("size")
                    if not isinstance(size, int) or not self.acked <= size <= self.sent:
                        raise violation(self.channel, f"port {self.port}: ACK of bytes never sent")
                    self.acked = size
                elif frame.kind == Kind.DATA:
                    if frame.header.get("offset") != expected or len(frame.body) > CHUNK:
                        raise violation(self.channel, f"port {self.port}: a chunk out of order")
                    expected += len(frame.body)
                    if expected - self.received > WINDOW:
                        raise violation(self.channel, f"port {self.port}: past the window")
                    if frame.body:
                        self._chunks.append(frame.body)
                elif frame.kind == Kind.DONE:
                    if frame.header.get("size") != expected:
                        raise violation(self.channel, f"port {self.port}: DONE's size is wrong")
                    self.done = True
                    return
                elif frame.kind == Kind.FAILED:
                    self.done = True
                    raise failure(frame.header)
                else:
                    name = protocol.kind_name(frame.kind)
                    raise violation(self.channel, f"unexpected {name} on port {self.port}")
                self._moved.set()
        except BaseException as exc:
            self._error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self._moved.set()

    async def _wait(self) -> None:
        self._moved.clear()
        await self._moved.wait()

    async def read(self) -> bytes:
        """The next bytes the guest's end sent; ``b""`` once it closed."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.done:
                return b""
            await self._wait()
        chunk = self._chunks.popleft()
        self.received += len(chunk)
        await self.channel.send(Kind.ACK, {"id": self.rid, "size": self.received})
        return chunk

    async def write(self, data: bytes) -> None:
        """``data`` to the guest's end, within the window (waits for its ACKs)."""
        for offset in range(0, len(data), CHUNK):
            chunk = bytes(data[offset : offset + CHUNK])
            while not send_window(self.sent, self.acked, len(chunk)):
                if self._error is not None:
                    raise self._error
                if self.done:
                    return  # the guest's end closed: nobody reads it
                await self._wait()
            if self.done:
                return
            header: dict[str, object] = {"id": self.rid, "offset": self.sent, "eof": False}
            await self.channel.send(Kind.DATA, header, chunk)
            self.sent += len(chunk)

    async def write_eof(self) -> None:
        """No more bytes from the host: the guest socket's sending half is shut."""
        if not self._eof_sent and not self.done:
            self._eof_sent = True
            await self.channel.send(Kind.DATA, {"id": self.rid, "offset": self.sent, "eof": True})

    async def aclose(self) -> None:
        """End the connection (KILL unless the guest already ended it); idempotent."""
        if not self.done:
            self.channel.send_nowait(Kind.KILL, {"id": self.rid})
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.channel.close(self.rid, finished=self.done)


async def connect(channel: Channel, port: int) -> PortStream:
    """A connection to ``127.0.0.1:port`` in the guest (``PortUnreachable`` if it refused)."""
    channel.require("port", "a connection to a guest port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port {port!r} is not 1..65535")
    rid, inbox = channel.open(hard=WINDOW + 64 * 1024)
    stream = PortStream(channel, rid, inbox, port)
    opened = False
    try:
        await channel.send(Kind.CONNECT, {"id": rid, "port": port})
        frame = await channel.take(inbox)
        if frame.kind == Kind.FAILED:
            stream.done = True
            err = failure(frame.header)
            raise PortUnreachable(f"port {port}: {err}") from None
        if frame.kind != Kind.STARTED:
            name = protocol.kind_name(frame.kind)
            raise violation(channel, f"unexpected {name} answering CONNECT")
        stream._start()
        opened = True
        return stream
    finally:
        if not opened:
            if not stream.done:
                channel.send_nowait(Kind.KILL, {"id": rid})
            channel.close(rid, finished=stream.done)
