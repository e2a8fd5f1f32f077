"""envd's ``process.Process`` service (Connect RPC) on a sandbox's session.

``Start`` runs ``cmd args`` through ``sb.commands.run(..., background=True)`` (a transcript
step like any session command) and streams its events: ``start`` (its pid), ``data``
(stdout / stderr as they come), ``end`` (exit code). The stream's deadline (the SDK's command
``timeout``, sent as ``connect-timeout-ms``) kills the process; a client that disconnects
leaves it running (E2B's semantics: ``Connect`` by pid streams it again). ``List``,
``SendInput`` / ``StreamInput`` / ``CloseStdin``, ``SendSignal`` (SIGKILL and SIGTERM both kill
its process group) work on the sandbox's process table. A PTY (``pty``: its output as
``pty`` data, input by ``SendInput``'s ``pty``, ``Update`` resizes it) is spawned on the
session's env as ``cleanroom shell`` spawns one (``_spawn_pty``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from cleanroom.agent.commands import GuestProcess
from cleanroom.errors import CleanroomError, GuestOperationError, SessionClosed
from cleanroom.server.control import Process, Sandbox, Sandboxes, ServerError
from cleanroom.server.envd.routing import sandbox_of, user_of
from cleanroom.sessions import CommandHandle

Ctx = RequestContext[Any, Any]


def _header(ctx: Ctx) -> Any:
    headers = ctx.request_headers

    def get(name: str) -> str | None:
        value = headers.get(name)
        return str(value) if value is not None else None

    return get


def connect_error(exc: BaseException) -> ConnectError:
    """A cleanroom error as the Connect code the SDK maps to its exception."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, ServerError):
        code = Code.NOT_FOUND if exc.status == 404 else Code.INVALID_ARGUMENT
        return ConnectError(code, str(exc))
    if isinstance(exc, SessionClosed):
        return ConnectError(Code.NOT_FOUND, f"sandbox not found: {exc}")
    if isinstance(exc, GuestOperationError):
        return ConnectError(Code.INVALID_ARGUMENT, str(exc))
    return ConnectError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")


def _event(kind: str, value: Any) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof(kind, value))  # type: ignore[arg-type]


def _end(result: Any) -> pb.ProcessEvent:
    code = result.exit_code if result.exit_code is not None else -1
    if result.signal is not None:
        status = f"signal: {result.signal}"
    elif result.timed_out:
        status = "timed out"
    else:
        status = f"exit status {code}"
    end = pb.ProcessEvent.EndEvent(
        exit_code=code, exited=result.exit_code is not None, status=status
    )
    return _event("end", end)


