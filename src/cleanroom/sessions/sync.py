"""``Session``: the blocking mirror of ``session()``, usable from any thread.

    with cr.Session(baseline="examples/agent-repair/baseline.toml", seed=3) as sb:
        r = sb.commands.run("pytest -q", cwd="/repo")      # the same names, blocking
        sb.files.write("/repo/fix.py", b"...");  sb.finish(reward=1.0)

Each session has its own event loop in a daemon thread (the VM's parent: it dies with it); the
async session lives in one task there (``_Holder``) and every call is marshalled onto it with
``run_coroutine_threadsafe``, so threads may share one session. A ``Session`` garbage-collected
while open, or left open at interpreter exit (``weakref.finalize`` runs then too), is
destroyed (outcome ``cancelled``) with a ``ResourceWarning``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import SessionClosed
from cleanroom.sessions.commands import CommandHandle, CommandResult, Commands, OutputCallback
from cleanroom.sessions.core import AsyncSession
from cleanroom.sessions.files import Files
from cleanroom.sessions.interact import ABANDONED
from cleanroom.sessions.opening import session


class _Holder:
    """The loop thread and the task that keeps the async session open (never the
    ``Session`` itself: the finalizer needs it without keeping the ``Session`` alive)."""

    def __init__(self, baseline: Baseline | str | Path, kwargs: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="cr-ses")
        self.thread.start()
        self.sb: AsyncSession | None = None
        self.ready: concurrent.futures.Future[AsyncSession] = concurrent.futures.Future()
        self.raise_in: BaseException | None = None  # the caller's exception, for the outcome
        self._close: asyncio.Event | None = None
        self.finished = threading.Event()  # set once the async session is fully closed
        self.task = asyncio.run_coroutine_threadsafe(self._hold(baseline, kwargs), self.loop)

    async def _hold(self, baseline: Baseline | str | Path, kwargs: dict[str, Any]) -> None:
        self._close = asyncio.Event()
        try:
            async with session(baseline, **kwargs) as sb:
                self.sb = sb
                self.ready.set_result(sb)
                await self._close.wait()
                if self.raise_in is not None:
                    raise self.raise_in
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise
        finally:
            self.finished.set()

    def call(self, awaitable: Awaitable[Any]) -> Any:
        """Run ``awaitable`` on the session's loop and wait for it here."""
        if not self.thread.is_alive():
            raise SessionClosed("the session is closed")

        async def _run() -> Any:
            return await awaitable

        try:
            return asyncio.run_coroutine_threadsafe(_run(), self.loop).result()
        except concurrent.futures.CancelledError:
            sb = self.sb
            if sb is not None and sb.expired is not None:
                raise sb.timeout_error() from None
            raise SessionClosed("the call was cancelled: the session is ending") from None

    def close(self, cancel: bool = False) -> None:
        """End the session (``cancel``: as abandoned) and wait until its env is gone; then
        stop the loop. The session's own ending error (a timeout, the caller's) is raised."""
        try:
            if self.loop.is_running() and not self.finished.is_set():
                if cancel:
                    self.task.cancel()  # cancels its task on the loop
                elif self._close is not None:
                    self.loop.call_soon_threadsafe(self._close.set)
                self.finished.wait()
            self.task.result()
        except concurrent.futures.CancelledError:
            if not cancel:
                raise
        finally:
            if self.loop.is_running():
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)
            if not self.thread.is_alive():
                self.loop.close()


class _Inline(concurrent.futures.ThreadPoolExecutor):
    """Runs ``to_thread`` work at once on the loop's thread: at interpreter exit no new thread
    may start (``concurrent.futures`` refuses), and the export and ledger writes must happen."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def _abandon(holder: _Holder, episode_id: str) -> None:
    """The finalizer of a ``Session`` dropped, or open at interpreter exit, while open."""
    warnings.warn(f"session {episode_id}: {ABANDONED}", ResourceWarning, stacklevel=1)
    if holder.loop.is_running():
        holder.loop.call_soon_threadsafe(holder.loop.set_default_executor, _Inline(1))
    holder.close(cancel=True)


class SyncCommandHandle:
    """``CommandHandle``'s blocking twin (a background command)."""

    def __init__(self, handle: CommandHandle, holder: _Holder) -> None:
        self._handle, self._holder = handle, holder

    @property
    def id(self) -> int:
        return self._handle.id

    @property
    def result(self) -> CommandResult | None:
        return self._handle.result

    def send_stdin(self, data: bytes) -> None:
        self._holder.call(self._handle.send_stdin(data))

    def close_stdin(self) -> None:
        self._holder.call(self._handle.close_stdin())

    def kill(self) -> None:
        self._holder.call(self._handle.kill())

    def wait(self) -> CommandResult:
        result: CommandResult = self._holder.call(self._handle.wait())
        return result


