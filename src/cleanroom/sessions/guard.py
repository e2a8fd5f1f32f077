"""What ``commands`` and ``files`` may use of a session: its live env, transcript and clocks.

Every guest call runs inside ``Guard.call()``: the session must still be open; the idle clock
stops while the call runs; the call's task is known (an expired session cancels it). A guest
that breaks the protocol or dies (``ProtocolError``, ``EnvCrashed``) ends the session: the
failure is kept (the guest's outcome, ``classify(..., in_guest=True)``) and every later call is
refused with ``SessionClosed``; so does one raised while the host judges what a guest sent
(``judged()``: a file name it offered, bytes over the quota). A ``GuestOperationError`` (a
missing file, an unknown user) is only that call's failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from cleanroom.core.states import EpisodeState, Failure, classify
from cleanroom.drivers.base import Env
from cleanroom.errors import EnvCrashed, ProtocolError, SessionClosed
from cleanroom.lifecycle.episode import Episode
from cleanroom.sessions.lifetime import Lifetime
from cleanroom.sessions.transcript import Transcript


class Guard:
    """One session's gate to its env (see the module docstring)."""

    def __init__(self, episode: Episode, transcript: Transcript) -> None:
        self.episode, self.transcript = episode, transcript
        self.lifetime: Lifetime | None = None
        self.failure: Failure | None = None
        self.failed_by: BaseException | None = None
        self.closed: str | None = None  # why no call is taken any more
        self.calls: set[asyncio.Task[Any]] = set()

    def env(self) -> Env:
        """The live env, or ``SessionClosed`` saying why there is none."""
        ep = self.episode
        why = self.closed
        if why is None and (ep.state is not EpisodeState.RUNNING or ep.env is None):
            why = f"it is {ep.state.value.lower()}"
        if why is not None:
            raise SessionClosed(f"session {ep.key.episode_id} has ended: {why}")
        assert ep.env is not None
        return ep.env

    @asynccontextmanager
    async def call(self) -> AsyncIterator[Env]:
        """A guest call: open-check, idle clock, task tracking, guest failures kept."""
        env = self.env()
        task = asyncio.current_task()
        if task is not None:
            self.calls.add(task)
        if self.lifetime is not None:
            self.lifetime.busy()
        try:
            with self.judged():
                yield env
        finally:
            if task is not None:
                self.calls.discard(task)
            if self.lifetime is not None:
                self.lifetime.idle()

    @contextmanager
    def judged(self) -> Iterator[None]:
        """Host-side work on what the guest sent (a name it offered, bytes over the quota): a
        ``ProtocolError`` or ``EnvCrashed`` raised in it is the guest's failure, as in a call."""
        try:
            yield
        except (ProtocolError, EnvCrashed) as exc:
            if self.failure is None:
                self.failure, self.failed_by = classify(exc, in_guest=True), exc
                self.closed = f"the guest failed: {type(exc).__name__}: {exc}"
            raise

    def cancel_calls(self, also: asyncio.Task[Any] | None = None) -> None:
        """Cancel every guest call in flight and ``also`` (each task once)."""
        for task in {*self.calls, *([also] if also is not None else [])}:
            task.cancel("cleanroom session limit")