class ProcessService(process_connect.Process):
    """The ``process.Process`` handlers (the connectrpc ``Process`` protocol)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    def _sandbox(self, ctx: Ctx) -> Sandbox:
        try:
            return sandbox_of(self.sandboxes, _header(ctx))
        except ServerError as exc:
            raise connect_error(exc) from exc

    def _process(self, sbx: Sandbox, selector: pb.ProcessSelector | None) -> Process:
        sel = selector.selector if selector is not None else None
        if sel is not None and sel.field == "pid":
            found = sbx.processes.get(int(sel.value))
        elif sel is not None and sel.field == "tag":
            found = next((p for p in sbx.processes.values() if p.tag == sel.value), None)
        else:
            found = None
        if found is None or found.result is not None:
            raise ConnectError(Code.NOT_FOUND, "process not found")
        return found

    # -- start / connect --------------------------------------------------------------------

    async def start(self, request: pb.StartRequest, ctx: Ctx) -> AsyncIterator[pb.StartResponse]:
        sbx = self._sandbox(ctx)
        config = request.process or pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        assert sbx.sb is not None
        pid = sbx.new_pid()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        holder: list[Process] = []

        def out(kind: str) -> Any:
            def relay(data: bytes) -> None:
                if holder:
                    holder[0].emit(kind, data)
                else:
                    queue.put_nowait((kind, data))

            return relay

        argv = [config.cmd, *config.args]
        user = user_of(_header(ctx))
        env = {**sbx.envs, **dict(config.envs)}
        terminal = None
        try:
            if request.has_field("pty"):
                size = request.pty.size if request.pty is not None else None
                rows, cols = (size.rows, size.cols) if size is not None else (24, 80)
                handle, terminal = await _spawn_pty(
                    sbx, argv, config.cwd or None, user, env, (rows or 24, cols or 80), out("pty")
                )
            else:
                handle = await sbx.sb.commands.run(
                    argv,
                    cwd=config.cwd or None,
                    user=user,
                    env=env or None,
                    on_stdout=out("stdout"),
                    on_stderr=out("stderr"),
                    background=True,
                )
        except CleanroomError as exc:
            raise connect_error(exc) from exc
        proc = Process(
            pid,
            handle,
            config.cmd,
            list(config.args),
            dict(config.envs),
            config.cwd or None,
            request.tag or None,
            [queue],
            terminal=terminal,
        )
        holder.append(proc)
        sbx.processes[pid] = proc
        waiter = asyncio.get_running_loop().create_task(self._wait(sbx, proc))
        waiter.add_done_callback(lambda t: t.cancelled() or t.exception())
        if not request.stdin and terminal is None:
            with contextlib.suppress(CleanroomError):
                await handle.close_stdin()
        deadline = ctx.timeout_ms
        async for event in self._events(proc, queue, pid, deadline):
            yield pb.StartResponse(event=event)

    async def connect(
        self, request: pb.ConnectRequest, ctx: Ctx
    ) -> AsyncIterator[pb.ConnectResponse]:
        sbx = self._sandbox(ctx)
        proc = self._process(sbx, request.process)
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        proc.listeners.append(queue)
        async for event in self._events(proc, queue, proc.pid, ctx.timeout_ms):
            yield pb.ConnectResponse(event=event)

    async def _wait(self, sbx: Sandbox, proc: Process) -> None:
        try:
            proc.result = await proc.handle.wait()
        except BaseException as exc:
            proc.emit("error", exc)
            raise
        finally:
            sbx.processes.pop(proc.pid, None)
        proc.emit("end", proc.result)

    async def _events(
        self,
        proc: Process,
        queue: asyncio.Queue[tuple[str, Any]],
        pid: int,
        deadline_ms: float | None,
    ) -> AsyncIterator[pb.ProcessEvent]:
        """The process's events from now on, until it ends (or the stream's deadline)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline_ms / 1000 if deadline_ms is not None else None
        try:
            yield _event("start", pb.ProcessEvent.StartEvent(pid=pid))
            while True:
                left = None if until is None else until - loop.time()
                if left is not None and left <= 0:
                    with contextlib.suppress(CleanroomError):
                        await proc.handle.kill()
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the command's timeout passed")
                try:
                    kind, data = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    continue
                if kind in ("stdout", "stderr", "pty"):
                    output = Oneof(kind, data)
                    yield _event("data", pb.ProcessEvent.DataEvent(output=output))  # type: ignore[arg-type]
                elif kind == "end":
                    yield _end(data)
                    return
                elif kind == "error":
                    raise connect_error(data)
                else:  # the sandbox ended
                    raise ConnectError(Code.UNAVAILABLE, "the sandbox ended")
        finally:
            with contextlib.suppress(ValueError):
                proc.listeners.remove(queue)

    # -- the process table ------------------------------------------------------------------

    async def list(self, request: pb.ListRequest, ctx: Ctx) -> pb.ListResponse:
        sbx = self._sandbox(ctx)
        infos = [
            pb.ProcessInfo(
                config=pb.ProcessConfig(cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd),
                pid=p.pid,
                tag=p.tag,
            )
            for p in sbx.processes.values()
            if p.result is None
        ]
        return pb.ListResponse(processes=infos)

    async def send_input(self, request: pb.SendInputRequest, ctx: Ctx) -> pb.SendInputResponse:
        proc = self._process(self._sandbox(ctx), request.process)
        await self._input(proc, request.input)
        return pb.SendInputResponse()

    async def _input(self, proc: Process, given: pb.ProcessInput | None) -> None:
        sel = given.input if given is not None else None
        if sel is None:
            return
        if (sel.field == "pty") != (proc.terminal is not None):
            raise ConnectError(Code.INVALID_ARGUMENT, f"{sel.field} input to this process")
        try:
            await proc.handle.send_stdin(bytes(sel.value))
        except CleanroomError as exc:
            raise connect_error(exc) from exc

    async def stream_input(
        self, request: AsyncIterator[pb.StreamInputRequest], ctx: Ctx
    ) -> pb.StreamInputResponse:
        sbx = self._sandbox(ctx)
        proc: Process | None = None
        async for message in request:
            ev = message.event
            if ev is None:
                continue
            if ev.field == "start":
                proc = self._process(sbx, ev.value.process)
            elif ev.field == "data":
                if proc is None:
                    raise ConnectError(Code.FAILED_PRECONDITION, "data before start")
                await self._input(proc, ev.value.input)
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Ctx) -> pb.CloseStdinResponse:
        proc = self._process(self._sandbox(ctx), request.process)
        try:
            await proc.handle.close_stdin()
        except CleanroomError as exc:
            raise connect_error(exc) from exc
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Ctx) -> pb.SendSignalResponse:
        proc = self._process(self._sandbox(ctx), request.process)
        try:
            await proc.handle.kill()  # SIGKILL to its process group, for SIGTERM too
        except CleanroomError as exc:
            raise connect_error(exc) from exc
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx: Ctx) -> pb.UpdateResponse:
        sbx = self._sandbox(ctx)
        proc = self._process(sbx, request.process)
        size = request.pty.size if request.pty is not None else None
        if proc.terminal is None or size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "only a PTY process can be resized")
        assert sbx.sb is not None
        try:
            async with sbx.sb.guard.call():
                await proc.terminal.resize(size.rows, size.cols)
        except CleanroomError as exc:
            raise connect_error(exc) from exc
        return pb.UpdateResponse()


async def _spawn_pty(
    sbx: Sandbox,
    argv: list[str],
    cwd: str | None,
    user: str | None,
    env: dict[str, str],
    size: tuple[int, int],
    relay: Any,
) -> tuple[CommandHandle, GuestProcess]:
    """``argv`` on a PTY of ``size`` (rows, cols), as ``cleanroom shell`` runs one: the
    session's env through its guard, a ``spawn`` step in its transcript, and a
    ``CommandHandle`` (``wait`` records the command) over it."""
    sb = sbx.sb
    assert sb is not None
    async with sb.guard.call() as env_:
        process: GuestProcess = await env_.spawn(
            argv,
            pty=size,
            cwd=cwd,
            user=None if user == "root" else user,
            env=env or None,
            on_stdout=relay,
        )
    ask = {"argv": argv, "cwd": cwd, "user": user, "env_names": sorted(env)}
    sb.guard.transcript.add("spawn", id=process.id, pty=list(size), **ask)
    return CommandHandle(sb.guard, process, ask, time.time()), process