class SyncCommands:
    """``Commands``' blocking twin: ``run`` with the same arguments, on the session's loop."""

    def __init__(self, commands: Commands, holder: _Holder) -> None:
        self._commands, self._holder = commands, holder

    @overload
    def run(
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
    def run(
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
    ) -> SyncCommandHandle: ...

    def run(
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
    ) -> CommandResult | SyncCommandHandle:
        answer = self._holder.call(
            self._commands.run(
                cmd,
                cwd=cwd,
                timeout=timeout,
                user=user,
                env=env,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                background=background,
                stdin=stdin,
            )
        )
        if isinstance(answer, CommandHandle):
            return SyncCommandHandle(answer, self._holder)
        assert isinstance(answer, CommandResult)
        return answer


class SyncFiles:
    """``Files``' blocking twin: the same methods, on the session's loop."""

    def __init__(self, files: Files, holder: _Holder) -> None:
        self._files, self._holder = files, holder

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._holder.call(self._files.write(path, data, mode))

    def read(self, path: str) -> bytes:
        data: bytes = self._holder.call(self._files.read(path))
        return data

    def exists(self, path: str) -> bool:
        return bool(self._holder.call(self._files.exists(path)))

    def list(self, path: str) -> list[str]:
        names: list[str] = self._holder.call(self._files.list(path))
        return names

    def upload_dir(self, local_dir: str | Path, dest: str) -> int:
        return int(self._holder.call(self._files.upload_dir(local_dir, dest)))

    def download_dir(self, src: str, local_dir: str | Path) -> int:
        return int(self._holder.call(self._files.download_dir(src, local_dir)))


class Session:
    """``session(...)``'s blocking twin: the same arguments, ``commands``, ``files``,
    ``finish``; ``close()`` (or leaving ``with``) exports, destroys and confirms."""

    def __init__(self, baseline: Baseline | str | Path, **kwargs: Any) -> None:
        self._baseline, self._kwargs = baseline, kwargs
        self._holder: _Holder | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def open(self) -> Session:
        """Create the env (blocks until it is ready); ``with`` calls it."""
        if self._holder is not None:
            raise SessionClosed("this Session was opened already")
        holder = self._holder = _Holder(self._baseline, self._kwargs)
        try:
            sb = holder.ready.result()
        except BaseException:
            holder.close()
            raise
        self.episode = sb.episode
        self.commands = SyncCommands(sb.commands, holder)
        self.files = SyncFiles(sb.files, holder)
        self._finalizer = weakref.finalize(self, _abandon, holder, sb.episode_id)
        return self

    def _sb(self) -> AsyncSession:
        if self._holder is None or self._holder.sb is None:
            raise SessionClosed("the Session is not open")
        return self._holder.sb

    @property
    def steps(self) -> int:
        return self._sb().steps

    def finish(self, reward: float, info: dict[str, Any] | None = None, **kw: Any) -> None:
        sb, holder = self._sb(), self._holder
        assert holder is not None
        holder.call(_now(sb.finish, reward, info, **kw))

    def fork(self, n: int) -> list[AsyncSession]:
        """``n`` new sessions from this one's state now (``AsyncSession.fork``); they live on
        this session's loop (drive them with ``asyncio.run_coroutine_threadsafe``)."""
        sb, holder = self._sb(), self._holder
        assert holder is not None
        branches: list[AsyncSession] = holder.call(sb.fork(n))
        return branches

    def close(self, error: BaseException | None = None) -> None:
        """Export, destroy, confirm; idempotent. ``error``: end it as that exception would."""
        holder = self._holder
        if holder is None or self._finalizer is None or not self._finalizer.detach():
            return
        abandon = error is not None and not isinstance(error, Exception)  # Ctrl-C: cancelled
        holder.raise_in = None if abandon else error
        try:
            holder.close(cancel=abandon)
        except BaseException as exc:
            if exc is not error:
                raise

    def __enter__(self) -> Session:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(exc)


async def _now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A plain call made on the session's loop (it shares the transcript with its tasks)."""
    return fn(*args, **kwargs)
