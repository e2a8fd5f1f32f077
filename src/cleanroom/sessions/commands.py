"""``sb.commands``: run commands in a session's env, each a step of its transcript.

    r = await sb.commands.run("pytest -q", cwd="/repo", timeout=60, user="agent")
    r.exit_code, r.stdout, r.stderr, r.duration_s     # the exit code is data; r.check() raises
    h = await sb.commands.run(["python", "-m", "http.server"], background=True)
    await h.send_stdin(b"..."); await h.kill(); r = await h.wait()

A string runs under ``/bin/sh -c``; a list is the argv itself. ``env`` values reach the guest and
never the transcript (names only). Output callbacks get ``bytes`` chunks as they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

from cleanroom.agent.commands import GuestProcess
from cleanroom.agent.connection import ExecResult
from cleanroom.errors import ManifestError
from cleanroom.sessions.guard import Guard

OutputCallback = Callable[[bytes], Any]


@dataclass(frozen=True)
class CommandResult:
    """What a command did: ``exit_code`` (None if killed by ``signal``), decoded output."""

    argv: list[str]
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    signal: int | None = None
    timed_out: bool = False
    raw: ExecResult | None = None  # the bytes as the guest sent them

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> CommandResult:
        """This result if the command succeeded; else the env's typed command error."""
        if self.raw is not None:
            self.raw.check()
        return self


def _result(argv: list[str], r: ExecResult) -> CommandResult:
    return CommandResult(
        argv,
        r.exit_code,
        r.stdout.decode(errors="replace"),
        r.stderr.decode(errors="replace"),
        r.duration_s,
        r.signal,
        r.timed_out,
        r,
    )


def argv_of(cmd: str | list[str]) -> list[str]:
    """A command as argv: a string through ``/bin/sh -c``; an empty one is refused."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
    if not argv or (isinstance(cmd, str) and not cmd.strip()):
        raise ManifestError("commands.run: empty command")
    return argv


class Commands:
    """Commands of one session (built with its ``Guard`` only)."""

    def __init__(self, guard: Guard, secret_env: dict[str, str] | None = None) -> None:
        self._guard = guard
        self._secret_env = secret_env or {}  # every command gets the session's secrets

    def _kwargs(self, **given: Any) -> dict[str, Any]:
        """Only the options asked for (the caller's ``env`` over the session's secrets)."""
        env = given.pop("env", None)
        if self._secret_env or env:
            given["env"] = {**self._secret_env, **(env or {})}
        return {k: v for k, v in given.items() if v is not None}

    @overload
    async def run(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: Literal[False] = False,
        stdin: bytes | None = None,
    ) -> CommandResult: ...

    @overload
    async def run(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: Literal[True],
        stdin: bytes | None = None,
    ) -> CommandHandle: ...

    @overload
    async def run(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: bool,
        stdin: bytes | None = None,
    ) -> CommandResult | CommandHandle: ...

    async def run(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: bool = False,
        stdin: bytes | None = None,
    ) -> CommandResult | CommandHandle:
        """Run ``cmd``; a ``CommandResult``, or with ``background`` a ``CommandHandle``
        (``stdin`` is then its first input; more with ``send_stdin``)."""
        argv = argv_of(cmd)
        baseline = self._guard.episode.baseline
        run_as = baseline.run_as
        ask: dict[str, Any] = {
            "argv": argv,
            "cwd": cwd,
            "user": user or (run_as.user if run_as is not None else None),
            "env_names": sorted(env or {}),
        }
        # As ``docker exec`` does, an image baseline's Env and WorkingDir apply, and a command
        # runs as the image's User (through its static helper) unless another user is named.
        kw = self._kwargs(
            timeout_s=timeout,
            env={**baseline.env_for(user), **(env or {})} or None,
            cwd=cwd or baseline.workdir,
            user=None if user == "root" else user,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )
        guest_argv = baseline.as_user(argv, user) if user in (None, "root") else argv
        if background:
            return await self._spawn(ask, kw, stdin, guest_argv)
        started = time.time()
        async with self._guard.call() as e:
            try:
                r = await e.exec(guest_argv, **kw, stdin=stdin)
            except BaseException as exc:
                self._guard.transcript.command(**ask, started_at=started, error=repr(exc))
                raise
        self._guard.transcript.command(**ask, started_at=started, **_ended(r))
        return _result(argv, r)

    async def _spawn(
        self, ask: dict[str, Any], kw: dict[str, Any], stdin: bytes | None, argv: list[str]
    ) -> CommandHandle:
        async with self._guard.call() as e:
            process = await e.spawn(argv, **kw)
            if stdin is not None:
                await process.write_stdin(stdin)
        self._guard.transcript.add("spawn", id=process.id, **ask)
        return CommandHandle(self._guard, process, ask, time.time())


def _ended(r: ExecResult) -> dict[str, Any]:
    return {
        "exit_code": r.exit_code,
        "signal": r.signal,
        "timed_out": r.timed_out,
        "stdout": r.stdout,
        "stderr": r.stderr,
    }


class CommandHandle:
    """A command running in the background: ``send_stdin``, ``close_stdin``, ``kill``,
    ``wait`` (its ``CommandResult``, recorded as its transcript step)."""

    def __init__(
        self, guard: Guard, process: GuestProcess, ask: dict[str, Any], started: float
    ) -> None:
        self._guard, self._process, self._ask, self._started = guard, process, ask, started
        self.result: CommandResult | None = None

    @property
    def id(self) -> int:
        """The request id of the process (the transcript's ``spawn`` step names it)."""
        return self._process.id

    async def send_stdin(self, data: bytes) -> None:
        async with self._guard.call():
            await self._process.write_stdin(data)

    async def close_stdin(self) -> None:
        async with self._guard.call():
            await self._process.close_stdin()

    async def kill(self) -> None:
        """SIGKILL to its process group (``wait`` then says how it ended)."""
        async with self._guard.call():
            await self._process.kill()

    async def wait(self) -> CommandResult:
        if self.result is not None:
            return self.result
        async with self._guard.call():
            r: ExecResult = await self._process.wait()
        self._guard.transcript.command(
            **self._ask, started_at=self._started, background=True, **_ended(r)
        )
        self.result = _result(self._ask["argv"], r)
        return self.result
