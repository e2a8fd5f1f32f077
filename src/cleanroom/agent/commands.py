"""Commands in a multiplexing guest: ``spawn`` a process, feed its stdin, kill it, wait for it.

One EXEC request per process (``{id, argv, env, cwd, timeout_s, user, stdin, pty}``); the guest
answers STARTED (or FAILED: an unknown user), then its STDOUT/STDERR as they come, EXIT and
DONE. A pump task per process takes those frames off its inbox and hands the output to the
callbacks while the caller does other things; ``wait`` returns the ``ExecResult``. Leaving a
process unwaited is allowed: closing the connection ends it with the env.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypedDict, Unpack

from cleanroom.agent import protocol
from cleanroom.agent.channel import Channel, Inbox
from cleanroom.agent.protocol import Kind
from cleanroom.agent.results import ExecResult, Output, OutputCallback
from cleanroom.agent.transfers import failure, send_window
from cleanroom.errors import CleanroomError, ProtocolError

MAX_OUTPUT = 16 * 1024 * 1024  # a command's stdout + stderr kept, unless it says otherwise


class CommandOptions(TypedDict, total=False):
    """What a command takes besides its argv, for every layer that passes them on (``Env``,
    ``AgentConnection``); ``spawn`` holds the defaults: no limit, the agent's env and cwd, root,
    no callbacks, ``MAX_OUTPUT``."""

    timeout_s: float | None
    env: dict[str, str] | None
    cwd: str | None
    user: str | None
    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    max_output: int


class SpawnOptions(CommandOptions, total=False):
    """A background process's options: a command's, and ``pty=(rows, cols)``."""

    pty: tuple[int, int] | None


class GuestProcess:
    """A process running in the guest (``AgentConnection.spawn``); ``id`` is its request id."""

    def __init__(self, channel: Channel, rid: int, inbox: Inbox, output: Output) -> None:
        self.channel = channel
        self.id = rid
        self.pid: int | None = None  # its pid in the guest (STARTED)
        self._inbox = inbox
        self._output = output
        self._stdin_sent = 0
        self._stdin_acked = 0
        self._stdin_closed = False
        self._acked = asyncio.Condition()
        self._pump: asyncio.Task[ExecResult] | None = None

    async def _started(self) -> None:
        """Wait for STARTED (FAILED: the typed error), then pump the rest in the background."""
        frame = await self.channel.take(self._inbox)
        if frame.kind == Kind.FAILED:
            self.channel.close(self.id, finished=True)
            raise failure(frame.header)
        if frame.kind != Kind.STARTED:
            raise self._violation(f"expected STARTED, got {protocol.kind_name(frame.kind)}")
        pid = frame.header.get("pid")
        self.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        self._pump = asyncio.get_running_loop().create_task(self._run())
        self._pump.add_done_callback(_retrieve)

    async def _run(self) -> ExecResult:
        result: ExecResult | None = None
        finished = False
        try:
            while True:
                frame = await self.channel.take(self._inbox)
                if frame.kind in (Kind.STDOUT, Kind.STDERR):
                    await self._output.add(frame.kind, frame.body)
                elif frame.kind == Kind.ACK:
                    await self._ack(frame.header.get("size"))
                elif frame.kind == Kind.EXIT and result is None:
                    result = self._output.result(frame.header)
                elif frame.kind == Kind.FAILED:
                    finished = True
                    raise failure(frame.header)
                elif frame.kind == Kind.DONE:
                    finished = True
                    if result is None:
                        raise self._violation("a command ended without an EXIT frame")
                    return result
                else:
                    name = protocol.kind_name(frame.kind)
                    raise self._violation(f"unexpected {name} during a command")
        except CleanroomError:
            self.channel.send_nowait(Kind.KILL, {"id": self.id})
            raise
        finally:
            self.channel.close(self.id, finished=finished)
            async with self._acked:
                self._stdin_closed = True
                self._acked.notify_all()

    def _violation(self, message: str) -> ProtocolError:
        exc = ProtocolError(message)
        self.channel.break_with(exc)
        return exc

    async def _ack(self, size: Any) -> None:
        if not isinstance(size, int) or not self._stdin_acked <= size <= self._stdin_sent:
            raise self._violation("the guest acknowledged stdin it was never sent")
        async with self._acked:
            self._stdin_acked = size
            self._acked.notify_all()

    async def write_stdin(self, data: bytes) -> None:
        """Send ``data`` to the process's stdin (flow-controlled: at most ``WINDOW`` unwritten)."""
        for offset in range(0, len(data), protocol.CHUNK):
            chunk = data[offset : offset + protocol.CHUNK]
            size = len(chunk)

            def writable(size: int = size) -> bool:
                return self._stdin_closed or send_window(self._stdin_sent, self._stdin_acked, size)

            async with self._acked:
                await self._acked.wait_for(writable)
                if self._stdin_closed:
                    return  # the process is gone: like a write to a closed pipe, dropped
                self._stdin_sent += len(chunk)
            await self.channel.send(Kind.STDIN, {"id": self.id, "eof": False}, chunk)

    async def close_stdin(self) -> None:
        """End of file on the process's stdin."""
        if not self._stdin_closed:
            await self.channel.send(Kind.STDIN, {"id": self.id, "eof": True})

    async def kill(self) -> None:
        """SIGKILL the process's whole process group (``wait`` then reports the signal)."""
        if self._pump is not None and not self._pump.done():
            await self.channel.send(Kind.KILL, {"id": self.id})

    async def resize(self, rows: int, cols: int) -> None:
        """The window size of a PTY process (ignored for one without a PTY)."""
        await self.channel.send(Kind.RESIZE, {"id": self.id, "rows": rows, "cols": cols})

    async def wait(self) -> ExecResult:
        """Its result once it exited (and its output was relayed)."""
        assert self._pump is not None, "wait() before the process started"
        return await asyncio.shield(self._pump)

    @property
    def done(self) -> bool:
        return self._pump is not None and self._pump.done()


