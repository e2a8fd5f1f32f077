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
import inspect
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from cleanroom.baseline.model import Baseline
from cleanroom.errors import SessionClosed
from cleanroom.sessions.commands import CommandHandle
from cleanroom.sessions.core import AsyncSession
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


class _Blocking:
    """A blocking view of an async part (``commands``, ``files``, a ``CommandHandle``): each
    coroutine method runs on the session's loop; a handle comes back blocking too."""

    def __init__(self, target: Any, holder: _Holder) -> None:
        self._target, self._holder = target, holder

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def blocking(*args: Any, **kwargs: Any) -> Any:
            answer = self._holder.call(attr(*args, **kwargs))
            return _Blocking(answer, self._holder) if isinstance(answer, CommandHandle) else answer

        return blocking


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
        self.commands: Any = _Blocking(sb.commands, holder)
        self.files: Any = _Blocking(sb.files, holder)
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

    def fork(self, n: int) -> Any:
        """``n`` new sessions from this one's state now (``AsyncSession.fork``)."""
        sb, holder = self._sb(), self._holder
        assert holder is not None
        return holder.call(sb.fork(n))

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
