"""A small async QMP client: greeting, ``qmp_capabilities``, ``execute``, events.

QEMU's machine protocol is JSON lines over a monitor socket: the qemu driver gives every VM one
end of a socket pair (``QmpClient.over``; no path, so a home of any length works);
``QmpClient.connect`` waits (bounded) for a listening socket at a path. Both read the greeting
and negotiate capabilities; ``execute`` sends one command with an ``id`` and waits
(bounded) for its answer; asynchronous events are kept in order for ``wait_event``. Every
failure is a ``DriverError`` (a refused command names the command and QEMU's message).

``script`` + ``read_answers`` skip the round trips: a monitor runs its commands in order, so
a whole script can be written to its socket before QEMU has even started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cleanroom.errors import DriverError

DEFAULT_TIMEOUT_S = 10.0
MAX_LINE = 1 << 20


class QmpClient:
    """One QMP connection: ``await QmpClient.over(sock)`` or ``.connect(path)``; ``aclose()``
    is idempotent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._event_added = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self.greeting: dict[str, Any] = {}

    @classmethod
    async def connect(cls, path: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> QmpClient:
        """Connect (retrying until the socket accepts), read the greeting, negotiate."""
        end = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_LINE)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > end:
                    raise DriverError(
                        f"QMP socket {path} not ready within {timeout_s:.1f}s"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)
        return await cls._negotiate(reader, writer, max(end - time.monotonic(), 0.1))

    @classmethod
    async def over(cls, sock: socket.socket, timeout_s: float = DEFAULT_TIMEOUT_S) -> QmpClient:
        """A client over a connected monitor socket (the client owns it from here on)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE)
        return await cls._negotiate(reader, writer, timeout_s)

    @classmethod
    async def _negotiate(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, remaining: float
    ) -> QmpClient:
        """Read the greeting and negotiate capabilities within ``remaining`` seconds each."""
        client = cls(reader, writer)
        try:
            greeting = await asyncio.wait_for(client._read_message(), remaining)
            if "QMP" not in greeting:
                raise DriverError(f"not a QMP greeting: {str(greeting)[:200]}")
            client.greeting = greeting["QMP"]
            client._pump = asyncio.create_task(client._read_loop())
            await client.execute("qmp_capabilities", timeout_s=remaining)
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _read_message(self) -> dict[str, Any]:
        return await _read_message(self._reader)

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await self._read_message()
                if "event" in message:
                    self._events.append(message)
                    self._event_added.set()
                    continue
                future = self._pending.pop(message.get("id", -1), None)
                if future is not None and not future.done():
                    future.set_result(message)
        except (Exception, asyncio.CancelledError) as exc:
            self._failure = exc
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(DriverError(f"QMP channel ended: {exc}"))
            self._pending.clear()
            self._event_added.set()
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def send_fd(self, name: str, fd: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Hand QEMU a file descriptor under ``name`` (``getfd`` with SCM_RIGHTS).

        QEMU 7.2 takes an outgoing migration's ``fd:<name>`` only from fds passed this way.
        """
        await self.execute("getfd", {"fdname": name}, timeout_s=timeout_s, fd=fd)

    async def execute(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fd: int | None = None,
    ) -> Any:
        """Run one command; return its ``return`` value or raise DriverError.

        With ``fd``, the command goes out in one ``sendmsg`` carrying the descriptor.
        """
        if self._failure is not None:
            raise DriverError(f"QMP channel ended: {self._failure}")
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        request: dict[str, Any] = {"execute": command, "id": ident}
        if arguments:
            request["arguments"] = arguments
        data = json.dumps(request).encode() + b"\n"
        try:
            if fd is None:
                self._writer.write(data)
                await self._writer.drain()
            else:
                self._send_with_fd(data, fd)
            reply = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise DriverError(f"QMP {command}: no answer within {timeout_s:.1f}s") from None
        except (ConnectionError, OSError) as exc:
            raise DriverError(f"QMP {command}: channel failed: {exc}") from exc
        finally:
            self._pending.pop(ident, None)
        _check(command, reply)
        return reply.get("return")

    def _send_with_fd(self, data: bytes, fd: int) -> None:
        """One sendmsg with SCM_RIGHTS, on a duplicate of the connection's socket (the
        transport's own buffer is empty: every ``execute`` drains before it returns)."""
        raw = self._writer.get_extra_info("socket")
        if raw is None or self._writer.transport.get_write_buffer_size():
            raise DriverError("QMP: cannot pass a file descriptor on this connection")
        with socket.socket(fileno=os.dup(raw.fileno())) as sock:
            sent = socket.send_fds(sock, [data], [fd])
        if sent != len(data):
            raise DriverError(f"QMP: short send while passing a descriptor ({sent} bytes)")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """Events received so far (optionally only those called ``name``), oldest first."""
        return [e for e in self._events if name is None or e.get("event") == name]

    async def wait_event(
        self,
        name: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        match: Callable[[dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """The first event called ``name`` whose ``data`` passes ``match`` (already received
        or arriving within the timeout)."""
        end = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.events(name) if match is None or match(e.get("data") or {})]
            if found:
                return found[0]
            if self._failure is not None:
                raise DriverError(f"QMP channel ended before event {name}: {self._failure}")
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise DriverError(f"no QMP event {name} within {timeout_s:.1f}s")
            self._event_added.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_added.wait(), remaining)

    async def aclose(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump
            self._pump = None
        self._writer.close()
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)

    async def __aenter__(self) -> QmpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    try:
        line = await reader.readline()
    except (ConnectionError, OSError, ValueError) as exc:
        raise DriverError(f"QMP channel failed: {exc}") from exc
    if not line:
        raise DriverError("QMP channel closed")
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise DriverError(f"QMP sent invalid JSON: {line[:200]!r}") from exc
    if not isinstance(message, dict):
        raise DriverError(f"QMP sent a non-object: {line[:200]!r}")
    return message


def _check(command: str, reply: dict[str, Any]) -> None:
    if "error" in reply:
        error = reply["error"]
        detail = error.get("desc", error) if isinstance(error, dict) else error
        raise DriverError(f"QMP {command} refused: {detail}")


def script(*commands: tuple[str, dict[str, Any] | None]) -> bytes:
    """``qmp_capabilities``, then ``commands`` ((name, arguments) pairs), as one write."""
    return b"".join(_line(n, a) for n, a in (("qmp_capabilities", None), *commands))


def _line(name: str, arguments: dict[str, Any] | None) -> bytes:
    """One command as the monitor reads it."""
    message = {"execute": name, **({"arguments": arguments} if arguments else {})}
    return json.dumps(message).encode() + b"\n"


async def read_answers(reader: asyncio.StreamReader, commands: tuple[str, ...]) -> None:
    """Read a monitor's answers to a ``script`` of ``commands`` (greeting and events skipped);
    DriverError naming the first command it refused, or if it closes before answering all."""
    for name in ("qmp_capabilities", *commands):
        await _answer(reader, name)


async def command(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    name: str,
    arguments: dict[str, Any] | None = None,
) -> None:
    """Send one command on a monitor past its ``script`` and read its answer (events skipped);
    DriverError if it is refused or the monitor closes."""
    writer.write(_line(name, arguments))
    await _answer(reader, name)


async def _answer(reader: asyncio.StreamReader, name: str) -> None:
    """Read up to the answer to ``name`` (events skipped); DriverError if it was refused."""
    while True:
        message = await _read_message(reader)
        _check(name, message)
        if "return" in message:
            return