def _retrieve(task: asyncio.Task[ExecResult]) -> None:
    """A process nobody waits for must not log "exception never retrieved"."""
    if not task.cancelled():
        task.exception()


async def spawn(
    channel: Channel,
    argv: list[str],
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    stdin: bool = True,
    pty: tuple[int, int] | None = None,
    on_stdout: OutputCallback | None = None,
    on_stderr: OutputCallback | None = None,
    max_output: int = MAX_OUTPUT,
) -> GuestProcess:
    """Start ``argv`` in the guest and return once it runs (see the module docstring)."""
    channel.require("spawn", "spawn")
    if pty is not None:
        channel.require("pty", "a PTY")
    rid, inbox = channel.open()
    header = {
        "id": rid, "argv": list(argv), "timeout_s": timeout_s, "env": env, "cwd": cwd,
        "user": user, "stdin": stdin, "pty": list(pty) if pty is not None else None,
    }  # fmt: skip
    process = GuestProcess(channel, rid, inbox, Output(max_output, on_stdout, on_stderr))
    try:
        await channel.send(Kind.EXEC, header)
        await process._started()
    except BaseException:
        if process._pump is None:
            channel.send_nowait(Kind.KILL, {"id": rid})
            channel.close(rid, finished=False)
        raise
    return process


async def run(
    channel: Channel,
    argv: list[str],
    *,
    stdin: bytes | None = None,
    **options: Unpack[CommandOptions],
) -> ExecResult:
    """``spawn``, feed ``stdin`` (if any) and close it, and wait; cancelled, the process dies."""
    process = await spawn(channel, argv, stdin=stdin is not None, **options)
    try:
        if stdin is not None:
            await process.write_stdin(stdin)
            await process.close_stdin()
        return await process.wait()
    finally:
        if not process.done:
            with contextlib.suppress(CleanroomError):
                channel.send_nowait(Kind.KILL, {"id": process.id})
