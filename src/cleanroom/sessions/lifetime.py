"""A session's two clocks: ``timeout_s`` (from ready) and ``idle_timeout_s`` (no call running).

One timer handle on the session's loop, moved on each change: while a call runs only
``timeout_s`` can fire; when the last call returns the idle clock starts again. Expiry calls
``on_expire(limit)`` once (the session then cancels its owner and its calls in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Lifetime:
    """Fires ``on_expire("timeout_s" | "idle_timeout_s")`` once, at the earlier of the two."""

    def __init__(
        self,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        on_expire: Callable[[str], None],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self.deadline = now + timeout_s if timeout_s else None
        self.timeout_s, self.idle_timeout_s = timeout_s, idle_timeout_s
        self._on_expire = on_expire
        self._busy = 0
        self._last = now
        self._handle: asyncio.TimerHandle | None = None
        self.expired: str | None = None
        self._arm()

    def _next(self) -> tuple[float, str] | None:
        """When the next limit falls due, and which one."""
        due: list[tuple[float, str]] = []
        if self.deadline is not None:
            due.append((self.deadline, "timeout_s"))
        if self.idle_timeout_s and not self._busy:
            due.append((self._last + self.idle_timeout_s, "idle_timeout_s"))
        return min(due) if due else None

    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        due = self._next() if self.expired is None else None
        if due is not None:
            self._handle = self._loop.call_at(due[0], self._fire, due[1])

    def _fire(self, limit: str) -> None:
        self._handle = None
        if self.expired is None:
            self.expired = limit
            self._on_expire(limit)

    def busy(self) -> None:
        """A call started: the idle clock stops."""
        self._busy += 1
        self._arm()

    def idle(self) -> None:
        """A call ended: the idle clock starts again once none runs."""
        self._busy -= 1
        self._last = self._loop.time()
        self._arm()

    def describe(self) -> str:
        """Why it expired, for the record (``limit`` and its seconds)."""
        seconds = self.timeout_s if self.expired == "timeout_s" else self.idle_timeout_s
        return f"the session's {self.expired} ({seconds:g} s) passed"

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
